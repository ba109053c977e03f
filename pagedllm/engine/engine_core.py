"""EngineCore: the scheduler, the executor, and the sharing that sits above the scheduler.

Everything that has to run beside the scheduler, step after step, lives here: admission of
tokenized requests, the step pipeline (schedule -> execute -> update; with async scheduling one
step in flight while the next is scheduled), parallel-sampling forks, beam-search steps and
speculative drafts. It speaks plain data only (EngineCoreRequest in, EngineCoreOutputs out), so
that it can run in the caller's process (LLM, tests) or in a process of its own behind the same
methods (serving). Tokenization, detokenization and stop strings are the front end's
(LLMEngine's), as in vLLM V1.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from pagedllm.checkpoint.hub import resolve_model
from pagedllm.config import EngineConfig
from pagedllm.core.draft_length import DraftLength
from pagedllm.core.draft_switch import DraftSwitch
from pagedllm.core.kv_cache_manager import max_blocks_per_request
from pagedllm.core.ngram_proposer import NgramProposer
from pagedllm.core.outputs import DRAFT_PLACEHOLDER, EngineCoreOutputs, EngineCoreRequest, RunnerOutput, SchedulerOutput
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.engine.beam_search import BeamSearch
from pagedllm.engine.engine_stats import EngineStats, StepObserver, StepTimings
from pagedllm.engine.parallel_sampling import ParallelSampling, sample_request_ids
from pagedllm.engine.step_trace import StepTraceWriter
from pagedllm.engine.trace_stream import TraceSampler, trace_snapshot
from pagedllm.errors import ValidationError
from pagedllm.executor import create_executor
from pagedllm.lora.request import LoRARequest
from pagedllm.runner.base import Runner
from pagedllm.runner_type import resolve_runner_type
from pagedllm.speculative_config import SpeculativeConfig
from pagedllm.structured_output.manager import StructuredOutputManager

logger = logging.getLogger("pagedllm")


class _Ran:
    """A step run on the calling thread: its result, read like the execute thread's Future
    (which would cost a lock and a condition per step for a value already known)."""

    __slots__ = ("_output",)

    def __init__(self, output: tuple[RunnerOutput, float]) -> None:
        self._output = output

    def result(self) -> tuple[RunnerOutput, float]:
        return self._output


class EngineCore:
    def __init__(self, config: EngineConfig, max_model_len: int, runner: Runner | None = None) -> None:
        cc = config.cache_config
        self.config = config
        self.executor = create_executor(config, runner, max_model_len)
        # The KV cache groups (a window per group; one full-attention group for most models).
        self.kv_cache_groups = tuple(self.executor.get_kv_cache_groups())
        num_blocks = cc.num_gpu_blocks_override or self.executor.determine_num_blocks(cc.block_size)
        if cc.num_gpu_blocks_override is None and cc.kv_cache_memory_bytes is None:
            # A default budget never holds more than every running request could fill at full
            # length (a window group holds only its window's blocks).
            sc = config.scheduler_config
            num_blocks = min(num_blocks, sc.max_num_seqs * max_blocks_per_request(
                self.kv_cache_groups, max_model_len, sc.max_num_batched_tokens, cc.block_size))
        self.executor.initialize(num_blocks, cc.block_size)
        self.num_blocks = num_blocks
        logger.info("KV cache: %d blocks of %d tokens (%d tokens); max_model_len %d",
                    num_blocks, cc.block_size, num_blocks * cc.block_size, max_model_len)
        lc, mc = config.lora_config, config.model_config
        # A generator that pools too chunks its pooling inputs like prompts (an encoder cannot).
        pooling_chunks = (config.pooler_config is not None
                          and resolve_runner_type(mc.runner, mc.model) == "generate")
        self.scheduler = Scheduler(config.scheduler_config, num_blocks, cc.block_size,
                                   max_model_len, cc.enable_prefix_caching, self.kv_cache_groups,
                                   max_loras=lc.max_loras if lc.enable_lora else 0,
                                   pooling_chunks=pooling_chunks)
        self.loras: dict[int, LoRARequest] = {}  # the adapters every rank holds, by lora_int_id
        # Sharing, at its own level above the scheduler's one rule.
        self.parallel_sampling = ParallelSampling(self.scheduler)
        self.beam_search = BeamSearch(self.scheduler)
        self.speculative_config = SpeculativeConfig.from_dict(config.speculative_config)
        async_scheduling = config.scheduler_config.async_scheduling
        # With async scheduling the runner fills n-gram drafts too: it holds the token in flight.
        self.proposer = None if async_scheduling else make_proposer(self.speculative_config)
        spec = self.speculative_config
        self.draft_length = (DraftLength(spec.num_speculative_tokens)
                             if spec is not None and spec.uses_draft_model and spec.adaptive_draft_length else None)
        # Drafting switches itself off where it stops paying, unless the user set where.
        self.draft_switch = (DraftSwitch() if self.draft_length is not None and spec.disable_by_batch_size is None
                             else None)
        # Structured outputs: grammars compile off the step loop; requests wait there meanwhile.
        mc = config.model_config
        so_defaults = config.structured_outputs_config or {}
        self.structured_output = StructuredOutputManager(
            mc.tokenizer or mc.model, disable_any_whitespace=so_defaults.get("disable_any_whitespace"))
        self.stats = EngineStats()
        # Called after every step's update with (SchedulerOutput, EngineCoreOutputs, StepTimings).
        self.step_observers: list[StepObserver] = []
        self._trace_sampler: TraceSampler | None = None  # on while the dashboard is watched
        if config.observability_config.trace_file:  # the step trace (docs/trace_schema.md)
            self.step_observers.append(StepTraceWriter.for_config(config, self.scheduler))
        # Steps scheduled whose results are not in yet: at most one more than the step being
        # finished with async scheduling (executed in order on one thread), none without.
        self._in_flight: deque[tuple[SchedulerOutput, Future | _Ran]] = deque()
        self._max_in_flight = 1 if async_scheduling else 0
        self._execute_thread = (ThreadPoolExecutor(1, thread_name_prefix="pagedllm-execute")
                                if async_scheduling else None)

    # -- requests ----------------------------------------------------------------------------
    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a tokenized request (its n samples, or its beam search); ValidationError, and
        nothing queued, if it could never run."""
        if request.beam_search_params is not None:
            self.beam_search.add(request.request_id, request.prompt_token_ids,
                                 request.beam_search_params, request.eos_token_ids,
                                 request.arrival_time, request.priority)
            return
        if request.lora_request is not None:
            self.add_lora(request.lora_request)
        if request.pooling_params is not None:  # one sequence, its output a vector
            self.scheduler.add_request(Request(
                request.request_id, request.prompt_token_ids, None, frozenset(),
                arrival_time=request.arrival_time, priority=request.priority,
                pooling_params=request.pooling_params))
            return
        params = request.sampling_params
        samples = []
        for i, sid in enumerate(sample_request_ids(request.request_id, params.n)):
            # Each sample is its own sequence; a seeded request seeds sample i with seed + i.
            sample_params = params if params.n == 1 else params.clone(
                n=1, seed=None if params.seed is None else params.seed + i)
            samples.append(Request(sid, request.prompt_token_ids, sample_params, request.eos_token_ids,
                                   arrival_time=request.arrival_time, priority=request.priority,
                                   cache_salt=request.cache_salt, lora_request=request.lora_request))
        if params.structured_outputs is None:
            self.parallel_sampling.add(samples[0], samples[1:])
            return
        if self._max_in_flight:
            raise ValidationError("structured_outputs do not work with async_scheduling yet: a "
                                  "request's next bitmask needs its last token; turn one off",
                                  "structured_outputs")
        # Admission's check now, while the caller can still get its ValidationError (not again
        # when the grammar is ready).
        self.scheduler.validate(samples[0])
        self.structured_output.add(request.request_id, params.structured_outputs,
                                   [s.request_id for s in samples], request.eos_token_ids,
                                   lambda: self.parallel_sampling.add(samples[0], samples[1:], validated=True))

    # -- LoRA adapters (docs/lora.md) --------------------------------------------------------
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter on every rank; ValidationError, and nothing loaded, if it does not fit."""
        if not self.config.lora_config.enable_lora:
            raise ValidationError("this engine serves no LoRA adapters; start it with enable_lora",
                                  "lora_request")
        if self.loras.get(lora_request.lora_int_id) != lora_request:
            # A Hub id is fetched here, once, so the ranks read one local folder.
            local = replace(lora_request, lora_path=resolve_model(lora_request.lora_path))
            refused = [e for e in self.executor.collective_rpc("add_lora", local) if e]
            if refused:  # ranks that took it drop it again: no rank keeps half an adapter set
                self.executor.collective_rpc("remove_lora", lora_request.lora_int_id)
                raise ValidationError(refused[0], "lora_request")
            self.loras[lora_request.lora_int_id] = lora_request
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        """Unload an adapter; refused (ValidationError) while requests use it, False if unknown."""
        users = [r for r in self.scheduler.requests.values()
                 if r.lora_request is not None and r.lora_request.lora_int_id == lora_int_id]
        if users:
            raise ValidationError(f"LoRA adapter {lora_int_id} is in use by {len(users)} requests; "
                                  "unload it when they finish", "lora_request")
        if self.loras.pop(lora_int_id, None) is None:
            return False
        self.executor.collective_rpc("remove_lora", lora_int_id)
        return True

    def list_loras(self) -> list[int]:
        return sorted(self.loras)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Abort requests (their samples or beam searches) now; idempotent, unknown ids ignored."""
        request_ids = list(request_ids)
        self.parallel_sampling.abort(request_ids)
        self.beam_search.abort(request_ids)
        self.structured_output.abort(request_ids)
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def finish_requests(self, request_ids: Iterable[str], stop_reason: str) -> None:
        """Finish sequences the front end stopped (a stop string showed up in the text)."""
        request_ids = list(request_ids)
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_STOPPED, stop_reason)
        self.structured_output.abort(request_ids)

    # -- the loop ----------------------------------------------------------------------------
    def step(self) -> EngineCoreOutputs | None:
        """Schedule and launch a step, then finish the oldest one in flight and return what it
        produced (None: nothing finished yet). Synchronous, that is the same step; with
        async_scheduling, step N+1 is scheduled and queued on the execute thread before step N's
        tokens are known (the runner feeds them in itself), so scheduling, the update and the
        front end's output processing run while the model computes."""
        t0 = time.perf_counter()
        failed = (self.structured_output.release_ready(
            wait_s=0.0 if self.scheduler.has_unfinished_requests() else 0.01)
            if self.structured_output.has_held() else [])
        # A step verifying drafts is scheduled past as if every draft were accepted; its update
        # rolls the rejected ones back (the runner, which knows first, already has).
        if self.scheduler.has_unfinished_requests() or not self._in_flight:
            scheduler_output = self.scheduler.schedule()
            scheduler_output.grammar_bitmask = self.structured_output.grammar_bitmask(
                scheduler_output, self.scheduler.requests)
            self._in_flight.append((scheduler_output, self._launch(scheduler_output)))
        t1 = time.perf_counter()
        if len(self._in_flight) <= self._max_in_flight and self.scheduler.has_unfinished_requests():
            return None  # the first step of a run: nothing has finished yet
        scheduler_output, result = self._in_flight.popleft()
        runner_output, execute_s = result.result()
        t2 = time.perf_counter()
        if self.draft_switch is not None:
            self.draft_switch.observe(scheduler_output.total_num_scheduled_tokens, max(
                map(len, scheduler_output.scheduled_spec_decode_tokens.values()), default=0), execute_s)
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        timings = StepTimings(t1 - t0, t2 - t1, time.perf_counter() - t2)
        for observe in self.step_observers:  # the step trace, the dashboard's feed
            observe(scheduler_output, outputs, timings)
        for sid in failed:  # never queued: the front end learns here that they ended
            outputs.finished[sid] = ("abort", None)
            outputs.add(sid, [])
        self._share(outputs, scheduler_output.scheduled_spec_decode_tokens,
                    stalled=scheduler_output.is_empty and self.scheduler.has_unfinished_requests())
        self.stats.add(outputs.scheduler_stats)
        return outputs

    def _launch(self, scheduler_output: SchedulerOutput) -> Future | _Ran:
        if self._execute_thread is not None:
            return self._execute_thread.submit(self._execute, scheduler_output)
        return _Ran(self._execute(scheduler_output))

    def _execute(self, scheduler_output: SchedulerOutput) -> tuple[RunnerOutput, float]:
        """The runner's output and the seconds the step took."""
        t0 = time.perf_counter()
        return self.executor.execute_model(scheduler_output), time.perf_counter() - t0

    def _share(self, outputs: EngineCoreOutputs, scheduled_drafts: dict[str, list[int]], stalled: bool) -> None:
        """After the scheduler's update: samples fork, beams advance, drafts are proposed."""
        self.parallel_sampling.step(outputs)
        self.structured_output.accept(outputs, self.scheduler.requests)
        for group in self.beam_search.step(outputs, stalled):
            outputs.finished_beams[group.request_id] = group.results()
        if self.speculative_config is not None:
            self._propose_drafts(outputs, scheduled_drafts)

    def _propose_drafts(self, outputs: EngineCoreOutputs, scheduled_drafts: dict[str, list[int]]) -> None:
        """Each request that got a token gets its next drafts: n-gram ones, or the slots the
        runner's draft model fills (runner/draft_model.py), as many as its acceptance pays for,
        and none while drafting does not pay at this batch (core/draft_switch.py)."""
        spec, lengths, switch = self.speculative_config, self.draft_length, self.draft_switch
        requests, live = self.scheduler.requests, []
        for rid, new_ids in zip(outputs.req_ids, outputs.new_token_ids):
            if lengths is not None and rid in scheduled_drafts and new_ids:
                lengths.observe(rid, len(scheduled_drafts[rid]), len(new_ids) - 1)
            if new_ids and rid not in outputs.finished and rid in requests:
                live.append(requests[rid])
        user_off = spec.disable_by_batch_size is not None and len(requests) >= spec.disable_by_batch_size
        if lengths is not None:
            lengths.new_step()
        plans = {r.request_id: lengths.plan(r.request_id) for r in live} if lengths is not None else {}
        switch_off = switch is not None and not switch.pays(plans.values())
        # Paused requests probe while a draft at the prior acceptance would pay at this batch: where
        # the rows are compute, a probe's catch-up of the draft costs more than it could find.
        probe = switch is None or switch.pays([lengths.probe_plan()] * len(live))
        for req in live:
            rid, params = req.request_id, req.sampling_params
            # A seeded draw's tokens depend on how many drafts it verified: those follow its own
            # acceptance only, never the batch, the clock or the other requests' pauses.
            seeded = params is not None and params.seed is not None and not params.sampling_type_greedy
            if user_off or (switch_off and not seeded):
                drafts = []
            elif self.proposer is not None:
                drafts = self.structured_output.truncate_drafts(rid, self.proposer.propose(req.all_token_ids))
            elif self.structured_output.has_grammar(rid):
                drafts = []  # the bitmask needs the drafts before the step: served without them
            else:
                k = spec.num_speculative_tokens if lengths is None else lengths.num_tokens(
                    rid, own_phase=seeded, planned=plans[rid][0], probe=probe)
                drafts = [DRAFT_PLACEHOLDER] * k
            self.scheduler.set_draft_tokens(rid, drafts)
        if lengths is not None:
            lengths.retain(requests)

    # -- state -------------------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return (self.scheduler.has_unfinished_requests() or bool(self.parallel_sampling.pending)
                or self.structured_output.has_held()
                or self.beam_search.has_unfinished() or bool(self._in_flight))

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    # -- the live dashboard's source (engine/trace_stream.py) --------------------------------
    def set_trace_stream(self, enabled: bool) -> None:
        """Sample step records onto the outputs (True; again: a new viewer) or stop (False)."""
        if enabled and self._trace_sampler is None:
            self._trace_sampler = TraceSampler(self.scheduler)
            self.step_observers.append(self._trace_sampler)
        elif not enabled and self._trace_sampler is not None:
            self.step_observers.remove(self._trace_sampler)
            self._trace_sampler = None
        if self._trace_sampler is not None:
            self._trace_sampler.request_block_map()

    def trace_snapshot(self) -> dict[str, Any]:
        return trace_snapshot(self.scheduler)

    def get_metrics(self) -> dict[str, float]:
        """Gauges (read now) and counters (the steps' SchedulerStats added up)."""
        s = self.scheduler
        return {
            "pagedllm:num_requests_running": len(s.running),
            "pagedllm:num_requests_waiting": len(s.waiting),
            "pagedllm:kv_cache_usage_perc": s.kv_cache_manager.usage,
            "pagedllm:num_gpu_blocks": self.num_blocks,
            **self.stats.as_metrics(),
        }

    def shutdown(self) -> None:
        if self._execute_thread is not None:
            self._execute_thread.shutdown(wait=True)
        self.executor.shutdown()
        self.structured_output.shutdown()
        for observer in self.step_observers:  # the step trace's file, among others
            getattr(observer, "close", lambda: None)()


def make_proposer(spec: SpeculativeConfig | None) -> NgramProposer | None:
    """The engine core's own proposer: n-gram lookup; a draft model proposes in the runner."""
    if spec is None or spec.uses_draft_model:
        return None
    return NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)

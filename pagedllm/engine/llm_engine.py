"""LLMEngine: the synchronous engine loop.

    schedule() -> execute_model() -> update_from_output() -> sharing -> process_outputs()

It owns the parts around the scheduler: input and output processing, the executor, and the
sequence sharing that sits above the scheduler's one rule (parallel sampling, beam search,
speculative drafts). Everything here is plain Python; the executor builds the real runner
(torch) lazily, so importing the engine never imports torch.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from pagedllm.beam_search_params import BeamSearchParams
from pagedllm.config import EngineConfig
from pagedllm.core.ngram_proposer import NgramProposer
from pagedllm.core.outputs import EngineCoreOutputs, SchedulerOutput
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.engine.beam_search import BeamSearch, BeamSearchGroup
from pagedllm.engine.engine_stats import EngineStats, StepObserver, StepTimings
from pagedllm.engine.input_processor import InputProcessor, PromptType
from pagedllm.engine.model_info import ModelInfo
from pagedllm.engine.output_processor import OutputProcessor, ParentRequest
from pagedllm.engine.parallel_sampling import ParallelSampling
from pagedllm.engine.step_trace import StepTraceWriter
from pagedllm.errors import ValidationError
from pagedllm.executor import create_executor
from pagedllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagedllm.runner.base import Runner
from pagedllm.sampling_params import SamplingParams


logger = logging.getLogger("pagedllm")


def make_proposer(speculative_config: dict | None) -> NgramProposer | None:
    """vLLM's speculative_config: {"method": "ngram", "num_speculative_tokens": k,
    "prompt_lookup_max": 4, "prompt_lookup_min": 2}."""
    if not speculative_config:
        return None
    if not isinstance(speculative_config, dict):
        raise ValidationError("speculative_config must be a JSON object", "speculative_config")
    cfg = dict(speculative_config)
    method = cfg.pop("method", "ngram")
    if method not in ("ngram", "ngram-prompt-lookup"):
        raise ValidationError(f"speculative method {method!r} is not supported; use 'ngram'",
                              "speculative_config")
    k = cfg.pop("num_speculative_tokens", None)
    lo, hi = cfg.pop("prompt_lookup_min", None), cfg.pop("prompt_lookup_max", None)
    if cfg:
        raise ValidationError(f"unknown speculative_config keys: {sorted(cfg)}", "speculative_config")
    if not isinstance(k, int) or k < 1:
        raise ValidationError("speculative_config needs num_speculative_tokens >= 1", "speculative_config")
    hi = hi if hi is not None else (lo if lo is not None else 4)
    lo = lo if lo is not None else min(2, hi)
    if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
        raise ValidationError("need 1 <= prompt_lookup_min <= prompt_lookup_max", "speculative_config")
    return NgramProposer(k, lo, hi)


class LLMEngine:
    def __init__(self, config: EngineConfig, runner: Runner | None = None,
                 model_info: ModelInfo | None = None, tokenizer: Any | None = None,
                 load_tokenizer: bool = True) -> None:
        mc, cc = config.model_config, config.cache_config
        self.config = config
        self.model_info = model_info or ModelInfo.from_folder(mc.model)
        if tokenizer is None and load_tokenizer:
            from pagedllm.engine.tokenizer import load_tokenizer as _load

            tokenizer = _load(mc.tokenizer or mc.model)
        self.tokenizer = tokenizer
        max_pos = self.model_info.max_position_embeddings
        if mc.max_model_len is not None and mc.max_model_len > max_pos:
            raise ValidationError(
                f"max_model_len={mc.max_model_len} exceeds the model's max_position_embeddings "
                f"({max_pos}); lower it", "max_model_len")
        # Resolved once here and passed down (the runner and the scheduler never re-derive it).
        self.max_model_len = mc.max_model_len or max_pos

        self.executor = create_executor(config, runner, self.max_model_len)
        num_blocks = cc.num_gpu_blocks_override or self.executor.determine_num_blocks(cc.block_size)
        self.executor.initialize(num_blocks, cc.block_size)
        self.num_blocks = num_blocks
        logger.info("KV cache: %d blocks of %d tokens (%d tokens); max_model_len %d",
                    num_blocks, cc.block_size, num_blocks * cc.block_size, self.max_model_len)
        self.scheduler = Scheduler(config.scheduler_config, num_blocks, cc.block_size,
                                   self.max_model_len, cc.enable_prefix_caching)
        # Sharing, at its own level above the scheduler's one rule.
        self.parallel_sampling = ParallelSampling(self.scheduler)
        self.beam_search = BeamSearch(self.scheduler)
        self.proposer = make_proposer(config.speculative_config)
        self.input_processor = InputProcessor(tokenizer, self.model_info.vocab_size)
        self.output_processor = OutputProcessor(tokenizer)
        self.stats = EngineStats()
        # Called after every step's update with (SchedulerOutput, EngineCoreOutputs, StepTimings).
        self.step_observers: list[StepObserver] = []
        if config.observability_config.trace_file:  # the step trace (docs/trace_schema.md)
            self.step_observers.append(StepTraceWriter.for_config(config, self.scheduler))
        self._finished_beams: list[BeamSearchGroup] = []
        # Steps scheduled whose results are not in yet: at most one more than the step being
        # finished with async scheduling (executed in order on one thread), none without.
        self._in_flight: deque[tuple[SchedulerOutput, Future]] = deque()
        async_scheduling = config.scheduler_config.async_scheduling
        if async_scheduling and self.proposer is not None:
            raise ValidationError("async_scheduling does not work with speculative decoding yet: "
                                  "drafts need the previous token; turn one of them off",
                                  "async_scheduling")
        self._max_in_flight = 1 if async_scheduling else 0
        self._execute_thread = (ThreadPoolExecutor(1, thread_name_prefix="pagedllm-execute")
                                if async_scheduling else None)

    @classmethod
    def from_engine_args(cls, model: str | None = None, **engine_args: Any) -> "LLMEngine":
        return cls(EngineConfig.from_kwargs(model, **engine_args))

    def default_sampling_params(self) -> SamplingParams:
        """vLLM's default: the model's generation_config.json sampling values, if any."""
        return SamplingParams(**self.model_info.generation_defaults)

    # -- requests ----------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0,
                    cache_salt: str | None = None) -> None:
        """Validate and queue a request; raises ValidationError (and queues nothing) if bad."""
        self._check_new_id(request_id)
        params = params if params is not None else self.default_sampling_params()
        if not isinstance(params, SamplingParams):
            raise ValidationError("sampling_params must be a SamplingParams", "sampling_params")
        if params.logit_bias and any(not 0 <= t < self.model_info.vocab_size for t in params.logit_bias):
            raise ValidationError("logit_bias has a token id outside the vocabulary", "logit_bias")
        if not isinstance(priority, int):
            raise ValidationError(f"priority must be an integer, got {priority!r}", "priority")
        if params.n > self.config.scheduler_config.max_num_seqs:
            raise ValidationError(f"n={params.n} parallel samples exceed max_num_seqs="
                                  f"{self.config.scheduler_config.max_num_seqs}; lower n or raise "
                                  f"max_num_seqs", "n")
        text, prompt_ids = self.input_processor.process_prompt(prompt)
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        child_ids = [request_id] if params.n == 1 else [f"{i}_{request_id}" for i in range(params.n)]
        children = []
        for i, cid in enumerate(child_ids):
            child_params = params
            if params.n > 1:
                # Each sample is its own sequence; a seeded request seeds sample i with seed + i.
                child_params = params.clone(n=1, seed=None if params.seed is None else params.seed + i)
            children.append(Request(cid, prompt_ids, child_params, self.model_info.eos_token_ids,
                                    arrival_time=arrival_time, priority=priority, cache_salt=cache_salt))
        self.parallel_sampling.add(children[0], children[1:])
        parent = ParentRequest(request_id, text, prompt_ids, params, RequestMetrics(arrival_time))
        self.output_processor.add_request(parent, child_ids)
        self.stats.num_prompt_tokens += len(prompt_ids)

    def add_beam_search_request(self, request_id: str, prompt: PromptType, params: BeamSearchParams,
                                priority: int = 0) -> None:
        """Queue a beam search; its result comes out of step() as one RequestOutput whose
        outputs are the beams, best first (``cumulative_logprob`` unpenalised)."""
        self._check_new_id(request_id)
        text, prompt_ids = self.input_processor.process_prompt(prompt)
        group = self.beam_search.add(request_id, prompt_ids, params, self.model_info.eos_token_ids,
                                     time.monotonic(), priority)
        group.prompt_text = text
        self.stats.num_prompt_tokens += len(prompt_ids)

    def _check_new_id(self, request_id: str) -> None:
        if request_id in self.output_processor.parents or request_id in self.beam_search.groups:
            raise ValidationError(f"request id {request_id!r} is already in use", "request_id")

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Abort now (idempotent): blocks are freed at once; no further output is produced."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        child_ids = self.output_processor.abort_requests(list(request_ids))
        self.parallel_sampling.abort(child_ids)
        self.beam_search.abort(request_ids)
        self.scheduler.finish_requests(child_ids, RequestStatus.FINISHED_ABORTED)

    # -- the loop ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule and launch a step, then finish the oldest one in flight. Synchronous, that
        is the same step; with async_scheduling, step N+1 is scheduled and queued on the execute
        thread before step N's tokens are known (the runner feeds them in itself), so the
        scheduling, the update and the output processing run while the model computes."""
        t0 = time.perf_counter()
        if self.scheduler.has_unfinished_requests() or not self._in_flight:
            scheduler_output = self.scheduler.schedule()
            self._record_first_scheduled(scheduler_output.scheduled_new_reqs)
            self._in_flight.append((scheduler_output, self._launch(scheduler_output)))
        t1 = time.perf_counter()
        if len(self._in_flight) <= self._max_in_flight and self.scheduler.has_unfinished_requests():
            return []  # the first step of a run: nothing has finished yet
        scheduler_output, result = self._in_flight.popleft()
        runner_output = result.result()
        t2 = time.perf_counter()
        core_outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        timings = StepTimings(t1 - t0, t2 - t1, time.perf_counter() - t2)
        for observe in self.step_observers:  # the step trace, the dashboard's feed
            observe(scheduler_output, core_outputs, timings)
        self._share(core_outputs, stalled=scheduler_output.is_empty and self.scheduler.has_unfinished_requests())
        outputs, stopped = self.output_processor.process_outputs(core_outputs)
        for child_id, stop_str in stopped:  # a stop string showed up in the text
            self.scheduler.finish_requests(child_id, RequestStatus.FINISHED_STOPPED, stop_str)
        outputs += [self._beam_output(g) for g in self._finished_beams]
        self.stats.add(core_outputs.scheduler_stats, sum(1 for o in outputs if o.finished))
        return outputs

    def _launch(self, scheduler_output: SchedulerOutput) -> Future:
        if self._execute_thread is not None:
            return self._execute_thread.submit(self.executor.execute_model, scheduler_output)
        done: Future = Future()
        done.set_result(self.executor.execute_model(scheduler_output))
        return done

    def _share(self, core_outputs: EngineCoreOutputs, stalled: bool) -> None:
        """After the scheduler's update: samples fork, beams advance, drafts are proposed."""
        self.parallel_sampling.step(core_outputs)
        self._finished_beams = self.beam_search.step(core_outputs, stalled)
        if self.proposer is not None:
            finished = core_outputs.finished
            for rid, new_ids in zip(core_outputs.req_ids, core_outputs.new_token_ids):
                req = self.scheduler.requests.get(rid)
                if new_ids and rid not in finished and req is not None:
                    self.scheduler.set_draft_tokens(rid, self.proposer.propose(req.all_token_ids))

    def _beam_output(self, group: BeamSearchGroup) -> RequestOutput:
        completions = []
        for i, beam in enumerate(group.results()):
            ids = beam.tokens
            shown = ids[:-1] if beam.finish_reason == "stop" else ids
            text = self.tokenizer.decode(shown, skip_special_tokens=True) if self.tokenizer is not None else ""
            completions.append(CompletionOutput(i, text, list(ids), beam.cum_logprob, None,
                                                beam.finish_reason))
        return RequestOutput(group.request_id, group.prompt_text, group.prompt_token_ids, None,
                             completions, True, beam_scores=[b.score for b in group.results()])

    def _record_first_scheduled(self, new_reqs: list) -> None:
        """Stamp RequestMetrics.first_scheduled_time (the server's queue-time histogram)."""
        if not new_reqs:
            return
        now = time.monotonic()
        states = self.output_processor.request_states
        for new in new_reqs:
            state = states.get(new.req_id)
            if state is not None and state.parent.metrics.first_scheduled_time is None:
                state.parent.metrics.first_scheduled_time = now

    def has_unfinished_requests(self) -> bool:
        return (self.scheduler.has_unfinished_requests() or self.output_processor.has_unfinished_requests()
                or self.beam_search.has_unfinished() or bool(self._in_flight))

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.parents) + len(self.beam_search.groups)

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    def shutdown(self) -> None:
        if self._execute_thread is not None:
            self._execute_thread.shutdown(wait=True)
        self.executor.shutdown()
        for observer in self.step_observers:  # the step trace's file, among others
            getattr(observer, "close", lambda: None)()

    # -- metrics -----------------------------------------------------------------------------
    def get_metrics(self) -> dict[str, float]:
        """Counters (the steps' SchedulerStats added up) and gauges (read now), named as the
        server exports them."""
        s = self.scheduler
        return {
            "pagedllm:num_requests_running": len(s.running),
            "pagedllm:num_requests_waiting": len(s.waiting),
            "pagedllm:kv_cache_usage_perc": s.kv_cache_manager.usage,
            "pagedllm:num_gpu_blocks": self.num_blocks,
            **self.stats.as_metrics(),
        }

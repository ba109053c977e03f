"""LLMEngine: the synchronous engine loop.

    schedule() -> execute_model() -> update_from_output() -> process_outputs()

Everything above the runner is plain Python; the real runner (torch) is created through a lazy
factory so that importing the engine never imports torch.
"""
from __future__ import annotations

import logging
import time
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.core.ngram_proposer import NgramProposer
from pagedllm.core.outputs import EngineCoreOutputs
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.engine.input_processor import InputProcessor, PromptType
from pagedllm.engine.model_info import ModelInfo
from pagedllm.engine.output_processor import OutputProcessor, ParentRequest
from pagedllm.errors import ValidationError
from pagedllm.engine.beam_search import BeamSearchGroup, BeamSearchParams
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


def create_model_runner(config: EngineConfig, model_info: ModelInfo) -> Runner:
    from pagedllm.runner.model_runner import ModelRunner  # torch lives below this line

    return ModelRunner(config, model_info)


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
        self.max_model_len = mc.max_model_len or max_pos

        self.runner = runner if runner is not None else create_model_runner(config, self.model_info)
        num_blocks = cc.num_gpu_blocks_override or self.runner.determine_num_blocks(cc.block_size)
        self.runner.initialize_kv_cache(num_blocks, cc.block_size)
        self.num_blocks = num_blocks
        logger.info("KV cache: %d blocks of %d tokens (%d tokens); max_model_len %d",
                    num_blocks, cc.block_size, num_blocks * cc.block_size, self.max_model_len)
        self.scheduler = Scheduler(config.scheduler_config, num_blocks, cc.block_size,
                                   self.max_model_len, cc.enable_prefix_caching,
                                   proposer=make_proposer(config.speculative_config))
        self.input_processor = InputProcessor(tokenizer, self.model_info.vocab_size)
        self.output_processor = OutputProcessor(tokenizer)
        self.num_prompt_tokens = 0
        self.num_requests_finished = 0
        self.beam_groups: dict[str, BeamSearchGroup] = {}
        self._beam_slot_to_group: dict[str, BeamSearchGroup] = {}

    @classmethod
    def from_engine_args(cls, model: str | None = None, **engine_args: Any) -> "LLMEngine":
        return cls(EngineConfig.from_kwargs(model, **engine_args))

    @property
    def num_cache_tokens(self) -> int:
        return self.num_blocks * self.config.cache_config.block_size

    def default_sampling_params(self) -> SamplingParams:
        """vLLM's default: the model's generation_config.json sampling values, if any."""
        return SamplingParams(**self.model_info.generation_defaults)

    # -- requests ----------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0,
                    cache_salt: str | None = None) -> None:
        """Validate and queue a request; raises ValidationError (and queues nothing) if bad."""
        if request_id in self.output_processor.parents:
            raise ValidationError(f"request id {request_id!r} is already in use", "request_id")
        params = params if params is not None else self.default_sampling_params()
        if not isinstance(params, SamplingParams):
            raise ValidationError("sampling_params must be a SamplingParams", "sampling_params")
        if params.logit_bias and any(not 0 <= t < self.model_info.vocab_size for t in params.logit_bias):
            raise ValidationError("logit_bias has a token id outside the vocabulary", "logit_bias")
        if not isinstance(priority, int):
            raise ValidationError(f"priority must be an integer, got {priority!r}", "priority")
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
        # The first child prefills the prompt; the others fork from it (sharing its blocks).
        self.scheduler.add_request(children[0], forks=children[1:])
        parent = ParentRequest(request_id, text, prompt_ids, params, RequestMetrics(arrival_time))
        self.output_processor.add_request(parent, child_ids)
        self.num_prompt_tokens += len(prompt_ids)

    def add_beam_search_request(self, request_id: str, prompt: PromptType, params: BeamSearchParams,
                                priority: int = 0) -> None:
        """Queue a beam search; its result comes out of step() as one RequestOutput whose
        outputs are the beams, best first (``cumulative_logprob`` unpenalised)."""
        if request_id in self.output_processor.parents or request_id in self.beam_groups:
            raise ValidationError(f"request id {request_id!r} is already in use", "request_id")
        text, prompt_ids = self.input_processor.process_prompt(prompt)
        eos = self.model_info.eos_token_ids
        k = BeamSearchGroup.num_logprobs(params.beam_width, 0 if params.ignore_eos else len(eos))
        if k > 20:
            raise ValidationError(f"beam_width={params.beam_width} needs {k} logprobs per step; "
                                  f"the limit is 20", "beam_width")
        slot_params = SamplingParams(temperature=0.0, max_tokens=params.max_tokens, logprobs=k,
                                     ignore_eos=True, detokenize=False)
        slot_ids = [f"beam{i}_{request_id}" for i in range(params.beam_width)]
        now = time.monotonic()
        slots = [Request(sid, prompt_ids, slot_params, eos, arrival_time=now, priority=priority)
                 for sid in slot_ids]
        for slot in slots:
            slot.is_beam = True
        self.scheduler.add_request(slots[0], forks=slots[1:])
        group = BeamSearchGroup(request_id, prompt_ids, params, slot_ids, eos)
        group.prompt_text = text
        self.beam_groups[request_id] = group
        for sid in slot_ids:
            self._beam_slot_to_group[sid] = group
        self.num_prompt_tokens += len(prompt_ids)

    def _process_beam_outputs(self, core_outputs: EngineCoreOutputs) -> list[RequestOutput]:
        """Route beam-slot reports to their groups; advance every group whose beams all reported.
        (The output processor skips the slots' rows: it does not know their ids.)"""
        if not self.beam_groups:
            return []
        touched = {}
        for rid, logprobs in core_outputs.new_logprobs.items():
            group = self._beam_slot_to_group.get(rid)
            if group is not None:
                group.add_report(rid, logprobs[-1])
                touched[group.request_id] = group
        results = []
        for group in touched.values():
            if not group.ready():
                continue
            assignments, idle = group.advance()
            if assignments:
                self.scheduler.reassign_beams(assignments)
            self._finish_beam_slots(idle)
            if group.done:
                self._finish_beam_slots(group.slot_ids)
                del self.beam_groups[group.request_id]
                results.append(self._beam_output(group))
        return results

    def _finish_beam_slots(self, slot_ids: list[str]) -> None:
        for sid in slot_ids:
            self._beam_slot_to_group.pop(sid, None)
        self.scheduler.finish_requests(slot_ids, RequestStatus.FINISHED_STOPPED)

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

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Abort now (idempotent): blocks are freed at once; no further output is produced."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        child_ids = self.output_processor.abort_requests(list(request_ids))
        for rid in request_ids:
            group = self.beam_groups.pop(rid, None)
            if group is not None:
                for sid in group.slot_ids:
                    self._beam_slot_to_group.pop(sid, None)
                child_ids.extend(group.slot_ids)
        self.scheduler.finish_requests(child_ids, RequestStatus.FINISHED_ABORTED)

    # -- the loop ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        scheduler_output = self.scheduler.schedule()
        self._record_first_scheduled(scheduler_output.scheduled_new_reqs)
        runner_output = self.runner.execute_model(scheduler_output)
        core_outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        beam_results = self._process_beam_outputs(core_outputs)
        outputs, stopped = self.output_processor.process_outputs(core_outputs)
        for child_id, stop_str in stopped:  # a stop string showed up in the text
            self.scheduler.finish_requests(child_id, RequestStatus.FINISHED_STOPPED, stop_str)
        outputs += beam_results
        self.num_requests_finished += sum(1 for o in outputs if o.finished)
        return outputs

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
                or bool(self.beam_groups))

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.parents)

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    # -- metrics -----------------------------------------------------------------------------
    def get_metrics(self) -> dict[str, float]:
        """Counters and gauges, named as the server exports them."""
        s = self.scheduler
        kv = s.kv_cache_manager
        return {
            "pagedllm:num_requests_running": len(s.running),
            "pagedllm:num_requests_waiting": len(s.waiting),
            "pagedllm:kv_cache_usage_perc": kv.usage,
            "pagedllm:num_preemptions": s.num_preemptions,
            "pagedllm:prefix_cache_queries": kv.prefix_cache_queries,
            "pagedllm:prefix_cache_hits": kv.prefix_cache_hits,
            "pagedllm:prompt_tokens": self.num_prompt_tokens,
            "pagedllm:prompt_tokens_computed": s.num_prompt_tokens_computed,
            "pagedllm:generation_tokens": s.num_generation_tokens,
            "pagedllm:request_success": self.num_requests_finished,
            "pagedllm:num_gpu_blocks": self.num_blocks,
            "pagedllm:spec_decode_num_drafts": s.num_drafts,
            "pagedllm:spec_decode_num_draft_tokens": s.num_draft_tokens,
            "pagedllm:spec_decode_num_accepted_tokens": s.num_accepted_tokens,
        }

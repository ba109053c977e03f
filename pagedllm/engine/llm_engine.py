"""LLMEngine: the front end of the engine loop.

    process inputs -> EngineCore.step() (schedule, execute, update, sharing) -> process outputs

It tokenizes and validates requests, hands them to the engine core as plain data, and turns
what each step produced into RequestOutputs (detokenization, stop strings, n samples gathered
under their parent, beam results). The engine core, with the scheduler and the executor, runs
here (``LLM``, tests) or in its own process behind the same methods (serving). Everything is
plain Python; the executor builds the real runner (torch) lazily.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from pagedllm.beam_search_params import BeamSearchParams
from pagedllm.checkpoint.hub import resolve_engine_args
from pagedllm.checkpoint.source import open_checkpoint
from pagedllm.config import EngineConfig
from pagedllm.core.outputs import EngineCoreOutputs, EngineCoreRequest
from pagedllm.engine.core_client import EngineCoreClient, MPEngineCoreClient, multiprocessing_enabled
from pagedllm.engine.dp_client import DPEngineCoreClient
from pagedllm.engine.engine_core import EngineCore
from pagedllm.engine.input_processor import InputProcessor, PromptType
from pagedllm.engine.model_info import ModelInfo
from pagedllm.engine.output_processor import BeamSearchRequest, OutputProcessor, ParentRequest
from pagedllm.engine.parallel_sampling import sample_request_ids
from pagedllm.engine.pooling_frontend import POOLING_ROUTES, PoolingFrontend
from pagedllm.errors import ValidationError, check_int, check_request_id_free
from pagedllm.lora.request import LoRARequest, check_lora_request
from pagedllm.outputs import RequestMetrics, RequestOutput
from pagedllm.pooler_config import load_pooler_config
from pagedllm.pooling_params import PoolingParams
from pagedllm.runner.base import Runner
from pagedllm.runner_type import resolve_runner_type, serves_pooling
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger("pagedllm")


def make_engine_core(config: EngineConfig, max_model_len: int, runner: Runner | None = None,
                     multiprocess: bool | None = None) -> EngineCoreClient:
    """The engine core in this process, or in its own (``multiprocess``; None: the env var);
    with data_parallel_size > 1, that many core processes (always processes: a replica needs
    its own interpreter to run beside the others). Here, above both clients, so that neither
    client module imports the other's."""
    if config.parallel_config.data_parallel_size > 1:
        return DPEngineCoreClient(config, max_model_len, runner)
    if multiprocess is None:
        multiprocess = multiprocessing_enabled()
    if multiprocess:
        return MPEngineCoreClient(config, max_model_len, runner)
    return EngineCore(config, max_model_len, runner)


def _resolve_max_model_len(requested: int | None, info: ModelInfo) -> int:
    """The user's max_model_len, or the model's max_position_embeddings; never past it."""
    max_pos = info.max_position_embeddings
    if requested is None:
        return max_pos
    if requested > max_pos:
        raise ValidationError(
            f"max_model_len={requested} exceeds the model's max_position_embeddings "
            f"({max_pos}); lower it", "max_model_len")
    return requested


class LLMEngine:
    def __init__(self, config: EngineConfig, runner: Runner | None = None,
                 model_info: ModelInfo | None = None, tokenizer: Any | None = None,
                 load_tokenizer: bool = True, multiprocess: bool | None = None) -> None:
        """``multiprocess``: run the engine core in a process of its own (None: the
        ``PAGEDLLM_ENABLE_MULTIPROCESSING`` environment variable, off when unset)."""
        mc = config.model_config
        self.config = config
        self.model_info = model_info or ModelInfo.from_folder(mc.model)
        if tokenizer is None and load_tokenizer:
            from pagedllm.engine.tokenizer import load_tokenizer as _load

            tokenizer = _load(mc.tokenizer or mc.model)
        self.tokenizer = tokenizer
        # Resolved once here and passed down (the runner and the scheduler never re-derive it).
        self.max_model_len = _resolve_max_model_len(mc.max_model_len, self.model_info)

        self.engine_core: EngineCoreClient = make_engine_core(
            config, self.max_model_len, runner, multiprocess)
        self.input_processor = InputProcessor(tokenizer, self.model_info.vocab_size)
        self.output_processor = OutputProcessor(tokenizer)
        self.runner_type = resolve_runner_type(mc.runner, mc.model)
        # A pooling model, or a generator started with a pooler_config: it serves both.
        pooler_config = (load_pooler_config(mc.model, open_checkpoint(mc.model).config, config.pooler_config)
                         if serves_pooling(self.runner_type, config.pooler_config) else None)
        self.pooling = PoolingFrontend(tokenizer, self.input_processor, self.max_model_len, pooler_config)
        self.num_prompt_tokens = 0  # prompt tokens of the requests received
        self.num_requests_finished = 0
        # Pooling traffic, counted apart from generation's prompt tokens and finished requests.
        self.num_pooling_prompt_tokens = 0
        self.num_pooling_requests_finished = 0
        self.num_scheduled_tokens = 0  # tokens the steps computed: the watchdog's sign of progress
        # See every step's EngineCoreOutputs (its SchedulerStats, its replica) on the engine
        # thread, wherever the core runs; step_observers also see the SchedulerOutput, in-process only.
        self.output_observers: list[Callable[[EngineCoreOutputs], None]] = []

    # The in-process engine core's parts, for tests and tools (a core process has none here).
    @property
    def scheduler(self):
        return self._local_core("scheduler").scheduler

    @property
    def executor(self):
        return self._local_core("executor").executor

    @property
    def step_observers(self):
        return self._local_core("step_observers").step_observers

    def _local_core(self, part: str) -> EngineCore:
        core = self.engine_core
        if not isinstance(core, EngineCore):
            # AttributeError, so getattr(engine, part, None) still works as a probe.
            raise AttributeError(
                f"LLMEngine.{part} does not exist here: the engine core runs in another process "
                f"(pid {getattr(core, 'pid', '?')}); use the engine's methods, or set "
                f"PAGEDLLM_ENABLE_MULTIPROCESSING=0 to run it in this one")
        return core

    @property
    def num_blocks(self) -> int:
        return self.engine_core.num_blocks

    @classmethod
    def from_engine_args(cls, model: str | None = None, **engine_args: Any) -> "LLMEngine":
        model, engine_args = resolve_engine_args(model, engine_args)  # a Hub id: the cached folder
        return cls(EngineConfig.from_kwargs(model, **engine_args))

    def default_sampling_params(self) -> SamplingParams:
        """vLLM's default: the model's generation_config.json sampling values, if any."""
        return SamplingParams(**self.model_info.generation_defaults)

    # -- requests ----------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0,
                    cache_salt: str | None = None, lora_request: LoRARequest | None = None) -> None:
        """Validate and queue a request; raises ValidationError (and queues nothing) if bad.
        ``lora_request``: the adapter it runs with (None: the base model)."""
        self._check_new_id(request_id)
        if self.runner_type == "pooling":
            raise ValidationError(f"this is a pooling model: it serves {POOLING_ROUTES}, not text "
                                  f"generation", "model")
        params = params if params is not None else self.default_sampling_params()
        if not isinstance(params, SamplingParams):
            raise ValidationError("sampling_params must be a SamplingParams", "sampling_params")
        # A copy, validated again: a user may set fields after construction (params.n = 0), and
        # may change the object later without changing this request (vLLM copies it too).
        params = params.clone()
        if params.logit_bias and any(not 0 <= t < self.model_info.vocab_size for t in params.logit_bias):
            raise ValidationError("logit_bias has a token id outside the vocabulary", "logit_bias")
        check_int(priority, "priority")  # the executor wire carries 64 bits
        if params.n > self.config.scheduler_config.max_num_seqs:
            raise ValidationError(f"n={params.n} parallel samples exceed max_num_seqs="
                                  f"{self.config.scheduler_config.max_num_seqs}; lower n or raise "
                                  f"max_num_seqs", "n")
        text, prompt_ids = self.input_processor.process_prompt(prompt)
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.engine_core.add_request(EngineCoreRequest(
            request_id, prompt_ids, params, self.model_info.eos_token_ids, arrival_time, priority,
            cache_salt, lora_request=check_lora_request(lora_request)))
        parent = ParentRequest(request_id, text, prompt_ids, params, RequestMetrics(arrival_time))
        self.output_processor.add_request(parent, sample_request_ids(request_id, params.n))
        self.num_prompt_tokens += len(prompt_ids)

    def add_beam_search_request(self, request_id: str, prompt: PromptType, params: BeamSearchParams,
                                priority: int = 0) -> None:
        """Queue a beam search; its result comes out of step() as one RequestOutput whose
        outputs are the beams, best first (``cumulative_logprob`` unpenalised)."""
        self._check_new_id(request_id)
        check_int(priority, "priority")
        text, prompt_ids = self.input_processor.process_prompt(prompt)
        self.engine_core.add_request(EngineCoreRequest(
            request_id, prompt_ids, None, self.model_info.eos_token_ids, time.monotonic(), priority,
            beam_search_params=params))
        self.output_processor.add_beam_search(BeamSearchRequest(request_id, text, prompt_ids))
        self.num_prompt_tokens += len(prompt_ids)

    def add_pooling_request(self, request_id: str, prompt: PromptType, params: PoolingParams,
                            arrival_time: float | None = None, priority: int = 0) -> None:
        """Queue a pooling request (its output one vector); ValidationError if bad."""
        self._check_new_id(request_id)
        check_int(priority, "priority")
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        request = self.pooling.make_request(request_id, prompt, params, arrival_time, priority)
        try:
            self.engine_core.add_request(request)
        except Exception:
            self.pooling.abort_requests([request_id])
            raise
        self.num_pooling_prompt_tokens += len(request.prompt_token_ids)

    def _check_new_id(self, request_id: str) -> None:
        check_request_id_free(request_id, self.output_processor.parents, self.output_processor.beam_searches,
                              self.pooling.pending)

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Abort now (idempotent): blocks are freed at once; no further output is produced."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        self.engine_core.abort_requests(self.output_processor.abort_requests(list(request_ids))
                                        + self.pooling.abort_requests(list(request_ids)))

    # -- the loop ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        core_outputs = self.engine_core.step()
        if core_outputs is None:
            return []  # async scheduling's first step: nothing has finished yet
        self._record_first_scheduled(core_outputs)
        self.num_scheduled_tokens += core_outputs.scheduler_stats.num_scheduled_tokens
        for observe in self.output_observers:
            observe(core_outputs)
        outputs, stopped = self.output_processor.process_outputs(core_outputs)
        pooled = self.pooling.process_outputs(core_outputs) if core_outputs.pooler_output else []
        self.num_pooling_requests_finished += len(pooled)
        for child_id, stop_str in stopped:  # a stop string showed up in the text
            self.engine_core.finish_requests([child_id], stop_str)
        self.num_requests_finished += sum(1 for o in outputs if o.finished)
        return outputs + pooled if pooled else outputs

    def _record_first_scheduled(self, core_outputs: EngineCoreOutputs) -> None:
        """Stamp RequestMetrics.first_scheduled_time (the server's queue-time histogram): the
        core reports the prefix-cache hit of every sequence it started since the last step."""
        if not core_outputs.num_cached_tokens:
            return
        now = time.monotonic()
        states = self.output_processor.request_states
        for rid in core_outputs.num_cached_tokens:
            state = states.get(rid)
            if state is not None and state.parent.metrics.first_scheduled_time is None:
                state.parent.metrics.first_scheduled_time = now

    def has_unfinished_requests(self) -> bool:
        return (self.engine_core.has_unfinished_requests() or self.output_processor.has_unfinished_requests()
                or bool(self.pooling.pending))

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()

    def reset_prefix_cache(self) -> bool:
        return self.engine_core.reset_prefix_cache()

    # LoRA adapters (vLLM's names): load one now (ValidationError if it does not fit the base),
    # unload one no request uses, list the loaded ids.
    def add_lora(self, lora_request: LoRARequest) -> bool:
        return self.engine_core.add_lora(check_lora_request(lora_request))

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.engine_core.remove_lora(lora_int_id)

    def list_loras(self) -> list[int]:
        return self.engine_core.list_loras()

    def shutdown(self) -> None:
        self.engine_core.shutdown()

    # -- metrics -----------------------------------------------------------------------------
    def get_metrics(self) -> dict[str, float]:
        """Counters and gauges, named as the server exports them."""
        return {**self.engine_core.get_metrics(),
                "pagedllm:prompt_tokens": self.num_prompt_tokens,
                "pagedllm:request_success": self.num_requests_finished,
                "pagedllm:pooling_input_tokens": self.num_pooling_prompt_tokens,
                "pagedllm:pooling_requests": self.num_pooling_requests_finished}

"""LLM: the offline API, compatible with vLLM's (``from pagedllm import LLM, SamplingParams``)."""
from __future__ import annotations

import dataclasses
import itertools
import time
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pagedllm.beam_search_params import BeamSearchParams
from pagedllm.checkpoint.hub import resolve_engine_args
from pagedllm.config import DEFAULT_MODEL_DIR, EngineConfig
from pagedllm.engine.input_processor import PromptType
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.llm_pooling import PoolingMixin
from pagedllm.engine.tokenizer import apply_chat_template
from pagedllm.errors import ValidationError, check_text
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import BeamSearchOutput, BeamSearchSequence, RequestOutput
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

# The demo model (stories260K) was trained on plain stories and ships no chat template; a minimal
# one lives beside its folder, so the chat path of the demo works out of the box.
_DEMO_CHAT_TEMPLATE = DEFAULT_MODEL_DIR.parent / "chat_template.jinja"


def default_chat_template(model: str | None) -> str | None:
    """The demo's chat template when ``model`` is the demo model (or not given); else None, and
    a model without its own template keeps failing with the usual clear error."""
    path = Path(model) if model is not None else DEFAULT_MODEL_DIR
    try:
        if path.resolve() != DEFAULT_MODEL_DIR.resolve() or not _DEMO_CHAT_TEMPLATE.is_file():
            return None
        return _DEMO_CHAT_TEMPLATE.read_text()
    except OSError:
        return None


def _engine_field_names() -> set[str]:
    hints = typing.get_type_hints(EngineConfig)
    return {f.name for part in hints.values() if dataclasses.is_dataclass(part)
            for f in dataclasses.fields(part)}


class LLM(PoolingMixin):
    """An engine for offline batch inference (a pooling model's API: engine/llm_pooling.py).

    ``LLM(model, **engine_args)`` takes vLLM's engine argument names (max_num_seqs,
    max_num_batched_tokens, max_model_len, block_size, enable_prefix_caching,
    long_prefill_token_threshold, scheduling_policy, num_gpu_blocks_override,
    kv_cache_memory_bytes, gpu_memory_utilization, dtype, seed, device, ...).
    """

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        # Accepted for vLLM compatibility: pagedllm never runs a model's own code.
        if "trust_remote_code" not in _engine_field_names():
            engine_args.pop("trust_remote_code", None)
        model, engine_args = resolve_engine_args(model, engine_args)  # a Hub id: the cached folder
        config = EngineConfig.from_kwargs(model, **engine_args)
        self.llm_engine = LLMEngine(config)
        self._counter = itertools.count()
        self._default_chat_template = default_chat_template(config.model_config.model)

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        return self.llm_engine.default_sampling_params()

    # -- generate ----------------------------------------------------------------------------
    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: list[int] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Generate for every prompt; results come back in input order. ``lora_request``: the
        adapter of every prompt, or a list of one per prompt (None: the base model)."""
        if isinstance(prompts, (str, dict)) or (
                isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise ValidationError(
                f"prompts must be a string, a token-id list, a dict or a list of these; got "
                f"{type(prompts).__name__}", "prompt")
        prompts = list(prompts)
        check_text(prompts, "prompt")  # a lone surrogate: a ValidationError, not the tokenizer's TypeError
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params_list = (list(sampling_params) if isinstance(sampling_params, (list, tuple))
                       else [sampling_params] * len(prompts))
        if len(params_list) != len(prompts):
            raise ValidationError("give one SamplingParams, or one per prompt", "sampling_params")
        # generate() returns finished results: whatever the output kind, collect them whole.
        params_list = [p if not isinstance(p, SamplingParams) or p.output_kind == RequestOutputKind.FINAL_ONLY
                       else p.clone(output_kind=RequestOutputKind.FINAL_ONLY) for p in params_list]
        if priority is not None and len(priority) != len(prompts):
            raise ValidationError("priority needs one value per prompt", "priority")
        loras = (list(lora_request) if isinstance(lora_request, (list, tuple))
                 else [lora_request] * len(prompts))
        if len(loras) != len(prompts):
            raise ValidationError("give one lora_request, or one per prompt", "lora_request")
        request_ids = []
        try:
            for i, (prompt, params) in enumerate(zip(prompts, params_list)):
                rid = str(next(self._counter))
                self.llm_engine.add_request(rid, prompt, params,
                                            priority=priority[i] if priority is not None else 0,
                                            lora_request=loras[i])
                request_ids.append(rid)
        except Exception:
            # Bad input loses nothing: the requests queued before the bad one are withdrawn.
            self.llm_engine.abort_request(request_ids)
            raise
        return self._run_engine(request_ids, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, chat_template: str | None = None,
             add_generation_prompt: bool = True, tools: list[dict] | None = None,
             **template_kwargs: Any) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, through the chat template
        (``tools``, OpenAI function tools, are rendered by it as vLLM's ``LLM.chat`` does; the
        reply is text, and reading tool calls from it is the server's parsers' job)."""
        if tools is not None:
            template_kwargs["tools"] = tools
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        check_text(conversations, "messages")
        tokenizer = self.llm_engine.tokenizer
        if tokenizer is None:
            raise ValidationError("chat() needs a tokenizer", "messages")
        if chat_template is None and not getattr(tokenizer, "chat_template", None):
            chat_template = self._default_chat_template  # the demo's; None for other models
        prompts: list[PromptType] = [
            {"prompt_token_ids": apply_chat_template(tokenizer, conv, chat_template,
                                                     add_generation_prompt, **template_kwargs)}
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def beam_search(self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """Beam search for each prompt; each result's ``sequences`` are best first (score =
        cum_logprob / generated_len ** length_penalty, as in transformers)."""
        if isinstance(prompts, (str, dict)) or (
                isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        check_text(prompts, "prompt")
        request_ids = []
        try:
            for prompt in prompts:
                rid = str(next(self._counter))
                self.llm_engine.add_beam_search_request(rid, prompt, params)
                request_ids.append(rid)
        except Exception:
            self.llm_engine.abort_request(request_ids)
            raise
        results = []
        for out in self._run_engine(request_ids, use_tqdm):
            scores = out.beam_scores or [0.0] * len(out.outputs)
            results.append(BeamSearchOutput([
                BeamSearchSequence(out.prompt_token_ids + c.token_ids, c.text, c.cumulative_logprob,
                                   c.finish_reason, score)
                for c, score in zip(out.outputs, scores)]))
        return results

    def _run_engine(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        pbar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            pbar = tqdm(total=len(request_ids), desc="Processed prompts", dynamic_ncols=True,
                        postfix="est. speed input: 0.00 toks/s, output: 0.00 toks/s")
        finished: dict[str, RequestOutput] = {}
        start = time.perf_counter()
        num_in = num_out = 0
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if not out.finished:
                        continue
                    finished[out.request_id] = out
                    if pbar is not None:
                        num_in += len(out.prompt_token_ids)
                        num_out += sum(len(c.token_ids) for c in out.outputs)
                        elapsed = max(time.perf_counter() - start, 1e-9)
                        pbar.postfix = (f"est. speed input: {num_in / elapsed:.2f} toks/s, "
                                        f"output: {num_out / elapsed:.2f} toks/s")
                        pbar.update(1)
        except BaseException:
            engine.abort_request(request_ids)  # leave the engine clean for the next call
            raise
        finally:
            if pbar is not None:
                pbar.close()
        return [finished[rid] for rid in request_ids if rid in finished]

    # -- misc --------------------------------------------------------------------------------
    def get_metrics(self) -> dict[str, float]:
        return self.llm_engine.get_metrics()

    def reset_prefix_cache(self) -> bool:
        return self.llm_engine.reset_prefix_cache()

"""PoolingFrontend: the engine's half of a pooling request (vLLM's pooling runner, front end).

It checks a request against the model (a pooling model, a known task, ``dimensions`` the model
can give, ``truncate_prompt_tokens``), hands the engine core one request whose output is a
vector, and turns the vectors the core reports into PoolingRequestOutputs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedllm.core.outputs import EngineCoreOutputs, EngineCoreRequest
from pagedllm.engine.input_processor import InputProcessor, PromptType
from pagedllm.errors import ValidationError
from pagedllm.pooler_config import PoolerConfig
from pagedllm.pooling_outputs import PoolingOutput, PoolingRequestOutput
from pagedllm.pooling_params import PoolingParams

# What each runner serves, for the error a request for the other kind gets.
GENERATE_ROUTES = "/v1/completions, /v1/chat/completions (LLM.generate, LLM.chat)"
POOLING_ROUTES = ("/v1/embeddings, /pooling, /classify, /score, /rerank (LLM.embed, LLM.classify, "
                  "LLM.score, LLM.encode)")


@dataclass
class _Pending:
    prompt_token_ids: list[int]


class PoolingFrontend:
    def __init__(self, tokenizer: Any | None, input_processor: InputProcessor, max_model_len: int,
                 pooler_config: PoolerConfig | None) -> None:
        self.tokenizer = tokenizer
        self.input_processor = input_processor
        self.max_model_len = max_model_len
        self.pooler_config = pooler_config  # None: a generator that does not pool
        self.pending: dict[str, _Pending] = {}

    def check_pooling_model(self) -> PoolerConfig:
        if self.pooler_config is None:
            raise ValidationError(f"this model generates text: it serves {GENERATE_ROUTES}, not "
                                  f"embeddings or scores (start it with runner='pooling' to pool "
                                  f"its hidden states, or with a pooler_config to serve both)", "model")
        return self.pooler_config

    def make_request(self, request_id: str, prompt: PromptType, params: PoolingParams,
                     arrival_time: float, priority: int) -> EngineCoreRequest:
        config = self.check_pooling_model()
        if not isinstance(params, PoolingParams):
            raise ValidationError("pooling_params must be a PoolingParams", "pooling_params")
        params = params.clone(task=params.task or "embed")
        if params.task == "embed":
            config.check_dimensions(params.dimensions)
        elif params.dimensions is not None:
            raise ValidationError(f"dimensions applies to embeddings, not to task {params.task}", "dimensions")
        if params.task in ("classify", "score") and not config.num_labels:
            raise ValidationError("this model has no classification head: it embeds, it does not "
                                  "classify or score pairs", "task")
        ids = self._token_ids(prompt, params.truncate_prompt_tokens)
        self.pending[request_id] = _Pending(ids)
        return EngineCoreRequest(request_id, ids, None, frozenset(), arrival_time, priority,
                                 pooling_params=params)

    def _token_ids(self, prompt: PromptType, truncate: int | None) -> list[int]:
        if truncate is None:
            return self.input_processor.process_prompt(prompt)[1]
        keep = self.max_model_len if truncate == -1 else truncate
        if keep > self.max_model_len:
            raise ValidationError(f"truncate_prompt_tokens={keep} exceeds the model's maximum length "
                                  f"{self.max_model_len}; lower it", "truncate_prompt_tokens")
        text = prompt if isinstance(prompt, str) else (prompt.get("prompt") if isinstance(prompt, dict)
                                                       and "prompt_token_ids" not in prompt else None)
        if text is not None and self.tokenizer is not None:
            # The tokenizer's own truncation keeps its special tokens ([CLS] ... [SEP]).
            truncated = list(self.tokenizer(text, truncation=True, max_length=keep).input_ids)
            return self.input_processor.process_prompt(truncated)[1]
        return self.input_processor.process_prompt(prompt)[1][-keep:]  # token ids: the last k

    def process_outputs(self, outputs: EngineCoreOutputs) -> list[PoolingRequestOutput]:
        results = []
        for rid, vector in outputs.pooler_output.items():
            pending = self.pending.pop(rid, None)
            if pending is not None:  # None: aborted while its step ran
                results.append(PoolingRequestOutput(rid, PoolingOutput(vector), pending.prompt_token_ids))
        return results

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        return [rid for rid in request_ids if self.pending.pop(rid, None) is not None]

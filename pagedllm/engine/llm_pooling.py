"""The offline API of pooling models, vLLM's: ``LLM.embed``, ``LLM.classify``, ``LLM.score`` and
``LLM.encode`` (a mixin of ``LLM``). Each input is one pooling request; results come back in
input order."""
from __future__ import annotations

import math
from collections.abc import Sequence

from pagedllm.engine.input_processor import PromptType
from pagedllm.errors import ValidationError, check_text
from pagedllm.pooling_outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
    typed_output,
)
from pagedllm.pooling_params import PoolingParams


def _as_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise ValidationError(f"prompts must be a string, a token-id list, a dict or a list of these; "
                              f"got {type(prompts).__name__}", "input")
    if not prompts:
        raise ValidationError("the input list is empty; give at least one input", "input")
    check_text(list(prompts), "input")
    if any(isinstance(p, str) and not p for p in prompts):
        raise ValidationError("an input is an empty string; give some text", "input")
    return list(prompts)


class PoolingMixin:
    llm_engine: object
    _counter: object

    def encode(self, prompts: PromptType | Sequence[PromptType],
               pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
               use_tqdm: bool = False, pooling_task: str = "encode",
               truncate_prompt_tokens: int | None = None) -> list[PoolingRequestOutput]:
        """One pooled vector per input (``pooling_task``: embed, classify, score or encode)."""
        prompts = _as_list(prompts)
        if pooling_params is None:
            pooling_params = PoolingParams()
        params = list(pooling_params) if isinstance(pooling_params, (list, tuple)) else [pooling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValidationError("give one PoolingParams, or one per input", "pooling_params")
        params = [p.clone(task=pooling_task, truncate_prompt_tokens=truncate_prompt_tokens
                          if truncate_prompt_tokens is not None else p.truncate_prompt_tokens) for p in params]
        engine = self.llm_engine
        request_ids = []
        try:
            for prompt, p in zip(prompts, params):
                rid = str(next(self._counter))
                engine.add_pooling_request(rid, prompt, p)
                request_ids.append(rid)
        except Exception:
            engine.abort_request(request_ids)  # bad input loses nothing: the queued ones go too
            raise
        finished: dict[str, PoolingRequestOutput] = {}
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if isinstance(out, PoolingRequestOutput):
                        finished[out.request_id] = out
        except BaseException:
            engine.abort_request(request_ids)
            raise
        return [typed_output(pooling_task, finished[rid]) for rid in request_ids if rid in finished]

    def embed(self, prompts: PromptType | Sequence[PromptType],
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
              use_tqdm: bool = False, truncate_prompt_tokens: int | None = None,
              prompt_name: str | None = None) -> list[EmbeddingRequestOutput]:
        """Sentence embeddings; ``prompt_name`` picks one of the model's sentence-transformers
        prompts (its ``default_prompt_name`` when unset)."""
        prompts = _as_list(prompts)
        config = self.llm_engine.pooling.pooler_config
        prefix = config.prompt_text(prompt_name) if config is not None else ""
        if prefix:
            prompts = [prefix + p if isinstance(p, str) else p for p in prompts]
        return self.encode(prompts, pooling_params, use_tqdm, "embed", truncate_prompt_tokens)

    def classify(self, prompts: PromptType | Sequence[PromptType],
                 pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
                 use_tqdm: bool = False) -> list[ClassificationRequestOutput]:
        """Class probabilities (softmax, or sigmoid for one label or a multi-label model)."""
        return self.encode(prompts, pooling_params, use_tqdm, "classify")

    def score(self, data_1: str | Sequence[str], data_2: str | Sequence[str],
              truncate_prompt_tokens: int | None = None, pooling_params: PoolingParams | None = None,
              use_tqdm: bool = False) -> list[ScoringRequestOutput]:
        """Relevance of each (data_1, data_2) pair: one against many, or pairwise for two lists
        of one length. A cross-encoder scores each pair in one forward; an embedding model gives
        the cosine similarity of the two embeddings."""
        pairs = score_pairs(data_1, data_2)
        engine = self.llm_engine
        config = engine.pooling.check_pooling_model()
        params = (pooling_params or PoolingParams()).clone(truncate_prompt_tokens=truncate_prompt_tokens)
        if not config.num_labels:  # a bi-encoder: cosine of the embeddings
            texts = list(dict.fromkeys([t for pair in pairs for t in pair]))
            vectors = {t: o.outputs.embedding for t, o in zip(texts, self.embed(texts, params.clone(normalize=True)))}
            return [ScoringRequestOutput(str(i), ScoringOutput(cosine(vectors[a], vectors[b])), [])
                    for i, (a, b) in enumerate(pairs)]
        tokenizer = engine.tokenizer
        if tokenizer is None:
            raise ValidationError("score() needs a tokenizer", "input")
        prompts, per_pair = [], []
        for a, b in pairs:
            enc = tokenizer(a, b, **pair_truncation(truncate_prompt_tokens, engine.max_model_len))
            types = list(enc.get("token_type_ids") or [])
            start = types.index(1) if 1 in types else None
            prompts.append({"prompt_token_ids": list(enc.input_ids)})
            per_pair.append(params.clone(truncate_prompt_tokens=None,
                                         extra_kwargs={} if start is None else {"compressed_token_type_ids": start}))
        return self.encode(prompts, per_pair, use_tqdm, "score")


def score_pairs(data_1: str | Sequence[str], data_2: str | Sequence[str]) -> list[tuple[str, str]]:
    """vLLM's pairing: one text against each of the others, or two lists of the same length."""
    first = [data_1] if isinstance(data_1, str) else list(data_1)
    second = [data_2] if isinstance(data_2, str) else list(data_2)
    if not first or not second:
        raise ValidationError("score needs at least one text on each side", "input")
    for text in first + second:
        if not isinstance(text, str) or not text:
            raise ValidationError("each text to score must be a non-empty string", "input")
    check_text(first + second, "input")
    if len(first) == 1:
        return [(first[0], t) for t in second]
    if len(first) != len(second):
        raise ValidationError(f"data_1 has {len(first)} texts and data_2 {len(second)}: give one text "
                              f"against many, or two lists of the same length", "input")
    return list(zip(first, second))


def pair_truncation(truncate: int | None, max_model_len: int) -> dict:
    """The tokenizer's arguments that cut a text pair to ``truncate`` tokens (-1: the model's
    limit), the longer text first, special tokens kept."""
    if truncate is None:
        return {}
    if truncate != -1 and not 1 <= truncate <= max_model_len:
        raise ValidationError(f"truncate_prompt_tokens must be -1 or in [1, {max_model_len}], got {truncate}",
                              "truncate_prompt_tokens")
    return {"truncation": "longest_first", "max_length": max_model_len if truncate == -1 else truncate}


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)) or 1.0)

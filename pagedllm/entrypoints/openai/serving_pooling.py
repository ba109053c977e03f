"""The pooling routes: POST /v1/embeddings, /pooling, /classify, /score and /v1/score, /rerank,
/v1/rerank and /v2/rerank. Each input is one pooling request of the engine; the routes only
translate shapes (a rerank is a score of the query against each document, sorted)."""
from __future__ import annotations

import array
import asyncio
import base64
import sys
from collections.abc import Callable
from typing import Any, TypeVar

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from pagedllm.engine.async_engine import AsyncLLM
from pagedllm.engine.llm_pooling import cosine, pair_truncation, score_pairs
from pagedllm.entrypoints.openai.protocol import random_id
from pagedllm.entrypoints.openai.protocol_pooling import (
    ClassificationData,
    ClassificationRequest,
    ClassificationResponse,
    CohereMeta,
    CohereRerankResponse,
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    JinaRerankResponse,
    PoolingData,
    PoolingListResponse,
    PoolingResponse,
    PoolingUsage,
    RerankDocument,
    RerankRequest,
    RerankResult,
    RerankUsage,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
)
from pagedllm.entrypoints.openai.serving_engine import OpenAIServing
from pagedllm.errors import ValidationError
from pagedllm.pooling_outputs import PoolingRequestOutput
from pagedllm.pooling_params import PoolingParams

_R = TypeVar("_R", bound=PoolingListResponse)


def _inputs(value: Any) -> list[Any]:
    """OpenAI's ``input``: a string, strings, token ids, or lists of token ids."""
    if isinstance(value, str):
        value = [value]
    if not value:
        raise ValidationError("input is empty; give at least one text or token list", "input")
    if all(isinstance(v, int) for v in value):
        value = [value]
    for v in value:
        if isinstance(v, str) and not v:
            raise ValidationError("input holds an empty string; give some text", "input")
        if isinstance(v, list) and not v:
            raise ValidationError("input holds an empty token list", "input")
    return [v if isinstance(v, str) else {"prompt_token_ids": v} for v in value]


def _base64(vector: list[float]) -> str:
    """OpenAI's base64 encoding: little-endian float32."""
    packed = array.array("f", vector)
    if sys.byteorder != "little":
        packed.byteswap()
    return base64.b64encode(packed.tobytes()).decode()


class OpenAIServingPooling(OpenAIServing):
    @property
    def _pooler_config(self):
        return self.llm.engine.pooling.pooler_config

    async def _pool(self, prefix: str, prompts: list[Any], params: PoolingParams,
                    per_prompt: list[PoolingParams] | None = None) -> tuple[str, list[PoolingRequestOutput]]:
        request_id = random_id(prefix)
        params_list = per_prompt or [params] * len(prompts)
        results = await asyncio.gather(*(self.llm.encode(p, pp, f"{request_id}-{i}")
                                         for i, (p, pp) in enumerate(zip(prompts, params_list))),
                                       return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return request_id, list(results)

    @staticmethod
    def _usage(outs: list[PoolingRequestOutput]) -> PoolingUsage:
        n = sum(len(o.prompt_token_ids) for o in outs)
        return PoolingUsage(prompt_tokens=n, total_tokens=n)

    async def embeddings(self, request: EmbeddingRequest) -> EmbeddingResponse:
        params = PoolingParams(task="embed", dimensions=request.dimensions, normalize=request.normalize,
                               truncate_prompt_tokens=request.truncate_prompt_tokens)
        return await self._vectors(request, params, "embd", EmbeddingResponse,
                                   lambda i, v: EmbeddingData(index=i, embedding=v))

    async def pooling(self, request: EmbeddingRequest) -> PoolingResponse:
        params = PoolingParams(task="encode", truncate_prompt_tokens=request.truncate_prompt_tokens)
        return await self._vectors(request, params, "pool", PoolingResponse,
                                   lambda i, v: PoolingData(index=i, data=v))

    async def _vectors(self, request: EmbeddingRequest, params: PoolingParams, prefix: str,
                       response: type[_R], item: Callable[[int, list[float] | str], Any]) -> _R:
        """/v1/embeddings and /pooling: one vector per input, as floats or base64."""
        self.check_model(request.model)
        request.check_extra_fields()
        rid, outs = await self._pool(prefix, _inputs(request.input), params)
        enc = _base64 if request.encoding_format == "base64" else list
        return response(id=rid, model=self.model_name, usage=self._usage(outs),
                        data=[item(i, enc(o.outputs.data)) for i, o in enumerate(outs)])

    async def classify(self, request: ClassificationRequest) -> ClassificationResponse:
        self.check_model(request.model)
        request.check_extra_fields()
        params = PoolingParams(task="classify", truncate_prompt_tokens=request.truncate_prompt_tokens)
        rid, outs = await self._pool("classify", _inputs(request.input), params)
        labels = self._pooler_config.id2label
        data = []
        for i, o in enumerate(outs):
            probs = o.outputs.data
            best = max(range(len(probs)), key=probs.__getitem__)
            data.append(ClassificationData(index=i, label=labels.get(best), probs=probs, num_classes=len(probs)))
        return ClassificationResponse(id=rid, model=self.model_name, usage=self._usage(outs), data=data)

    async def _scores(self, pairs: list[tuple[str, str]], truncate: int | None) -> tuple[list[float], int]:
        """Each pair's relevance (a cross-encoder's score, or the cosine of two embeddings) and
        the input tokens spent."""
        config = self._pooler_config
        if config is None or not config.num_labels:
            texts = list(dict.fromkeys(t for pair in pairs for t in pair))
            params = PoolingParams(task="embed", normalize=True, truncate_prompt_tokens=truncate)
            _, outs = await self._pool("score", texts, params)
            vectors = {t: o.outputs.data for t, o in zip(texts, outs)}
            return [cosine(vectors[a], vectors[b]) for a, b in pairs], self._usage(outs).total_tokens
        tokenizer = self.llm.tokenizer
        if tokenizer is None:
            raise ValidationError("scoring text needs the model's tokenizer", "input")
        kwargs = pair_truncation(truncate, self.llm.max_model_len)
        prompts, params = [], []
        for a, b in pairs:
            enc = await self.tokenizer_call(tokenizer, a, b, **kwargs)
            types = list(enc.get("token_type_ids") or [])
            extra = {"compressed_token_type_ids": types.index(1)} if 1 in types else {}
            prompts.append({"prompt_token_ids": list(enc.input_ids)})
            params.append(PoolingParams(task="score", extra_kwargs=extra))
        _, outs = await self._pool("score", prompts, params[0], params)
        return [o.outputs.data[0] for o in outs], self._usage(outs).total_tokens

    async def score(self, request: ScoreRequest) -> ScoreResponse:
        self.check_model(request.model)
        request.check_extra_fields()
        scores, tokens = await self._scores(score_pairs(request.text_1, request.text_2),
                                            request.truncate_prompt_tokens)
        return ScoreResponse(id=random_id("score"), model=self.model_name,
                             usage=PoolingUsage(prompt_tokens=tokens, total_tokens=tokens),
                             data=[ScoreData(index=i, score=s) for i, s in enumerate(scores)])

    async def rerank(self, request: RerankRequest, cohere: bool) -> JSONResponse:
        self.check_model(request.model)
        request.check_extra_fields()
        docs = [d.text if isinstance(d, RerankDocument) else d for d in request.documents]
        if not docs:
            raise ValidationError("documents is empty; give at least one", "documents")
        if request.top_n is not None and request.top_n < 1:
            raise ValidationError(f"top_n must be >= 1, got {request.top_n}", "top_n")
        scores, tokens = await self._scores(score_pairs(request.query, docs), request.truncate_prompt_tokens)
        order = sorted(range(len(docs)), key=lambda i: -scores[i])[:request.top_n or len(docs)]
        with_docs = request.return_documents if request.return_documents is not None else not cohere
        results = [RerankResult(index=i, relevance_score=scores[i],
                                document=RerankDocument(text=docs[i]) if with_docs else None) for i in order]
        if cohere:
            body: Any = CohereRerankResponse(id=random_id("rerank"), results=results,
                                             meta=CohereMeta(billed_units={"search_units": 1}))
        else:
            body = JinaRerankResponse(id=random_id("rerank"), model=self.model_name,
                                      usage=RerankUsage(total_tokens=tokens), results=results)
        return JSONResponse(body.model_dump(exclude_none=True))


def pooling_router(llm: AsyncLLM, names: list[str], serving: OpenAIServingPooling | None = None) -> APIRouter:
    serving = serving or OpenAIServingPooling(llm, names)
    router = APIRouter()

    @router.post("/v1/embeddings")
    async def create_embeddings(request: EmbeddingRequest) -> EmbeddingResponse:
        return await serving.embeddings(request)

    @router.post("/pooling")
    async def create_pooling(request: EmbeddingRequest) -> PoolingResponse:
        return await serving.pooling(request)

    @router.post("/classify")
    async def create_classify(request: ClassificationRequest) -> ClassificationResponse:
        return await serving.classify(request)

    for path in ("/score", "/v1/score"):
        router.add_api_route(path, serving.score, methods=["POST"], response_model=ScoreResponse)

    async def jina_rerank(request: RerankRequest) -> JSONResponse:
        return await serving.rerank(request, cohere=False)

    async def cohere_rerank(request: RerankRequest) -> JSONResponse:
        return await serving.rerank(request, cohere=True)

    for path in ("/rerank", "/v1/rerank"):
        router.add_api_route(path, jina_rerank, methods=["POST"], response_model=JinaRerankResponse)
    router.add_api_route("/v2/rerank", cohere_rerank, methods=["POST"], response_model=CohereRerankResponse)
    return router

"""Request and response bodies of the pooling routes, in vLLM's and the APIs' own shapes:
OpenAI's /v1/embeddings, vLLM's /pooling, /classify and /score, Jina's rerank (/rerank,
/v1/rerank) and Cohere's (/v2/rerank)."""
from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, Field

from pagedllm.entrypoints.openai.protocol import OpenAIBaseModel
from pagedllm.entrypoints.openai.request_base import OpenAIRequest

PoolingInput = str | list[str] | list[int] | list[list[int]]


class EmbeddingRequest(OpenAIRequest):
    model: str | None = None
    input: PoolingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = None
    normalize: bool | None = None
    priority: int = 0


class ClassificationRequest(OpenAIRequest):
    model: str | None = None
    input: PoolingInput
    user: str | None = None
    truncate_prompt_tokens: int | None = None
    priority: int = 0


class ScoreRequest(OpenAIRequest):
    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: int | None = None
    priority: int = 0


class RerankDocument(BaseModel):
    text: str


class RerankRequest(OpenAIRequest):
    model: str | None = None
    query: str
    documents: list[str | RerankDocument]
    top_n: int | None = None
    return_documents: bool | None = None  # None: Jina's default (true), Cohere's (false)
    truncate_prompt_tokens: int | None = None
    priority: int = 0


class PoolingUsage(OpenAIBaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0


class PoolingListResponse(OpenAIBaseModel):
    """What every list-shaped pooling response carries besides its ``data``."""
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    usage: PoolingUsage


class EmbeddingData(OpenAIBaseModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str  # str: base64 of little-endian float32


class EmbeddingResponse(PoolingListResponse):
    data: list[EmbeddingData]


class PoolingData(OpenAIBaseModel):
    index: int
    object: Literal["pooling"] = "pooling"
    data: list[float] | str


class PoolingResponse(PoolingListResponse):
    data: list[PoolingData]


class ClassificationData(OpenAIBaseModel):
    index: int
    label: str | None
    probs: list[float]
    num_classes: int


class ClassificationResponse(PoolingListResponse):
    data: list[ClassificationData]


class ScoreData(OpenAIBaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(PoolingListResponse):
    data: list[ScoreData]


class RerankResult(OpenAIBaseModel):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankUsage(OpenAIBaseModel):
    total_tokens: int


class JinaRerankResponse(OpenAIBaseModel):
    """Jina's shape (vLLM's /rerank and /v1/rerank)."""
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


class CohereMeta(OpenAIBaseModel):
    api_version: dict[str, str] = Field(default_factory=lambda: {"version": "2"})
    billed_units: dict[str, int]


class CohereRerankResponse(OpenAIBaseModel):
    """Cohere's v2 shape (/v2/rerank)."""
    id: str
    results: list[RerankResult]
    meta: CohereMeta

"""Results of pooling requests as vLLM users know them: ``LLM.embed`` returns
EmbeddingRequestOutput (``.outputs.embedding``), ``LLM.classify`` ClassificationRequestOutput
(``.outputs.probs``), ``LLM.score`` ScoringRequestOutput (``.outputs.score``), ``LLM.encode``
PoolingRequestOutput (``.outputs.data``). Vectors are plain lists of floats."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PoolingOutput:
    data: list[float]


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ClassificationOutput:
    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ScoringOutput:
    score: float


@dataclass
class PoolingRequestOutput:
    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class EmbeddingRequestOutput:
    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class ClassificationRequestOutput:
    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class ScoringRequestOutput:
    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True


def typed_output(task: str, out: PoolingRequestOutput):
    """The task's own output class around a pooled vector."""
    data = out.outputs.data
    if task == "embed":
        return EmbeddingRequestOutput(out.request_id, EmbeddingOutput(data), out.prompt_token_ids)
    if task == "classify":
        return ClassificationRequestOutput(out.request_id, ClassificationOutput(data), out.prompt_token_ids)
    if task == "score":
        return ScoringRequestOutput(out.request_id, ScoringOutput(data[0]), out.prompt_token_ids)
    return out

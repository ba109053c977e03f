"""Results as vLLM users know them: RequestOutput, CompletionOutput, Logprob."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per position: token id -> Logprob (the chosen token and the top-k).
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # "stop", "length", "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = field(default=None, repr=False)
    # Beam search only: each output's length-penalised score, best first.
    beam_scores: list[float] | None = None


@dataclass
class BeamSearchSequence:
    """One beam: ``tokens`` holds the prompt and the generated tokens, as in vLLM."""
    tokens: list[int]
    text: str | None
    cum_logprob: float
    finish_reason: str | None = None
    score: float = 0.0  # cum_logprob / generated_len ** length_penalty (transformers' score)


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]

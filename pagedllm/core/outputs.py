"""The contracts between scheduler, runner and engine: plain data (ints, lists, dicts), no torch.

``SchedulerOutput`` is the work order for one step; ``RunnerOutput`` is what the runner sampled;
``EngineCoreOutputs`` is what the scheduler reports after applying it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedllm.beam_search_params import BeamSearchParams
from pagedllm.core.scheduler_stats import SchedulerStats
from pagedllm.lora.request import LoRARequest
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams

# A draft slot whose token the runner's draft model proposes within the step.
DRAFT_PLACEHOLDER = -1


@dataclass(slots=True)
class EngineCoreRequest:
    """A request as the front end hands it to the engine core: tokenized, validated, plain data.
    ``sampling_params.n`` samples run as ``n`` sequences; a beam search has ``beam_search_params``."""
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams | None
    eos_token_ids: frozenset[int]
    arrival_time: float
    priority: int = 0
    cache_salt: str | None = None
    beam_search_params: BeamSearchParams | None = None
    lora_request: LoRARequest | None = None
    # A pooling request: its output a vector, pooled from the prompt's hidden states.
    pooling_params: PoolingParams | None = None


@dataclass(slots=True)
class FinishedBeam:
    """One result of a beam search."""
    tokens: list[int]  # generated tokens (EOS included when it ended the beam)
    cum_logprob: float
    score: float  # cum_logprob / len(tokens) ** length_penalty
    finish_reason: str


@dataclass(slots=True)
class NewRequestData:
    """A request the runner has not seen (first admission, or resumed after preemption)."""
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # non-empty only when resumed after preemption (recompute)
    sampling_params: SamplingParams | None  # None: a pooling request
    block_ids: list[list[int]]  # its block table in each KV cache group (-1: the null block)
    num_computed_tokens: int  # tokens already in the cache (prefix-cache hit) before this step
    eos_token_ids: frozenset[int] = frozenset()
    lora_request: LoRARequest | None = None  # the adapter its rows run with
    pooling_params: PoolingParams | None = None


@dataclass(slots=True)
class CachedRequestData:
    """Requests the runner already holds, as diffs (parallel lists)."""
    req_ids: list[str] = field(default_factory=list)
    # Per request, per KV cache group: appended to that group's block table ([] when no group
    # got a block, the usual decode step).
    new_block_ids: list[list[list[int]]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)  # before this step
    # Tokens appended since the runner last saw the request (the sampled token, accepted drafts,
    # a beam's chosen token): the scheduler is the single source of truth for token ids.
    new_token_ids: list[list[int]] = field(default_factory=list)


@dataclass(slots=True)
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]  # req_id -> tokens computed this step
    total_num_scheduled_tokens: int
    # Copy-on-write: copy block src into dst (every layer) before the forward pass ...
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # ... and these requests' block tables changed beyond appending: full tables to use (per
    # group). A window group's slots that fell out of the window are not reported: the runner's
    # stale ids there are never read, like the null block.
    replaced_block_tables: dict[str, list[list[int]]] = field(default_factory=dict)
    # Draft tokens to verify this step (speculative decoding): req_id -> draft ids; with a draft
    # model, DRAFT_PLACEHOLDER slots the runner fills with its proposals before the forward.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    finished_req_ids: set[str] = field(default_factory=set)  # runner drops their state
    preempted_req_ids: set[str] = field(default_factory=set)
    # Of total_num_scheduled_tokens, those that are prompt (prefill chunks, recomputation).
    num_scheduled_prompt_tokens: int = 0
    # Why, for the step trace (the runner ignores these): each victim and the running request
    # that needed its blocks; waiting requests that did not fit and were skipped (skip-ahead).
    preempted_by: dict[str, str] = field(default_factory=dict)
    skipped_req_ids: list[str] = field(default_factory=list)
    # Structured outputs: req_id -> the allowed-token bitmask of each row it samples this step
    # (1 + its drafts), packed little-endian int32 words per row, rows concatenated; the runner
    # sets every other logit of those rows to -inf. None when no request is constrained.
    grammar_bitmask: dict[str, bytes] | None = None

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass(slots=True)
class TokenLogprobs:
    """Logprobs at one position: entry 0 is the chosen token, then the top-k by rank."""
    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]  # 1 = most likely in the vocabulary


@dataclass(slots=True)
class PromptLogprobsChunk:
    """Prompt logprobs computed this step: ``entries[i]`` scores prompt token ``start + i``."""
    start: int
    entries: list[TokenLogprobs]


@dataclass(slots=True)
class RunnerOutput:
    req_ids: list[str]
    req_id_to_index: dict[str, int]
    # Per request: the tokens sampled this step (empty for a partial prefill; 1 + accepted
    # drafts with speculative decoding).
    sampled_token_ids: list[list[int]]
    # Per request, None or one TokenLogprobs per sampled token (SamplingParams.logprobs).
    logprobs: list[list[TokenLogprobs] | None] | None = None
    prompt_logprobs: dict[str, PromptLogprobsChunk] = field(default_factory=dict)
    # Pooling requests whose input ended this step: req_id -> its vector (the pooler's output).
    pooler_output: dict[str, list[float]] = field(default_factory=dict)
    # Requests that verified fewer drafts than they had slots (a draft model below draft_p_min).
    num_draft_tokens: dict[str, int] | None = None

    @classmethod
    def empty(cls) -> "RunnerOutput":
        return cls([], {}, [])


@dataclass(slots=True)
class EngineCoreOutput:
    """One request's row of ``EngineCoreOutputs`` (a view, for callers that want objects)."""
    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort"
    stop_reason: int | str | None = None
    new_logprobs: list[TokenLogprobs] | None = None
    new_prompt_logprobs: PromptLogprobsChunk | None = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class EngineCoreOutputs:
    """What one step produced, column-wise: a row per request with news (new tokens, a beam
    slot's logprobs, prompt logprobs), and the rarer fields keyed by request id.

    Columns rather than one object per request: this is built for every running request every
    step, and on the plain decode path a row costs two list appends.
    """
    req_ids: list[str] = field(default_factory=list)
    new_token_ids: list[list[int]] = field(default_factory=list)
    finished: dict[str, tuple[str, int | str | None]] = field(default_factory=dict)  # (reason, stop_reason)
    new_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    new_prompt_logprobs: dict[str, PromptLogprobsChunk] = field(default_factory=dict)
    # Prefix-cache hit of requests admitted for the first time (or forked) since the last step;
    # such a request may have no row yet (a partial prefill).
    num_cached_tokens: dict[str, int] = field(default_factory=dict)
    scheduler_stats: SchedulerStats = field(default_factory=SchedulerStats)
    # Beam searches that ended this step: request id -> its beams, best first.
    finished_beams: dict[str, list[FinishedBeam]] = field(default_factory=dict)
    # Pooling requests that finished this step: request id -> its vector.
    pooler_output: dict[str, list[float]] = field(default_factory=dict)
    # The data-parallel replica whose step this is (its client stamps it; 0 with one replica).
    engine_index: int = 0
    # The step's trace record (docs/trace_schema.md), on the steps the dashboard's sampler
    # picked while someone watches (engine/trace_stream.py); None on every other step.
    trace_record: dict[str, Any] | None = None

    def add(self, req_id: str, new_token_ids: list[int], logprobs: list[TokenLogprobs] | None = None,
            prompt_logprobs: PromptLogprobsChunk | None = None) -> None:
        self.req_ids.append(req_id)
        self.new_token_ids.append(new_token_ids)
        if logprobs:
            self.new_logprobs[req_id] = logprobs
        if prompt_logprobs is not None:
            self.new_prompt_logprobs[req_id] = prompt_logprobs

    def __len__(self) -> int:
        return len(self.req_ids)

    def __iter__(self):
        for rid, ids in zip(self.req_ids, self.new_token_ids):
            reason, stop_reason = self.finished.get(rid, (None, None))
            yield EngineCoreOutput(rid, ids, reason, stop_reason, self.new_logprobs.get(rid),
                                   self.new_prompt_logprobs.get(rid), self.num_cached_tokens.get(rid, 0))

    def __getitem__(self, index: int) -> EngineCoreOutput:
        return list(self)[index]

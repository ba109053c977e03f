"""Request: one sequence's journey waiting -> running -> finished, in plain Python.

It owns the sequence's tokens (``all_token_ids``: prompt then outputs), its progress
(``num_computed_tokens`` chases ``num_tokens``) and its stop limits. Blocks are the KV cache
manager's; queue membership is the scheduler's.
"""
from __future__ import annotations

import time
from enum import IntEnum

from pagedllm.lora.request import LoRARequest
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams


class RequestStatus(IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Everything from here on is finished.
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    """The scheduler's view of one sequence.

    ``num_computed_tokens`` chases ``num_tokens`` (plus ``spec_token_ids``, drafts to verify):
    the scheduler's only job is to let the first catch up with the second. The scheduler appends
    sampled tokens to ``all_token_ids`` directly; ``num_sent_tokens`` says how many of them the
    runner has been given (0: the runner does not know the request, so it is sent whole).
    """

    __slots__ = (
        "request_id", "prompt_token_ids", "sampling_params", "eos_token_ids", "arrival_time",
        "priority", "cache_salt", "max_tokens", "status", "num_computed_tokens", "num_cached_tokens",
        "stop_reason", "num_preemptions", "block_hashes", "spec_token_ids", "num_skipped_past",
        "num_sent_tokens", "is_beam", "all_token_ids", "num_prompt_tokens", "max_num_tokens",
        "maybe_stop_ids", "num_output_placeholders", "num_drafts_in_flight", "lora_request", "pooling_params",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams | None,
        eos_token_ids: frozenset[int] = frozenset(),
        max_tokens: int | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        output_token_ids: list[int] | None = None,
        lora_request: LoRARequest | None = None,
        pooling_params: PoolingParams | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        # None until admission resolves it (the scheduler knows max_model_len and the cache size).
        self.max_tokens = max_tokens if max_tokens is not None else (
            sampling_params.max_tokens if sampling_params is not None else None)
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority
        self.lora_request = lora_request
        # The prefix cache's extra key: an adapter's KV is never another's (or the base's).
        self.cache_salt = cache_salt if lora_request is None else (
            f"{cache_salt or ''}\x00{lora_request.cache_key}")
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first admission; -1 until admitted
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        self.block_hashes: list[int] = []  # hashes of the full blocks of all_token_ids, in order
        self.spec_token_ids: list[int] = []
        self.num_skipped_past = 0  # later requests admitted while this one waited at the head
        self.num_sent_tokens = 0
        # Async scheduling: tokens sampled by steps still in flight, not yet appended. The next
        # step may already compute them: the runner feeds in what it sampled itself.
        self.num_output_placeholders = 0
        # Of those, the draft slots: counted as accepted until their step's update, so the
        # runner may start up to this many positions before num_computed_tokens.
        self.num_drafts_in_flight = 0
        # Beam search: the engine, not the sampler, picks this request's next token; the
        # scheduler only reports the step's top-k logprobs once its sequence is computed.
        self.is_beam = False
        # A pooling request runs its prompt (an encoder's whole in one step), reads no
        # prefix-cache hit and finishes with its vector; it has no ``sampling_params`` (None).
        self.pooling_params = pooling_params
        self.num_prompt_tokens = len(self.prompt_token_ids)
        # A plain attribute, not a property: it is read on the per-step hot path. A sequence
        # forked from another starts with outputs (a beam's tokens so far).
        self.all_token_ids = self.prompt_token_ids + list(output_token_ids or ())
        # Cheap pre-checks for the stop conditions (set by ``set_limits`` at admission): the full
        # check runs only when a sampled token is in ``maybe_stop_ids`` or the length is reached.
        self.max_num_tokens = 0
        self.maybe_stop_ids: frozenset[int] = frozenset()

    def set_limits(self, max_model_len: int, interned: dict[frozenset[int], frozenset[int]]) -> None:
        """Once ``max_tokens`` is resolved: where the sequence must end, and which tokens may stop
        it. ``interned`` makes requests with equal stop sets share one (it stays in the CPU cache)."""
        self.max_num_tokens = min(self.num_prompt_tokens + self.max_tokens, max_model_len)
        sp = self.sampling_params
        if sp is None:  # a pooling request samples nothing, so nothing stops it
            self.max_num_tokens = self.num_prompt_tokens + 1  # every input position is computed
            self.maybe_stop_ids = frozenset()
            return
        eos = frozenset() if sp.ignore_eos else frozenset(self.eos_token_ids)
        stop_ids = eos | sp.all_stop_token_ids
        if stop_ids in interned or len(interned) < 256:  # bounded: users choose stop ids
            stop_ids = interned.setdefault(stop_ids, stop_ids)
        self.maybe_stop_ids = stop_ids

    # -- token bookkeeping -------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        """The generated tokens (a copy)."""
        return self.all_token_ids[self.num_prompt_tokens:]

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        if isinstance(token_ids, int):
            self.all_token_ids.append(token_ids)
        else:
            self.all_token_ids.extend(token_ids)

    # -- status ------------------------------------------------------------------------------
    def check_stop(self) -> bool:
        """Stop checks for the token just appended, in order: min_tokens, EOS, stop token ids,
        then length. Sets the finished status and returns True if the sequence stops."""
        sp = self.sampling_params
        if self.num_output_tokens >= sp.min_tokens:
            last = self.all_token_ids[-1]
            if not sp.ignore_eos and last in self.eos_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                return True
            if last in sp.all_stop_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                self.stop_reason = last
                return True
        if len(self.all_token_ids) >= self.max_num_tokens:
            self.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False

    def is_finished(self) -> bool:
        return self.status >= RequestStatus.FINISHED_STOPPED

    def get_finished_reason(self) -> str | None:
        return _FINISH_REASONS.get(self.status)

    def __lt__(self, other: "Request") -> bool:
        # Priority order: lower priority value first, then earlier arrival, then id (stable).
        return (self.priority, self.arrival_time, self.request_id) < (
            other.priority, other.arrival_time, other.request_id)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, "
                f"computed={self.num_computed_tokens}/{self.num_tokens})")

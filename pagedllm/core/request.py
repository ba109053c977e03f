"""Request: one prompt's journey waiting -> running -> finished, in plain Python."""
from __future__ import annotations

import time
from enum import IntEnum

from pagedllm.sampling_params import SamplingParams


class RequestStatus(IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Everything from here on is finished.
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5

    @staticmethod
    def is_finished(status: "RequestStatus") -> bool:
        return status >= RequestStatus.FINISHED_STOPPED

    @staticmethod
    def finish_reason(status: "RequestStatus") -> str | None:
        return _FINISH_REASONS.get(status)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    """The scheduler's view of one sequence.

    ``num_computed_tokens`` chases ``num_tokens``: the scheduler's only job is to let the first
    catch up with the second. Tokens live in one list, ``all_token_ids`` (prompt then outputs);
    the scheduler appends sampled tokens to it directly on its hot path.
    """

    __slots__ = (
        "request_id", "prompt_token_ids", "sampling_params", "eos_token_ids", "arrival_time",
        "priority", "cache_salt", "max_tokens", "status", "num_computed_tokens", "num_cached_tokens",
        "stop_reason", "num_preemptions", "block_hashes", "spec_token_ids", "num_skipped_past",
        "num_sent_tokens", "pending_forks", "fork_leader", "is_beam",
        "all_token_ids", "_num_prompt_tokens", "max_num_tokens", "maybe_stop_ids",
        "kv_in_place_until",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: frozenset[int] = frozenset(),
        max_tokens: int | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        # The scheduler resolves the effective limit (it knows max_model_len); None until then.
        self.max_tokens = max_tokens if max_tokens is not None else sampling_params.max_tokens
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority
        self.cache_salt = cache_salt
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first admission; -1 until admitted
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        self.block_hashes: list[int] = []  # hashes of the full blocks of all_token_ids, in order
        self.spec_token_ids: list[int] = []
        self.num_skipped_past = 0  # later requests admitted while this one waited at the head
        self.num_sent_tokens = 0  # how many of all_token_ids the runner has been given
        # Parallel sampling: the leader prefills the prompt once; at its first sampled token the
        # pending children fork from it (sharing every block) and run on their own.
        self.pending_forks: list[Request] = []
        self.fork_leader: Request | None = None
        # Beam search: the engine, not the sampler, picks this request's next token; the
        # scheduler only reports the top-k logprobs once its sequence is computed.
        self.is_beam = False
        self._num_prompt_tokens = len(self.prompt_token_ids)
        # A plain attribute, not a property: it is read on the per-step hot path.
        self.all_token_ids = list(self.prompt_token_ids)
        # Cheap pre-checks for the stop conditions (set by ``set_limits`` at admission): the full
        # check runs only when a sampled token is in ``maybe_stop_ids`` or the length is reached.
        self.max_num_tokens = 0
        self.maybe_stop_ids: frozenset[int] = frozenset()
        # Set by the KVCacheManager: while num_computed_tokens is below this, one more token lands
        # in the request's own last block without filling it, so a decode step needs no KV
        # bookkeeping at all. 0: ask the manager.
        self.kv_in_place_until = 0

    def set_limits(self, max_model_len: int, interned: dict[frozenset[int], frozenset[int]]) -> None:
        """Once ``max_tokens`` is resolved: where the sequence must end, and which tokens may stop
        it. ``interned`` makes requests with equal stop sets share one (it stays in the CPU cache)."""
        self.max_num_tokens = min(self._num_prompt_tokens + self.max_tokens, max_model_len)
        sp = self.sampling_params
        eos = frozenset() if sp.ignore_eos else frozenset(self.eos_token_ids)
        stop_ids = eos | frozenset(sp._all_stop_token_ids)
        if stop_ids in interned or len(interned) < 256:  # bounded: users choose stop ids
            stop_ids = interned.setdefault(stop_ids, stop_ids)
        self.maybe_stop_ids = stop_ids

    # -- token bookkeeping -------------------------------------------------------------------
    @property
    def num_prompt_tokens(self) -> int:
        return self._num_prompt_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.all_token_ids) + len(self.spec_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self._num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        """The generated tokens (a copy)."""
        return self.all_token_ids[self._num_prompt_tokens:]

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        if isinstance(token_ids, int):
            self.all_token_ids.append(token_ids)
        else:
            self.all_token_ids.extend(token_ids)

    # -- status ------------------------------------------------------------------------------
    def is_finished(self) -> bool:
        return self.status >= RequestStatus.FINISHED_STOPPED

    def get_finished_reason(self) -> str | None:
        return RequestStatus.finish_reason(self.status)

    def __lt__(self, other: "Request") -> bool:
        # Priority order: lower priority value first, then earlier arrival, then id (stable).
        return (self.priority, self.arrival_time, self.request_id) < (
            other.priority, other.arrival_time, other.request_id)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, "
                f"computed={self.num_computed_tokens}/{self.num_tokens})")

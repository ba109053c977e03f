"""InputBatch: the runner's half of the SchedulerOutput contract, written once.

A runner keeps a small state per request (its tokens, block table, progress, sampling params)
and receives only diffs each step. Both the FakeRunner and the ModelRunner apply a
SchedulerOutput through this table, so the FakeRunner's KV check covers the real runner's
bookkeeping too. Plain Python: no torch.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.core.outputs import SchedulerOutput
from pagedllm.lora.request import LoRARequest
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams


class StateMismatchError(AssertionError):
    """The scheduler and the runner disagree about a request (a contract bug, never user error)."""


@dataclass(slots=True)
class CachedRequestState:
    req_id: str
    # Prompt + outputs known to the runner: those the scheduler sent, then those the runner
    # sampled itself and the scheduler has not echoed back yet (``num_unconfirmed``). With async
    # scheduling a step may compute a token that only the runner knows so far.
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams | None  # None: a pooling request
    block_ids: list[list[int]]  # the block table of each KV cache group
    num_computed_tokens: int
    eos_token_ids: frozenset[int]
    num_unconfirmed: int = 0
    lora_request: LoRARequest | None = None
    pooling_params: PoolingParams | None = None  # a pooling request: pooled, never sampled
    # A chunked pooling input: what its earlier chunks left for the pooler (hidden rows).
    pooling_carry: list = field(default_factory=list)
    # Positions whose KV the draft model holds (runner/draft_model.py).
    num_draft_computed: int = 0
    # The target's hidden rows from position draft_hidden_start that an EAGLE-3 or MTP head
    # has yet to read (runner/eagle.py); None: none kept.
    draft_hidden: object = None
    draft_hidden_start: int = 0
    # Draft slots the runner rolled back in step ``rolled_back_step`` (rejected or unused): with
    # async scheduling the next step was scheduled before the scheduler learnt of them.
    num_rolled_back: int = 0
    rolled_back_step: int = -1

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step: positions [start, start + num_tokens) are computed, the
    last ``len(drafts)`` of them draft tokens; ``samples``: the step reaches the end of its known
    tokens, so the logits at its last real position are sampled (a partial prefill samples
    nothing)."""
    state: CachedRequestState
    start: int
    num_tokens: int
    drafts: list[int]
    samples: bool
    num_slots: int = 0  # the draft slots the scheduler gave it (a drafter may fill fewer)

    @property
    def pools(self) -> bool:
        """A pooling request whose input ends this step (an earlier chunk only computes KV)."""
        return self.state.pooling_params is not None and self.start + self.num_tokens >= len(self.state.token_ids)

    @property
    def input_ids(self) -> list[int]:
        end = self.start + self.num_tokens - len(self.drafts)
        return self.state.token_ids[self.start:end] + self.drafts


class InputBatch:
    def __init__(self) -> None:
        self.requests: dict[str, CachedRequestState] = {}
        self.num_steps = 0

    def update_states(self, so: SchedulerOutput) -> list[ScheduledRequest]:
        """Apply the step's diffs, then return the scheduled requests in order, each advanced
        past the tokens it computes this step."""
        requests = self.requests
        self.num_steps += 1
        for rid in so.finished_req_ids:
            requests.pop(rid, None)
        for rid in so.preempted_req_ids:
            requests.pop(rid, None)
        for new in so.scheduled_new_reqs:  # first admission, resume after preemption, or fork
            requests[new.req_id] = CachedRequestState(
                new.req_id, new.prompt_token_ids + new.output_token_ids, len(new.prompt_token_ids),
                new.sampling_params, [list(t) for t in new.block_ids], new.num_computed_tokens,
                new.eos_token_ids, lora_request=new.lora_request, pooling_params=new.pooling_params,
                num_draft_computed=max(new.num_computed_tokens - 1, 0))
        cached = so.scheduled_cached_reqs
        for rid, blocks, num_computed, new_ids in zip(cached.req_ids, cached.new_block_ids,
                                                      cached.num_computed_tokens, cached.new_token_ids):
            state = requests[rid]
            if blocks:  # per group; [] when no group got a block
                for table, group_blocks in zip(state.block_ids, blocks):
                    if group_blocks:
                        table.extend(group_blocks)
            if new_ids:
                _confirm(state, new_ids)
            if num_computed != state.num_computed_tokens and not (
                    state.rolled_back_step == self.num_steps - 1
                    and num_computed == state.num_computed_tokens + state.num_rolled_back):
                # Equal, or (async scheduling) ahead by the drafts rolled back in the step before,
                # whose outcome the scheduler did not know yet.
                raise StateMismatchError(f"{rid}: the runner computed {state.num_computed_tokens} "
                                         f"tokens, the scheduler says {num_computed}")
        for rid, table in so.replaced_block_tables.items():
            requests[rid].block_ids = [list(t) for t in table]

        scheduled = []
        spec = so.scheduled_spec_decode_tokens
        for rid, n in so.num_scheduled_tokens.items():
            state = requests[rid]
            drafts = spec.get(rid, []) if spec else []
            start = state.num_computed_tokens
            state.num_computed_tokens = start + n
            samples = start + n - len(drafts) >= len(state.token_ids) and state.pooling_params is None
            scheduled.append(ScheduledRequest(state, start, n, drafts, samples, len(drafts)))
        return scheduled

    def append_sampled(self, s: ScheduledRequest, token_ids: list[int]) -> None:
        """The tokens this runner just sampled for a request (its accepted drafts, then one
        more): the next step may compute them before the scheduler sends them back. Rejected
        drafts are rolled back here, so the next step starts after the accepted ones whether or
        not the scheduler knew when it scheduled it."""
        state = s.state
        state.token_ids.extend(token_ids)
        state.num_unconfirmed += len(token_ids)
        if s.num_slots:
            num_accepted = len(token_ids) - 1
            state.num_computed_tokens -= len(s.drafts) - num_accepted
            state.num_rolled_back = s.num_slots - num_accepted
            state.rolled_back_step = self.num_steps


def _confirm(state: CachedRequestState, new_ids: list[int]) -> None:
    """Tokens the scheduler appended since the runner last saw the request: those the runner
    sampled itself are already there (and must agree), the rest (a beam's choice) are added."""
    k = min(state.num_unconfirmed, len(new_ids))
    if k:
        start = len(state.token_ids) - state.num_unconfirmed
        if state.token_ids[start:start + k] != new_ids[:k]:
            raise StateMismatchError(f"{state.req_id}: the scheduler appended {new_ids[:k]}, the "
                                     f"runner sampled {state.token_ids[start:start + k]}")
        state.num_unconfirmed -= k
    if k < len(new_ids):
        state.token_ids.extend(new_ids[k:])

"""SchedulerStats: what one step did, for metrics and logs.

Built once per step from the step's SchedulerOutput and the tokens it produced, never by
counters threaded through the scheduling code; the engine adds the records up.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedllm.core.outputs import SchedulerOutput
    from pagedllm.core.request import Request


@dataclass(slots=True)
class SchedulerStats:
    """What one step did, built once from its SchedulerOutput and the tokens it produced; the
    engine's metrics and logs add these up instead of keeping counters of their own."""
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    num_scheduled_tokens: int = 0
    num_prompt_tokens: int = 0  # prompt tokens computed this step, recomputation included
    num_generation_tokens: int = 0  # tokens appended to sequences this step
    num_preempted_reqs: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up at admission this step ...
    prefix_cache_hits: int = 0  # ... and found cached
    num_drafts: int = 0  # speculative decoding: draft runs verified, draft tokens, accepted
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_blocks_allocated: int = 0  # KV blocks: handed out, given back, evicted from the prefix cache
    num_blocks_freed: int = 0
    num_blocks_evicted: int = 0
    num_blocks_copied: int = 0  # copy-on-write copies


def count_prompt_tokens(so: "SchedulerOutput", requests: Mapping[str, "Request"]) -> int:
    """Prompt tokens the step computes (prefill chunks, recomputation after preemption too)."""
    num = 0
    for new in so.scheduled_new_reqs:
        start = new.num_computed_tokens
        num += max(min(len(new.prompt_token_ids), start + so.num_scheduled_tokens[new.req_id]) - start, 0)
    cached = so.scheduled_cached_reqs
    for rid, start in zip(cached.req_ids, cached.num_computed_tokens):
        req = requests.get(rid)
        if req is not None and start < req.num_prompt_tokens:  # a prefill chunk
            num += min(req.num_prompt_tokens, start + so.num_scheduled_tokens[rid]) - start
    return num

"""SchedulerStats: what one step did, for metrics and logs.

Built once per step from the step's SchedulerOutput and the tokens it produced, never by
counters threaded through the scheduling code; the engine adds the records up.
"""
from __future__ import annotations

from dataclasses import dataclass, field


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
    # Per draft position: how many verifications this step accepted it (index 0 = first draft).
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    num_blocks_allocated: int = 0  # KV blocks: handed out, given back, evicted from the prefix cache
    num_blocks_freed: int = 0
    num_blocks_evicted: int = 0
    num_blocks_copied: int = 0  # copy-on-write copies
    # LoRA adapter name -> requests running / waiting with it (filled when adapters are on).
    running_lora_adapters: dict[str, int] = field(default_factory=dict)
    waiting_lora_adapters: dict[str, int] = field(default_factory=dict)


"""EngineStats: the engine's counters, the sum of every step's SchedulerStats.

Nothing on the scheduling path counts anything for metrics: each step reports what it did
(``EngineCoreOutputs.scheduler_stats``) and this adds it up for ``LLMEngine.get_metrics``.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pagedllm.core.outputs import EngineCoreOutputs, SchedulerOutput
from pagedllm.core.scheduler_stats import SchedulerStats


@dataclass(slots=True)
class StepTimings:
    """Wall time of one step's phases, in seconds."""
    schedule_s: float
    execute_s: float
    update_s: float


# Sees every step after the scheduler's update (LLMEngine.step_observers).
StepObserver = Callable[[SchedulerOutput, EngineCoreOutputs, StepTimings], None]


@dataclass
class EngineStats:
    num_prompt_tokens_computed: int = 0  # prompt tokens run through the model, recompute included
    num_generation_tokens: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_steps: int = 0
    num_scheduled_tokens: int = 0

    def add(self, step: SchedulerStats) -> None:
        self.num_prompt_tokens_computed += step.num_prompt_tokens
        self.num_generation_tokens += step.num_generation_tokens
        self.num_preemptions += step.num_preempted_reqs
        self.prefix_cache_queries += step.prefix_cache_queries
        self.prefix_cache_hits += step.prefix_cache_hits
        self.num_drafts += step.num_drafts
        self.num_draft_tokens += step.num_draft_tokens
        self.num_accepted_tokens += step.num_accepted_tokens
        self.num_steps += 1
        self.num_scheduled_tokens += step.num_scheduled_tokens

    def as_metrics(self) -> dict[str, float]:
        return {
            "pagedllm:num_preemptions": self.num_preemptions,
            "pagedllm:prefix_cache_queries": self.prefix_cache_queries,
            "pagedllm:prefix_cache_hits": self.prefix_cache_hits,
            "pagedllm:prompt_tokens_computed": self.num_prompt_tokens_computed,
            "pagedllm:generation_tokens": self.num_generation_tokens,
            "pagedllm:spec_decode_num_drafts": self.num_drafts,
            "pagedllm:spec_decode_num_draft_tokens": self.num_draft_tokens,
            "pagedllm:spec_decode_num_accepted_tokens": self.num_accepted_tokens,
        }

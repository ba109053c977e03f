"""The Runner protocol: what the engine needs from whatever executes a step."""
from __future__ import annotations

from typing import Protocol, runtime_checkable

from pagedllm.core.outputs import RunnerOutput, SchedulerOutput


@runtime_checkable
class Runner(Protocol):
    def determine_num_blocks(self, block_size: int) -> int:
        """How many KV blocks of ``block_size`` tokens fit the memory budget."""
        ...

    def get_kv_cache_groups(self) -> list[int | None]:
        """The KV cache groups the model's layers form, each as its sliding window (None: full
        attention); a block costs the same bytes in every group (runner/kv_cache_groups.py)."""
        ...

    def initialize_kv_cache(self, num_blocks: int, block_size: int) -> None:
        """Allocate the KV cache the scheduler will hand out, block by block."""
        ...

    def execute_model(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        """Run one step: write new KV, attend, sample for every request that completed its
        tokens (a partial prefill samples nothing)."""
        ...

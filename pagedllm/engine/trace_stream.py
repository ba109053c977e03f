"""The live dashboard's source, on the engine core's side (wherever the core runs).

``TraceSampler`` is a step observer the front end switches on while someone watches
``/v1/trace/stream`` (``EngineCore.set_trace_stream``). Every step it follows the step's diffs
(the recorder's small request table must see them all); at most ``max_records_per_s`` steps a
second it builds the step's record (docs/trace_schema.md) and hangs it on the step's outputs
(``EngineCoreOutputs.trace_record``), which carry it to the front end in-process and over the
engine core process's socket alike. Sampling here, where the steps happen, means a busy core
neither builds nor sends a record per step for its viewers.
"""
from __future__ import annotations

import time
from typing import Any

from pagedllm.core.outputs import EngineCoreOutputs, SchedulerOutput
from pagedllm.core.scheduler import Scheduler
from pagedllm.engine.engine_stats import StepTimings
from pagedllm.engine.step_trace import StepRecorder, block_map


class TraceSampler:
    def __init__(self, scheduler: Scheduler, max_records_per_s: float = 20.0,
                 block_map_interval_s: float = 1.0) -> None:
        self.recorder = StepRecorder(scheduler.max_num_batched_tokens, scheduler.kv_cache_manager,
                                     block_map_interval_s)
        self.min_interval_s = 1.0 / max_records_per_s
        self._last_sent = float("-inf")

    def __call__(self, so: SchedulerOutput, outs: EngineCoreOutputs, timings: StepTimings) -> None:
        now = time.monotonic()
        if now - self._last_sent < self.min_interval_s:
            self.recorder.skip(so, outs)
            return
        self._last_sent = now
        outs.trace_record = self.recorder.observe(so, outs, timings)

    def request_block_map(self) -> None:
        """A new viewer: the next record carries a block map, and goes out at once."""
        self.recorder.request_block_map()
        self._last_sent = float("-inf")


def trace_snapshot(scheduler: Scheduler) -> dict[str, Any]:
    """What a new viewer is greeted with: the budget, the cache's shape and its blocks now."""
    kv = scheduler.kv_cache_manager
    return {"max_num_batched_tokens": scheduler.max_num_batched_tokens,
            "num_blocks": kv.num_blocks, "block_size": kv.block_size, "block_map": block_map(kv)}

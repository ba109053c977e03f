"""UniProcExecutor: the runner in this process (one rank), with no wire in between."""
from __future__ import annotations

from typing import Any

from pagedllm.core.outputs import RunnerOutput, SchedulerOutput
from pagedllm.errors import EngineDeadError
from pagedllm.executor.abstract import Executor
from pagedllm.runner.base import Runner


class UniProcExecutor(Executor):
    def __init__(self, runner: Runner) -> None:
        self.runner = runner  # public: tests and tools inspect the in-process runner
        self._is_shut_down = False

    def determine_num_blocks(self, block_size: int) -> int:
        return self.runner.determine_num_blocks(block_size)

    def get_kv_cache_groups(self) -> list[int | None]:
        return self.runner.get_kv_cache_groups()

    def initialize(self, num_blocks: int, block_size: int) -> None:
        self.runner.initialize_kv_cache(num_blocks, block_size)

    def execute_model(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        return self.runner.execute_model(scheduler_output)

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        return [getattr(self.runner, method)(*args)]

    def check_health(self) -> None:
        if self._is_shut_down:
            raise EngineDeadError("the executor was shut down")

    def shutdown(self) -> None:
        self._is_shut_down = True

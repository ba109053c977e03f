"""UniProcExecutor: the runner in this process (one rank), with no wire in between."""
from __future__ import annotations

from typing import Any

from pagedllm.core.outputs import RunnerOutput, SchedulerOutput
from pagedllm.errors import EngineDeadError
from pagedllm.executor.abstract import Executor
from pagedllm.runner.base import Runner


class UniProcExecutor(Executor):
    def __init__(self, runner: Runner) -> None:
        self.runner: Runner | None = runner  # public: tests and tools inspect the in-process runner
        self._is_shut_down = False

    def _live_runner(self) -> Runner:
        if self.runner is None:
            raise EngineDeadError("the executor was shut down")
        return self.runner

    def determine_num_blocks(self, block_size: int) -> int:
        return self._live_runner().determine_num_blocks(block_size)

    def get_kv_cache_groups(self) -> list[int | None]:
        return self._live_runner().get_kv_cache_groups()

    def initialize(self, num_blocks: int, block_size: int) -> None:
        self._live_runner().initialize_kv_cache(num_blocks, block_size)

    def execute_model(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        return self._live_runner().execute_model(scheduler_output)

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        return [getattr(self._live_runner(), method)(*args)]

    def check_health(self) -> None:
        if self._is_shut_down:
            raise EngineDeadError("the executor was shut down")

    def shutdown(self) -> None:
        self._is_shut_down = True
        # The runner holds the weights and the KV cache: released here, reference counting frees them
        # now, whatever cycles still hold the engine around it.
        self.runner = None

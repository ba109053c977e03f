"""The Executor interface: what the engine core needs from whatever runs the model's ranks.

The engine never talks to a runner directly: it asks an executor, which runs the runner in this
process (``uniproc.py``), in one worker process per rank (``multiproc.py``), or, later, in Ray
actors. Every rank gets the same ``SchedulerOutput``; rank 0's ``RunnerOutput`` comes back.

Sizing keeps the Runner protocol's shape, ``determine_num_blocks(block_size)``, rather than
returning bytes: the runner alone knows its bytes per block, and with several ranks the
executor simply takes the smallest count.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable

from pagedllm.config import EngineConfig
from pagedllm.core.outputs import RunnerOutput, SchedulerOutput
from pagedllm.errors import EngineDeadError
from pagedllm.runner.base import Runner

# Builds one rank's runner. For the mp executor it must pickle (sent to the worker over a pipe):
# a module-level function, a class, or functools.partial of one.
RunnerFactory = Callable[[], Runner]


class Executor(ABC):
    @abstractmethod
    def determine_num_blocks(self, block_size: int) -> int:
        """How many KV blocks of ``block_size`` tokens fit on every rank."""

    @abstractmethod
    def get_kv_cache_groups(self) -> list[int | None]:
        """Each KV cache group's sliding window (None: full attention); the same on every rank."""

    @abstractmethod
    def initialize(self, num_blocks: int, block_size: int) -> None:
        """Allocate every rank's KV cache (the blocks the scheduler hands out)."""

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        """Run one step on every rank; rank 0's output. Raises EngineDeadError if a worker died."""

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        """Call a runner method (``worker.CALLS``) on every rank; each rank's result."""
        raise NotImplementedError(f"{type(self).__name__} does not run {method}")

    @abstractmethod
    def check_health(self) -> None:
        """Return if every rank is alive; raise EngineDeadError (saying which and why) if not."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop every rank and release what the executor holds. Idempotent."""

    def __enter__(self) -> "Executor":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


class RankGroupExecutor(Executor):
    """An executor whose every call goes to every rank in lockstep (mp workers, Ray actors):
    the interface written once in terms of ``_call`` (each rank's result, rank order) and
    ``_check_ranks`` (raise EngineDeadError naming a rank that is gone)."""

    _is_shut_down: bool = False
    _failure: str | None = None  # once a rank failed, every call raises this

    @abstractmethod
    def _call(self, method: str, *args: Any) -> list[Any]:
        """Send one call to every rank and return every rank's result."""

    @abstractmethod
    def _check_ranks(self) -> None:
        """Return if every rank is there; else raise EngineDeadError saying which."""

    def determine_num_blocks(self, block_size: int) -> int:
        return min(self._call("determine_num_blocks", block_size))

    def get_kv_cache_groups(self) -> list[int | None]:
        return self._call("get_kv_cache_groups")[0]

    def initialize(self, num_blocks: int, block_size: int) -> None:
        self._call("initialize_kv_cache", num_blocks, block_size)

    def execute_model(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        return self._call("execute_model", scheduler_output)[0]

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        return self._call(method, *args)

    def check_health(self) -> None:
        if self._is_shut_down:
            raise EngineDeadError("the executor was shut down")
        if self._failure is not None:
            raise EngineDeadError(self._failure)
        self._check_ranks()


def build_model_runner(config: EngineConfig, max_model_len: int) -> Runner:
    """The real runner (a RunnerFactory once bound with functools.partial); ``max_model_len``
    as the engine resolved it."""
    from pagedllm.runner.model_runner import ModelRunner  # torch lives below this line

    return ModelRunner(config, max_model_len)


def return_runner(runner: Runner) -> Runner:
    """A RunnerFactory for a runner built by the caller: ``partial(return_runner, runner)``
    (the mp executor pickles it, so the worker runs its own copy)."""
    return runner

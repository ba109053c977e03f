"""Executors: where the runner runs (this process, worker processes, Ray actors).

``create_executor`` picks one from ``ParallelConfig.distributed_executor_backend`` (vLLM's
engine argument): "uni" (one rank, the default), "mp" (the default for more) or "ray", with
``tensor_parallel_size`` ranks. Nothing here imports torch: the real runner is built by
``build_model_runner``, lazily, in whichever process runs it.
"""
from __future__ import annotations

import functools

from pagedllm.config import EngineConfig
from pagedllm.distributed.tp_sizes import check_tensor_parallel_size
from pagedllm.errors import ModelLoadError, ValidationError
from pagedllm.executor.abstract import Executor, RunnerFactory, build_model_runner, return_runner
from pagedllm.runner.base import Runner

__all__ = ["Executor", "RunnerFactory", "create_executor"]


def create_executor(config: EngineConfig, runner: Runner | None = None,
                    max_model_len: int | None = None, *,
                    runner_factory: RunnerFactory | None = None) -> Executor:
    """The executor ``config`` asks for, running (in order of preference) ``runner`` (mp sends
    the worker a pickled copy), ``runner_factory()``, or the real ModelRunner (needs
    ``max_model_len``)."""
    if runner is not None:
        runner_factory = functools.partial(return_runner, runner)
    elif runner_factory is None:
        if max_model_len is None:
            raise TypeError("create_executor needs a runner, a runner_factory or max_model_len")
        runner_factory = functools.partial(build_model_runner, config, max_model_len)

    pc = config.parallel_config
    backend, world_size = pc.distributed_executor_backend, pc.tensor_parallel_size
    if world_size > 1:
        _check_model_splits(config.model_config.model, world_size)  # before any worker starts
    device = config.model_config.device
    if backend == "uni":
        from pagedllm.executor.uniproc import UniProcExecutor

        return UniProcExecutor(runner if runner is not None else runner_factory())
    if backend == "mp":
        from pagedllm.executor.multiproc import MultiprocExecutor  # pyzmq, msgpack

        return MultiprocExecutor(runner_factory, world_size, device=device)
    if backend == "ray":
        from pagedllm.executor.ray_executor import RayExecutor  # ray, imported on demand

        return RayExecutor(runner_factory, world_size, device=device)
    # ParallelConfig validates the name; this is for a backend it knows but nobody built.
    raise ValidationError(f"distributed_executor_backend={backend!r} is not built yet",
                          "distributed_executor_backend")


def _check_model_splits(model: str, world_size: int) -> None:
    """The heads must divide by the ranks: say so (naming the sizes that do) before spawning.
    A folder without a readable config.json is left to the loader, which says what is wrong."""
    from pagedllm.checkpoint.source import is_gguf_path, open_checkpoint

    try:
        check_tensor_parallel_size(open_checkpoint(model).config, world_size)
    except ValidationError:
        raise
    except (OSError, KeyError, TypeError, ValueError):
        return
    except ModelLoadError:
        if is_gguf_path(model):  # a broken GGUF file says so here, as its reader found it
            raise

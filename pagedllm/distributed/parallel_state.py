"""The tensor-parallel group of this process, and the collectives the parallel layers call.

A worker calls ``init_distributed`` once, before the runner builds the model: the layers read
``get_tp_group()`` when they are constructed to size their shards. In a process that never joined
a group (the uni executor, tests of single layers) the group is rank 0 of 1 and every collective
is the identity, so the same model code runs unsharded with no branch on "is TP on".

The whole world is one tensor-parallel group (no pipeline stages): gloo on CPU, NCCL on CUDA.
"""
from __future__ import annotations

import datetime
import logging
import os
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pagedllm import envs
from pagedllm.distributed.launch import DistributedInit

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TensorParallelGroup:
    rank: int = 0
    world_size: int = 1
    backend: str | None = None  # None: no group (world size 1)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; every rank ends with the same bits (ring order)."""
        if self.world_size > 1:
            dist.all_reduce(x)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's ``x`` concatenated along ``dim``, rank order."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x)
        return torch.cat(parts, dim=dim)


_TP_GROUP = TensorParallelGroup()


def get_tp_group() -> TensorParallelGroup:
    return _TP_GROUP


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    return _TP_GROUP.all_reduce(x)


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return _TP_GROUP.all_gather(x, dim)


def resolve_backend(device: str) -> str:
    cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    return "nccl" if cuda else "gloo"


def init_distributed(spec: DistributedInit) -> TensorParallelGroup:
    """Join the group ``spec`` describes; raise RuntimeError saying what failed (a port in use,
    an address no rank can reach, a rank that never came) instead of waiting without a word."""
    global _TP_GROUP
    if spec.world_size == 1:
        _TP_GROUP = TensorParallelGroup()
        return _TP_GROUP
    backend = resolve_backend(spec.device)
    if backend == "nccl":
        # One device per rank; under Ray each actor sees only its own (CUDA_VISIBLE_DEVICES).
        torch.cuda.set_device(spec.local_rank % torch.cuda.device_count())
    elif envs.omp_num_threads() is None:
        # Ranks on one machine share its cores: each takes its share, not all of them.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.local_world_size))
    where = (f"rank {spec.rank} of {spec.world_size} at {spec.init_method} ({backend}, "
             f"timeout {spec.timeout_s:g} s)")
    # A client rank whose master address answers but is not a torch store waits past any timeout
    # inside the C++ handshake: form the group on a thread and bound the wait ourselves.
    outcome: list[BaseException | None] = []

    def form() -> None:
        try:
            dist.init_process_group(backend, init_method=spec.init_method, rank=spec.rank,
                                    world_size=spec.world_size,
                                    timeout=datetime.timedelta(seconds=spec.timeout_s))
            check = torch.ones(1, device="cuda" if backend == "nccl" else "cpu")
            dist.all_reduce(check)  # every rank is connected to every other
            if int(check.item()) != spec.world_size:
                raise RuntimeError(f"the first all-reduce summed to {check.item()}, "
                                   f"not {spec.world_size}")
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - reported below with where it happened
            outcome.append(exc)

    thread = threading.Thread(target=form, name="pagedllm-dist-init", daemon=True)
    thread.start()
    thread.join(spec.timeout_s + 5.0)
    if not outcome:
        raise RuntimeError(f"could not form the tensor-parallel group: {where} did not connect "
                           f"within {spec.timeout_s:g} s (is the master address right and its "
                           f"port reachable from every node?)")
    if outcome[0] is not None:
        exc = outcome[0]
        raise RuntimeError(f"could not form the tensor-parallel group: {where}: "
                           f"{type(exc).__name__}: {exc}") from exc
    _TP_GROUP = TensorParallelGroup(spec.rank, spec.world_size, backend)
    logger.info("joined the tensor-parallel group: %s", where)
    return _TP_GROUP


def destroy_distributed() -> None:
    global _TP_GROUP
    if dist.is_initialized():
        dist.destroy_process_group()
    _TP_GROUP = TensorParallelGroup()

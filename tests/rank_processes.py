"""Run a function on two (or more) spawned ranks and collect what each puts on its queue: the
tensor-parallel equivalence tests of the layers, the dense families and the MoE families share it.

``target(rank, port, *args, queue)`` runs in a fresh spawned process per rank (torch.distributed
with gloo over ``port``) and puts ``(rank, result)`` on ``queue``. The processes are always
reaped, killed if they hang; a rank that dies without answering fails the wait on the queue.
"""
from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable


def _rank_main(target: Callable, rank: int, port: int, args: tuple, queue) -> None:
    """One rank: ``target``, then its answer flushed to the pipe and the process ended without
    the interpreter's teardown. There, after the rank had answered and destroyed its process
    group, a C++ thread of gloo's aborted the process ("terminate called without an active
    exception", exit code -6) in 2 of 2 full CI runs on an AMD Zen 4 VM (never when the test
    ran alone). What these tests check is what each rank computes; an exception in ``target``
    still ends the rank with a non-zero code."""
    target(rank, port, *args, queue)
    queue.close()
    queue.join_thread()
    os._exit(0)


def run_on_ranks(target: Callable, args: tuple, world_size: int = 2,
                 timeout: float = 300) -> dict[int, object]:
    from pagedllm.distributed.launch import get_open_port

    ctx = multiprocessing.get_context("spawn")
    queue, port = ctx.Queue(), get_open_port()
    procs = [ctx.Process(target=_rank_main, args=(target, rank, port, args, queue))
             for rank in range(world_size)]
    for p in procs:
        p.start()
    try:
        results = dict(queue.get(timeout=timeout) for _ in procs)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return results

"""How much of a tensor-parallel step is communication: a torch profiler over rank 0's steps.

Each of ``--tensor-parallel-size`` spawned ranks joins the group (gloo on CPU, NCCL on CUDA),
builds the real ModelRunner and drives its own Scheduler over the same fixed workload (the
schedules are deterministic, so every rank gets the SchedulerOutput the engine core would send).
After warm-up steps, rank 0 profiles ``--steps`` steps and reports the share of their wall time
spent in the collectives (c10d all-reduce / all-gather, waits included) - on a bigger machine,
the part of a step that more ranks do not shrink.

    python -m benchmarks.tp_comm_profile [--model M] [--tensor-parallel-size 2] [--steps 20]
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import sys
import time

from benchmarks.common import add_model_args, engine_args, log, model_stats, resolve_model

_COLLECTIVES = ("c10d::allreduce_", "c10d::allgather_")


def _rank(rank: int, world_size: int, port: int, model: str, llm_kwargs: dict, steps: int,
          queue) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from pagedllm.config import EngineConfig
    from pagedllm.core.request import Request
    from pagedllm.core.scheduler import Scheduler
    from pagedllm.distributed.launch import DistributedInit
    from pagedllm.distributed.parallel_state import destroy_distributed, init_distributed
    from pagedllm.executor.abstract import build_model_runner
    from pagedllm.sampling_params import SamplingParams

    init_distributed(DistributedInit(rank, world_size, "127.0.0.1", port, llm_kwargs["device"],
                                     local_rank=rank, local_world_size=world_size))
    config = EngineConfig.from_kwargs(model, **llm_kwargs, num_gpu_blocks_override=256,
                                      block_size=16, tensor_parallel_size=world_size)
    runner = build_model_runner(config, 512)
    runner.initialize_kv_cache(256, 16)
    sched = Scheduler(config.scheduler_config, 256, 16, 512, True)
    rng = random.Random(0)
    vocab = runner.vocab_size
    for i in range(8):  # 8 sequences decoding: a small serving batch
        prompt = [rng.randrange(3, vocab) for _ in range(64)]
        sched.add_request(Request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=400,
                                                                  ignore_eos=True),
                                  frozenset(), arrival_time=float(i)))

    def step() -> None:
        so = sched.schedule()
        sched.update_from_output(so, runner.execute_model(so))

    for _ in range(8):  # prefill and warm-up decodes
        step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        wall = time.perf_counter() - t0
    comm_us = sum(e.cpu_time_total for e in prof.key_averages() if e.key in _COLLECTIVES)
    counts = {e.key: e.count for e in prof.key_averages() if e.key in _COLLECTIVES}
    if rank == 0:
        queue.put({"wall_s": wall, "comm_s": comm_us / 1e6, "counts": counts})
    destroy_distributed()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="pagedllm bench tp_comm_profile", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser)
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20, help="decode steps profiled")
    args = parser.parse_args(argv)
    if args.device == "auto":
        args.device = "cpu"
    model = resolve_model(args)
    stats = model_stats(model)
    from pagedllm.distributed.launch import get_open_port

    world = args.tensor_parallel_size
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world)))
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    port = get_open_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, model, engine_args(args), args.steps,
                                             queue)) for r in range(world)]
    for p in procs:
        p.start()
    result = queue.get(timeout=600)
    for p in procs:
        p.join(60)
    share = result["comm_s"] / result["wall_s"]
    log(f"model {model} ({stats.num_params / 1e6:.1f}M params), {world} ranks, 8 sequences")
    print(f"tp_comm_profile: {args.steps} decode steps on rank 0 of {world}: "
          f"{result['wall_s'] / args.steps * 1e3:.2f} ms/step, collectives "
          f"{result['comm_s'] / args.steps * 1e3:.2f} ms/step = {share:.1%} of the step "
          f"({', '.join(f'{k} x{v // args.steps}/step' for k, v in result['counts'].items())})",
          flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])

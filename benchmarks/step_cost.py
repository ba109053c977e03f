"""A decode step's fixed cost, counted: the work one ``LLMEngine.step()`` does on a tiny model.

On the 260K demo model a decode step is almost all fixed cost (Python, torch dispatch, small
allocations), and on a shared machine its wall time is noise, so this script counts the work,
which is deterministic, and also prints wall-clock medians for a quiet machine. Per decode step
(greedy, ignore_eos, the prompt's prefill and a few warm-up steps excluded), for batch 1 and 8,
compiled (``LLM()``'s default) and eager (``enforce_eager=True``):

  py_calls      Python calls, builtins included (cProfile's ncalls summed, over the steps)
  torch_ops     operator dispatches seen by torch.profiler (every ``aten::``/custom op that
                enters the dispatcher, nested ones included: one record_function per call)
  top_ops       the same, outermost only (what the Python code or the graph's wrapper calls)
  allocs        allocations by torch's CPU allocator (torch.profiler's memory events of positive
                size; a tensor's storage, or an op's scratch buffer)
  omp_regions   OpenMP parallel regions opened (with --omp-regions: benchmarks/omp_regions.py)
  step_us       median wall-clock microseconds of an unprofiled step (meaningless under load)

and the same counts per phase of the step: schedule, update (the scheduler's), runner_prep
(the runner minus what follows: InputBatch, ids/positions), metadata (attention metadata),
forward (the model, compiled or eager), sample (logits, sampling metadata, sampler), output
(OutputProcessor: outputs, stop checks), detokenize (its incremental detokenizer and stop
strings, inside output), engine (the rest of the step: the core, stats).

    python -m benchmarks.step_cost [--model DIR] [--batch 1 8] [--steps 200] [--mode compiled eager]
                                   [--json FILE] [--omp-regions]
"""
from __future__ import annotations

import argparse
import bisect
import contextlib
import cProfile
import pstats
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from benchmarks import omp_regions
from benchmarks.common import REPO_ROOT, log, write_json

DEFAULT_MODEL = REPO_ROOT.parent / "shared" / "models" / "stories260K" / "hf"
PHASES = ("schedule", "update", "runner_prep", "metadata", "forward", "sample", "output", "detokenize", "engine")
WARMUP_STEPS = 3
_LABEL = "step_cost::"


class PhaseCounter:
    """Attributes every Python call (sys.setprofile) and every timed interval to the innermost
    phase being run; phases are entered by wrappers around the step's entry points."""

    def __init__(self) -> None:
        self.stack: list[str] = ["engine"]
        self.calls = dict.fromkeys(PHASES, 0)
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.counting = False
        self.label_torch = False
        self._t = 0.0

    def _switch(self) -> None:
        now = time.perf_counter()
        self.seconds[self.stack[-1]] += now - self._t
        self._t = now

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self._switch()
        self.stack.append(name)
        try:
            if self.label_torch:
                import torch

                with torch.profiler.record_function(_LABEL + name):
                    yield
            else:
                yield
        finally:
            self._switch()
            self.stack.pop()

    def start(self) -> None:
        self._t = time.perf_counter()

    def profile_hook(self, frame, event, arg) -> None:  # noqa: ANN001 (sys.setprofile's signature)
        if event == "call" or event == "c_call":
            self.calls[self.stack[-1]] += 1


def _wrap(owner: object, name: str, counter: PhaseCounter, phase: str) -> None:
    """Run ``owner.name`` (a method, or an instance's callable attribute) inside ``phase``."""
    inner = getattr(owner, name)

    def wrapped(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        with counter.phase(phase):
            return inner(*args, **kwargs)

    setattr(owner, name, wrapped)


def instrument(engine, counter: PhaseCounter) -> None:  # noqa: ANN001 (an LLMEngine)
    """Wrap the step's entry points of one in-process engine (instance attributes only)."""
    core = engine.engine_core
    _wrap(core.scheduler, "schedule", counter, "schedule")
    _wrap(core.scheduler, "update_from_output", counter, "update")
    _wrap(engine.output_processor, "process_outputs", counter, "output")
    _wrap(engine.output_processor, "_update_text", counter, "detokenize")
    runner = core.executor.runner  # UniProcExecutor's (the engine core in this process)
    _wrap(runner, "execute_model", counter, "runner_prep")
    _wrap(runner, "_attention_metadata", counter, "metadata")
    _wrap(runner, "_sample", counter, "sample")
    if runner.compiled is not None:
        _wrap(runner, "compiled", counter, "forward")
    else:
        # Eager: nn.Module.__call__ runs self.forward, an instance attribute wins.
        _wrap(runner.model, "forward", counter, "forward")


def _add_requests(engine, batch: int, max_tokens: int, tag: str) -> None:  # noqa: ANN001
    from pagedllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(batch):
        # Distinct short prompts (no prefix sharing), the same for every mode.
        prompt = [1] + [(17 * i + 5 * j) % 500 + 3 for j in range(7)]
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": prompt}, params)


def _count_torch(prof) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:  # noqa: ANN001
    """(ops, outermost ops, allocations) per phase from a torch.profiler run."""
    ops = dict.fromkeys(PHASES, 0)
    top = dict.fromkeys(PHASES, 0)
    for ev in prof.events():
        if ev.name.startswith(_LABEL) or ev.name == "[memory]":
            continue
        phase, outermost, parent = "engine", True, ev.cpu_parent
        while parent is not None:
            if parent.name.startswith(_LABEL):
                phase = parent.name[len(_LABEL):]
                break
            outermost = False
            parent = parent.cpu_parent
        ops[phase] += 1
        top[phase] += outermost
    # Allocations are the raw memory events (a positive size), placed in the innermost phase
    # whose interval holds them.
    allocs = dict.fromkeys(PHASES, 0)
    raw = prof.profiler.kineto_results.events()
    labels = sorted((e.start_ns(), e.end_ns(), e.name()[len(_LABEL):]) for e in raw
                    if e.name().startswith(_LABEL))
    starts = [lab[0] for lab in labels]
    for e in raw:
        if e.name() != "[memory]" or e.nbytes() <= 0:
            continue
        t, phase = e.start_ns(), "engine"
        for k in range(bisect.bisect_right(starts, t) - 1, -1, -1):
            if labels[k][1] >= t:  # the latest-starting label that still holds t is the innermost
                phase = labels[k][2]
                break
        allocs[phase] += 1
    return ops, top, allocs


def measure(model: str, mode: str, batch: int, steps: int) -> dict:
    import torch

    from pagedllm import LLM

    llm = LLM(model, enforce_eager=(mode == "eager"), seed=0, max_num_seqs=max(batch, 8))
    engine = llm.llm_engine
    counter = PhaseCounter()
    instrument(engine, counter)
    total = WARMUP_STEPS + 1 + 3 * steps + 8

    def run_steps(n: int) -> list[float]:
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
        return times

    _add_requests(engine, batch, total, "r")
    run_steps(1 + WARMUP_STEPS)  # the prefill, then warm-up decodes
    # 1. Wall clock, unprofiled (the wrappers' own cost stays in, small against a step).
    counter.start()
    seconds_before = dict(counter.seconds)
    omp_before = omp_regions.regions()
    wall = run_steps(steps)
    omp_after = omp_regions.regions()
    phase_us = {p: (counter.seconds[p] - seconds_before[p]) / steps * 1e6 for p in PHASES}
    # 2. Python calls, per phase (sys.setprofile) and in total (cProfile).
    sys.setprofile(counter.profile_hook)
    try:
        run_steps(steps)
    finally:
        sys.setprofile(None)
    profiler = cProfile.Profile()
    profiler.enable()
    run_steps(steps)
    profiler.disable()
    stats = pstats.Stats(profiler)
    py_calls = sum(nc for (_, nc, _, _, _) in stats.stats.values())
    top_funcs = sorted(((nc, f"{Path(f).name}:{line}({fn})") for (f, line, fn), (_, nc, _, _, _)
                        in stats.stats.items()), reverse=True)[:15]
    # 3. torch operators and allocations, per phase.
    counter.label_torch = True
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True) as prof:
        run_steps(steps)
    counter.label_torch = False
    ops, top, allocs = _count_torch(prof)
    op_names: dict[str, int] = {}
    for ev in prof.events():
        if ev.name != "[memory]" and not ev.name.startswith(_LABEL):
            op_names[ev.name] = op_names.get(ev.name, 0) + 1
    per_phase = {p: {"py_calls": counter.calls[p] / steps, "torch_ops": ops[p] / steps,
                     "top_ops": top[p] / steps, "allocs": allocs[p] / steps,
                     "wall_us": phase_us[p]} for p in PHASES}
    result = {
        "mode": mode, "batch": batch, "steps": steps, "threads": torch.get_num_threads(),
        "py_calls": py_calls / steps,
        "torch_ops": sum(ops.values()) / steps, "top_ops": sum(top.values()) / steps,
        "allocs": sum(allocs.values()) / steps,
        "omp_regions": None if omp_before is None else (omp_after - omp_before) / steps,
        "step_us": statistics.median(wall) * 1e6,
        "phases": per_phase,
        "top_functions": [(nc / steps, name) for nc, name in top_funcs],
        "top_torch_ops": sorted(((n / steps, name) for name, n in op_names.items()), reverse=True)[:15],
    }
    llm.llm_engine.shutdown()
    return result


def count_metadata(batch: int, steps: int = 50) -> dict:
    """The attention metadata of a decode step alone, built ``steps`` times under the profiler
    on this thread: operators and allocations per build (a check of the engine-level counts,
    which torch.profiler may under-report inside a step)."""
    import torch

    import pagedllm.layers.attention_metadata as amd
    from pagedllm.layers.attention import get_attn_backend

    backend = get_attn_backend("cpu_paged", "cpu")
    kwargs = {"buffers": amd.StagingBuffers()} if hasattr(amd, "StagingBuffers") else {}
    tables = [[4 * i + j for j in range(4)] for i in range(batch)]
    with torch.inference_mode(), torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        for step in range(steps):
            amd.build_attention_metadata([1] * batch, [10 + step] * batch, tables, 16, "cpu",
                                         backend, **kwargs)
    raw = prof.profiler.kineto_results.events()
    allocs = sum(1 for e in raw if e.name() == "[memory]" and e.nbytes() > 0)
    ops = sum(1 for e in prof.events() if e.name != "[memory]")
    return {"batch": batch, "torch_ops": ops / steps, "allocs": allocs / steps}


def print_result(r: dict) -> None:
    omp = "?" if r.get("omp_regions") is None else f"{r['omp_regions']:.0f}"
    print(f"\n== {r['mode']} batch {r['batch']} ({r['steps']} decode steps, {r['threads']} threads): "
          f"{r['py_calls']:.0f} py calls, {r['torch_ops']:.0f} torch ops ({r['top_ops']:.0f} "
          f"outermost), {r['allocs']:.0f} allocations, {omp} OpenMP regions, median {r['step_us']:.0f} us a step")
    print(f"   {'phase':<12}{'py calls':>10}{'torch ops':>11}{'outermost':>11}{'allocs':>8}{'wall us':>9}")
    for p, v in r["phases"].items():
        print(f"   {p:<12}{v['py_calls']:>10.0f}{v['torch_ops']:>11.1f}{v['top_ops']:>11.1f}"
              f"{v['allocs']:>8.1f}{v['wall_us']:>9.0f}")
    print("   most called (per step): " + ", ".join(f"{name} {n:.0f}" for n, name in r["top_functions"][:8]))
    print("   torch ops (per step): " + ", ".join(f"{name} {n:.0f}" for n, name in r["top_torch_ops"][:10]))


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--mode", nargs="+", default=["compiled", "eager"], choices=["compiled", "eager"])
    parser.add_argument("--json", default=None)
    parser.add_argument("--metadata-only", action="store_true",
                        help="only the attention metadata's own counts (no engine, seconds)")
    parser.add_argument("--omp-regions", action="store_true",
                        help="also count OpenMP parallel regions a step (reruns itself with a preloaded counter)")
    args = parser.parse_args(argv)
    if args.omp_regions and not omp_regions.active():
        sys.exit(omp_regions.with_counter(["-m", "benchmarks.step_cost",
                                           *[a for a in (sys.argv[1:] if argv is None else argv)]]))
    results = []
    for mode in ([] if args.metadata_only else args.mode):
        for batch in args.batch:
            log(f"step_cost: {mode} batch {batch}")
            r = measure(args.model, mode, batch, args.steps)
            print_result(r)
            results.append(r)
    metadata = [count_metadata(batch) for batch in args.batch]
    for m in metadata:
        print(f"\n== attention metadata alone, batch {m['batch']}: {m['torch_ops']:.0f} torch ops, "
              f"{m['allocs']:.0f} allocations a build")
    write_json(args.json, {"results": results, "metadata": metadata})
    return results


if __name__ == "__main__":
    main()

"""A decode step's instructions, per phase, counted by callgrind: what ``benchmarks.step_cost``'s
wall times cannot show on a shared machine.

The script re-runs itself under ``valgrind --tool=callgrind`` with instrumentation off until the
prefill and a few warm-up decodes are done, then counts ``--steps`` decode steps of
``LLMEngine.step()`` (the demo model, ``LLM()``'s defaults: compiled, greedy, ignore_eos). Each
phase boundary of step_cost's ``PhaseCounter`` (schedule, update, runner_prep, metadata,
forward, sample, output, detokenize, engine) dumps callgrind's counters, labelled with the phase
that ran since the last dump, so the dumps summed by label give instructions per phase. Counted:
the thread that runs the step (``LLM`` runs it on the caller's), not an OpenMP worker's, whose
spinning between regions would land in whichever phase is open. The dumps' files (one per dump
and thread) stay in ``--out`` for ``callgrind_annotate`` (which C functions each phase runs).

    python -m benchmarks.step_instructions [--model DIR] [--batch 1] [--steps 10] [--eager]
                                           [--out DIR] [--json FILE]

Needs valgrind and its headers (valgrind/callgrind.h) and a C compiler. Valgrind runs threads one
at a time and ~50x slower: counts, not times.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import log, shared_c_library, write_json
from benchmarks.step_cost import DEFAULT_MODEL, PHASES, WARMUP_STEPS, PhaseCounter, _add_requests, instrument

_SOURCE = r"""
#include <valgrind/callgrind.h>
void step_start(void) { CALLGRIND_ZERO_STATS; CALLGRIND_START_INSTRUMENTATION; }
void step_stop(void) { CALLGRIND_STOP_INSTRUMENTATION; }
void step_dump(const char *label) { CALLGRIND_DUMP_STATS_AT(label); }
"""
_ENV = "PAGEDLLM_STEP_INSTRUCTIONS"


def _client_lib() -> Path:
    return shared_c_library("step_requests", _SOURCE, opt="-O1")


class DumpingCounter(PhaseCounter):
    """step_cost's phases; each switch dumps the counts of the phase that was running."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        super().__init__()
        self._lib = lib
        self.dumping = False

    def _switch(self) -> None:
        if self.dumping:
            self._lib.step_dump(self.stack[-1].encode())


def _child(args: argparse.Namespace) -> None:
    """Inside valgrind: warm up uninstrumented, then count ``args.steps`` decode steps."""
    from pagedllm import LLM

    lib = ctypes.CDLL(str(_client_lib()))
    llm = LLM(args.model, enforce_eager=args.eager, seed=0, max_num_seqs=max(args.batch, 8))
    engine = llm.llm_engine
    counter = DumpingCounter(lib)
    instrument(engine, counter)
    _add_requests(engine, args.batch, 1 + WARMUP_STEPS + args.steps + 8, "r")
    for _ in range(1 + WARMUP_STEPS):
        engine.step()
    lib.step_start()
    counter.dumping = True
    for _ in range(args.steps):
        engine.step()
    lib.step_dump(b"engine")
    counter.dumping = False
    lib.step_stop()
    engine.shutdown()


def summarize(out: Path, prefix: str, steps: int) -> dict:
    """Instructions per step, per phase label, from the main thread's dump files (``-01``)."""
    per_phase = dict.fromkeys(PHASES, 0)
    for path in out.glob(prefix + ".*-01"):
        text = path.read_text(errors="replace")
        label = re.search(r"^desc: Trigger: Client Request: (\S+)", text, re.M)
        total = re.search(r"^(?:summary|totals): (\d+)", text, re.M)
        if label and total and label.group(1) in per_phase:
            per_phase[label.group(1)] += int(total.group(1))
    return {"steps": steps, "instructions": sum(per_phase.values()) / steps,
            "phases": {p: n / steps for p, n in per_phase.items()}}


def main(argv: list[str] | None = None) -> dict | None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--eager", action="store_true", help="enforce_eager=True (default: compiled)")
    parser.add_argument("--out", default=None, help="folder for callgrind's dump files (default: a temporary one)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if os.environ.get(_ENV) == "1":
        _child(args)
        return None
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed (apt-get install valgrind)")
    _client_lib()
    out = Path(args.out or tempfile.mkdtemp(prefix="pagedllm-step-instructions-"))
    out.mkdir(parents=True, exist_ok=True)
    prefix = "callgrind.step"
    for old in out.glob(prefix + ".*"):
        old.unlink()
    log(f"step_instructions: {args.steps} decode steps under callgrind (minutes); dumps in {out}")
    cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--compress-strings=no",
           "--separate-threads=yes",
           f"--callgrind-out-file={out / prefix}.%p",
           sys.executable, "-m", "benchmarks.step_instructions", *(sys.argv[1:] if argv is None else argv)]
    subprocess.run(cmd, env=dict(os.environ, **{_ENV: "1"}), check=True, stderr=subprocess.DEVNULL)
    result = summarize(out, prefix, args.steps)
    result.update(mode="eager" if args.eager else "compiled", batch=args.batch)
    print(f"== {result['mode']} batch {args.batch}: {result['instructions'] / 1e3:.0f}K instructions a decode step")
    for p, n in result["phases"].items():
        print(f"   {p:<12}{n / 1e3:>9.1f}K")
    write_json(args.json, result)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()

"""The live dashboard's cost: serving throughput with a viewer on /v1/trace/stream vs none.

One server (``pagedllm serve``, its engine core in its own process, as a user runs it) serves the
same load (the throughput workload, all requests at once, streamed) in interleaved rounds: closed,
open, open, closed, ... With the dashboard "open", a client reads the server-sent-events stream
the page reads, for the whole round, and counts the step records it gets (so the feed is proven
to run). Prints the median output tokens/s of each and open / closed (target: >= 0.97).

    python -m benchmarks.dashboard_overhead [--workload cpu] [--rounds 6] [--model DIR]
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
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
from benchmarks.latency import run_load, subprocess_server

# The viewer runs in its own process, as a browser would: a reader in the benchmark's process
# would take the load client's GIL and slow the client, not the server.
_READER = """
import os, sys, httpx
url, out = sys.argv[1], sys.argv[2]
steps = 0
with httpx.Client(timeout=None, trust_env=False) as client, client.stream("GET", url) as resp:
    resp.raise_for_status()
    for line in resp.iter_lines():
        if line.startswith("event: "):
            steps += line == "event: step"
            with open(out + ".new", "w") as f:
                f.write(str(steps))
            os.replace(out + ".new", out)  # the benchmark never reads half a count
"""


class Viewer:
    """A dashboard's stream reader in a subprocess: connects, counts step records until stopped."""

    def __init__(self, base_url: str) -> None:
        self.url = f"{base_url}/v1/trace/stream"
        self.num_steps = 0
        self._out = tempfile.NamedTemporaryFile("r", suffix=".count")
        self._proc: subprocess.Popen | None = None

    def __enter__(self) -> "Viewer":
        self._proc = subprocess.Popen([sys.executable, "-c", _READER, self.url, self._out.name])
        deadline = time.monotonic() + 30
        while not Path(self._out.name).read_text():  # the hello event arrived
            if self._proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the trace stream did not answer")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._proc is not None
        self._proc.terminate()
        self._proc.wait(30)
        self.num_steps = int(Path(self._out.name).read_text() or 0)
        self._out.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.dashboard_overhead", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser)
    add_workload_args(parser)
    parser.add_argument("--rounds", type=int, default=6, help="rounds of each (interleaved)")
    parser.add_argument("--server-timeout", type=float, default=300.0)
    args = parser.parse_args(argv)

    model = resolve_model(args)
    workload = resolve_workload(args, model)
    runs: dict[str, list[float]] = {"closed": [], "open": []}
    records: list[int] = []
    with subprocess_server(model, engine_args(args), args.server_timeout) as url:
        def load() -> float:
            r = asyncio.run(run_load(url, workload.prompts, workload.output_lens, float("inf"), None))
            if r["failed"]:
                raise RuntimeError(f"{r['failed']} requests failed, e.g. {r['errors'][0]}")
            return r["output_throughput"]

        load()  # warm-up round, not counted
        for i in range(args.rounds):
            order = ("closed", "open") if i % 2 == 0 else ("open", "closed")
            for mode in order:
                if mode == "open":
                    with Viewer(url) as viewer:
                        runs[mode].append(load())
                    records.append(viewer.num_steps)
                else:
                    runs[mode].append(load())
                log(f"round {i + 1} {mode}: {runs[mode][-1]:.1f} out tok/s")
    closed, opened = statistics.median(runs["closed"]), statistics.median(runs["open"])
    ratios = [o / c for o, c in zip(runs["open"], runs["closed"])]
    result = {"benchmark": "dashboard_overhead", "model": model, "workload": workload.name,
              "rounds": args.rounds, "closed_tok_s": runs["closed"], "open_tok_s": runs["open"],
              "step_records_per_round": records, "ratio_median": statistics.median(ratios)}
    print(f"dashboard_overhead {workload.name} ({args.rounds} rounds each, interleaved): closed "
          f"{closed:.1f} out tok/s, open {opened:.1f} out tok/s; open/closed {statistics.median(ratios):.3f} "
          f"(median of per-round ratios; step records per open round: {records})", flush=True)
    write_json(args.json, result)


if __name__ == "__main__":
    main()

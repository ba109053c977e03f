"""The ``pagedllm explain`` and ``pagedllm trace`` subcommands (argparse only at import time:
building the CLI's parser must stay cheap; the work is imported when the command runs).

    pagedllm explain SCENARIO [--width N]        replay a shipped scenario step by step
    pagedllm explain --from-trace FILE           render a saved step trace the same way
    pagedllm explain --list                      the shipped scenarios
    pagedllm trace convert FILE --chrome OUT     Chrome trace-event JSON (Perfetto)
"""
from __future__ import annotations

import argparse
import sys
from typing import Any

from pagedllm.errors import PagedLLMError


def add_explain_parser(sub: Any) -> None:
    p = sub.add_parser("explain", help="replay a scheduling scenario step by step (no model needed)",
                       description="Replay a small scenario on the real Scheduler and the FakeRunner "
                                   "and show each step: queues, budget, block tables, what happened "
                                   "and why. Or render a saved step trace (--from-trace).")
    p.add_argument("scenario", nargs="?", metavar="SCENARIO",
                   help="lesson-exercise, chunked-prefill, prefix-cache, preemption, "
                        "parallel-sampling, skip-ahead")
    p.add_argument("--from-trace", metavar="FILE", default=None, help="a --trace-file to render")
    p.add_argument("--list", action="store_true", help="list the scenarios and exit")
    p.add_argument("--width", type=int, default=None, help="terminal width (default: the terminal's)")
    p.add_argument("--max-steps", type=int, default=200, help="most steps of a trace to show")
    p.set_defaults(func=cmd_explain)


def cmd_explain(args: argparse.Namespace) -> int:
    from pagedllm.explain.render import make_console, render_trace
    from pagedllm.explain.scenarios import SCENARIOS, run_scenario

    if args.list:
        for name, scenario in SCENARIOS.items():
            print(f"{name:18} {scenario.title}")
        return 0
    console = make_console(width=args.width, file=sys.stdout)
    if args.from_trace:
        from pagedllm.engine.step_trace import read_trace

        header, steps = read_trace(args.from_trace)
        render_trace(console, header, steps[:args.max_steps], title=args.from_trace)
        return 0
    if args.scenario not in SCENARIOS:
        raise PagedLLMError(f"unknown scenario {args.scenario!r}; one of: {', '.join(SCENARIOS)}")
    run_scenario(args.scenario, console)
    return 0


def add_trace_parser(sub: Any) -> None:
    p = sub.add_parser("trace", help="work with step traces (--trace-file)",
                       description="Convert a step trace (docs/trace_schema.md).")
    tsub = p.add_subparsers(dest="trace_command", required=True, metavar="ACTION")
    c = tsub.add_parser("convert", help="convert a trace for Perfetto / chrome://tracing")
    c.add_argument("file", metavar="FILE", help="a trace written with --trace-file")
    c.add_argument("--chrome", metavar="OUT", required=True, help="write Chrome trace-event JSON here")
    c.set_defaults(func=cmd_trace_convert)


def cmd_trace_convert(args: argparse.Namespace) -> int:
    from pagedllm.engine.step_trace import read_trace
    from pagedllm.explain.chrome_trace import write_chrome

    try:
        _, steps = read_trace(args.file)
    except OSError as e:
        raise PagedLLMError(f"cannot read {args.file}: {e}") from e
    num = write_chrome(steps, args.chrome)
    print(f"{args.chrome}: {num} events from {len(steps)} steps (open it in https://ui.perfetto.dev)")
    return 0

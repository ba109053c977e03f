"""Issue 59's targets for several models behind one server, each measured beside its peer in one run.

- **Model switch against a cold start.** Two ids of the same folder behind the router with a memory
  budget that holds one, so a request to the other unloads one and loads the other (the files are in
  the page cache). Its time to the answer is set against a single-model cold start: a fresh router
  over one model answering its first request (process start and imports excluded, which only makes
  the peer faster). Rounds interleave the two. Target: switch / cold <= 1.5.
- **RSS over load/unload cycles.** One model loaded by a request and unloaded, again and again, the
  engine in this process so its memory counts; the resident set after each unload. Target: the last
  cycle's within 5% of the first's.
- **Route overhead.** One loaded engine; the same prompt as chat completions straight to the model's
  own app (the peer), chat completions through the router, and the Messages and Responses routes
  through the router, interleaved; the median of each. Target: each adds <= 1 ms.

Requests go through the ASGI apps in this process (no sockets: the HTTP server is the same for
every route). The engine runs in this process unless --multiprocess.

    python -m benchmarks.front_door [--model DIR] [--rounds 5] [--cycles 100] [--requests 200]
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import sys
import time
from pathlib import Path

from benchmarks.common import add_model_args, engine_args, log, resolve_model, rss_bytes, write_json

PROMPT = "Once upon a time"
# For a model whose tokenizer has no chat template (the benchmarks' random models).
_PLAIN_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                   "{% if add_generation_prompt %}assistant:{% endif %}")
MiB = 1 << 20


def chat_template_for(model: str) -> str | None:
    """The demo's template, the tokenizer's own (None), or a plain one when it has none."""
    from pagedllm.engine.llm import default_chat_template

    demo = default_chat_template(model)
    if demo is not None:
        return demo
    folder = Path(model)
    config = folder / "tokenizer_config.json"
    own = (folder / "chat_template.jinja").is_file() or (
        config.is_file() and "chat_template" in json.loads(config.read_text()))
    return None if own else _PLAIN_TEMPLATE


class Bench:
    """Builds routers over ``model`` and sends them requests."""

    def __init__(self, model: str, kwargs: dict, max_tokens: int, multiprocess: bool) -> None:
        self.model = model
        self.kwargs = kwargs
        self.max_tokens = max_tokens
        self.multiprocess = multiprocess
        self.template = chat_template_for(model)

    def router(self, ids: list[str], memory_budget: int | None = None):
        from pagedllm.entrypoints.openai.model_router import build_router_app
        from pagedllm.entrypoints.openai.model_specs import ModelSpec

        # Each model counts 1 against the budget, so a budget of 1 holds exactly one.
        specs = [ModelSpec(i, self.model, dict(self.kwargs), keep_alive_s=None, chat_template=self.template,
                           memory_bytes=1) for i in ids]
        return build_router_app(specs, memory_budget=memory_budget, multiprocess=self.multiprocess)

    def bodies(self, model_id: str) -> dict[str, tuple[str, dict]]:
        """route -> (path, body): the same prompt, greedy, the same output length."""
        n = self.max_tokens
        user = [{"role": "user", "content": PROMPT}]
        return {
            "chat": ("/v1/chat/completions", {"model": model_id, "messages": user, "max_tokens": n,
                                              "temperature": 0}),
            "messages": ("/v1/messages", {"model": model_id, "messages": user, "max_tokens": n,
                                          "temperature": 0}),
            "responses": ("/v1/responses", {"model": model_id, "input": PROMPT, "max_output_tokens": n,
                                            "temperature": 0, "store": False}),
        }

    async def post(self, app, route: str, model_id: str) -> tuple[float, int]:
        """Seconds to the whole answer, and the output tokens it reports."""
        import httpx

        path, body = self.bodies(model_id)[route]
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://bench") as client:
            t0 = time.perf_counter()
            resp = await client.post(path, json=body, timeout=None)
            elapsed = time.perf_counter() - t0
        if resp.status_code != 200:
            raise RuntimeError(f"{route} answered {resp.status_code}: {resp.text}")
        usage = resp.json()["usage"]
        return elapsed, usage.get("completion_tokens", usage.get("output_tokens", -1))


async def measure_switch(bench: Bench, rounds: int) -> dict:
    switcher = bench.router(["a", "b"], memory_budget=1)
    pool = switcher.state.pool
    try:
        await bench.post(switcher, "chat", "a")  # warm-up: loads a; the files enter the page cache
        cold_s, switch_s = [], []
        for i in range(rounds):
            target = "b" if i % 2 == 0 else "a"
            for kind in (("cold", "switch") if i % 2 == 0 else ("switch", "cold")):
                if kind == "switch":
                    switch_s.append((await bench.post(switcher, "chat", target))[0])
                    states = {m.spec.id: m.state for m in pool.models.values()}
                    if list(states.values()).count("loaded") != 1:
                        raise RuntimeError(f"the budget should hold one model: {states}")
                else:
                    solo = bench.router(["solo"])
                    try:
                        cold_s.append((await bench.post(solo, "chat", "solo"))[0])
                    finally:
                        await solo.state.pool.shutdown()
            log(f"round {i + 1}/{rounds}: cold start {cold_s[-1]:.3f} s, switch {switch_s[-1]:.3f} s")
        num_switches = sum(m.num_unloads for m in pool.models.values())  # before shutdown unloads the last
    finally:
        await pool.shutdown()
    return {"cold_s": cold_s, "switch_s": switch_s, "num_switches": num_switches}


async def measure_cycles(bench: Bench, cycles: int) -> dict:
    app = bench.router(["a"])
    pool = app.state.pool
    rss, load_s, unload_s = [], [], []
    try:
        for i in range(cycles):
            load_s.append((await bench.post(app, "chat", "a"))[0])
            t0 = time.perf_counter()
            await pool.unload("a")
            unload_s.append(time.perf_counter() - t0)
            gc.collect()
            rss.append(rss_bytes("VmRSS"))
            if i == 0 or (i + 1) % 10 == 0:
                log(f"cycle {i + 1}/{cycles}: RSS {rss[-1] / MiB:.1f} MiB")
    finally:
        await pool.shutdown()
    served = pool.models["a"]
    return {"rss_bytes": rss, "load_s": load_s, "unload_s": unload_s, "num_loads": served.num_loads,
            "num_unloads": served.num_unloads}


async def measure_routes(bench: Bench, num_requests: int) -> dict:
    app = bench.router(["a"])
    pool = app.state.pool
    try:
        await bench.post(app, "chat", "a")  # loads the model
        direct = pool.models["a"].loaded.app  # the same engine, without the router in front
        targets = {"chat_direct": (direct, "chat"), "chat": (app, "chat"), "messages": (app, "messages"),
                   "responses": (app, "responses")}
        for target, route in targets.values():  # one warm-up each
            await bench.post(target, route, "a")
        times: dict[str, list[float]] = {name: [] for name in targets}
        tokens: dict[str, set[int]] = {name: set() for name in targets}
        for i in range(num_requests):
            names = list(targets) if i % 2 == 0 else list(targets)[::-1]
            for name in names:
                elapsed, n = await bench.post(*targets[name], "a")
                times[name].append(elapsed)
                tokens[name].add(n)
    finally:
        await pool.shutdown()
    return {"times_s": times, "output_tokens": {k: sorted(v) for k, v in tokens.items()}}


async def run(args: argparse.Namespace, model: str) -> dict:
    bench = Bench(model, engine_args(args), args.max_tokens, args.multiprocess)
    return {"switch": await measure_switch(bench, args.rounds),
            "cycles": await measure_cycles(bench, args.cycles),
            "routes": await measure_routes(bench, args.requests)}


def report(result: dict, args: argparse.Namespace) -> None:
    sw = result["switch"]
    cold, switch = statistics.median(sw["cold_s"]), statistics.median(sw["switch_s"])
    print(f"front_door switch (medians of {args.rounds} rounds): single-model cold start {cold:.3f} s, "
          f"model switch {switch:.3f} s; switch/cold {switch / cold:.3f} (target <= 1.5)", flush=True)
    cy = result["cycles"]
    first, last, peak = cy["rss_bytes"][0], cy["rss_bytes"][-1], max(cy["rss_bytes"])
    print(f"front_door cycles: {cy['num_unloads']} load/unload cycles completed; RSS after the first "
          f"{first / MiB:.1f} MiB, after the last {last / MiB:.1f} MiB, largest {peak / MiB:.1f} MiB; "
          f"last/first {last / first:.3f} (target <= 1.05); a cycle's median load and answer "
          f"{statistics.median(cy['load_s']):.3f} s, unload {statistics.median(cy['unload_s']):.3f} s", flush=True)
    med = {k: statistics.median(v) * 1e3 for k, v in result["routes"]["times_s"].items()}
    tokens = result["routes"]["output_tokens"]
    print(f"front_door routes (medians of {args.requests} requests each, output tokens {tokens['chat']}): "
          f"chat direct {med['chat_direct']:.3f} ms, chat via the router {med['chat']:.3f} ms "
          f"({med['chat'] - med['chat_direct']:+.3f} ms), messages {med['messages']:.3f} ms "
          f"({med['messages'] - med['chat']:+.3f} ms over chat), responses {med['responses']:.3f} ms "
          f"({med['responses'] - med['chat']:+.3f} ms over chat) (target <= 1 ms each)", flush=True)
    if any(v != tokens["chat"] for v in tokens.values()):
        log(f"warning: the routes generated different output lengths {tokens}: their times do not compare")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.front_door", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser)
    parser.add_argument("--rounds", type=int, default=5, help="cold starts and switches, interleaved")
    parser.add_argument("--cycles", type=int, default=100, help="load/unload cycles for the RSS check")
    parser.add_argument("--requests", type=int, default=200, help="requests per route")
    parser.add_argument("--max-tokens", type=int, default=4, help="output tokens per request")
    parser.add_argument("--multiprocess", action="store_true",
                        help="each engine core in its own process, as `pagedllm serve` runs it (RSS then "
                             "counts the router's process only)")
    args = parser.parse_args(argv)
    for name in ("rounds", "cycles", "requests", "max_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    model = resolve_model(args)
    result = asyncio.run(run(args, model))
    report(result, args)
    write_json(args.json, {"benchmark": "front_door", "model": model, **result})


if __name__ == "__main__":
    main(sys.argv[1:])

"""Online serving latency, like ``vllm bench serve``: requests arrive at a given rate (Poisson,
random.Random(1)) at pagedllm's OpenAI server and stream their completions.

The workload is the throughput one (default "cpu": 32 requests, prompts 32..256 token ids, outputs
64..256 tokens, greedy, ignore_eos). Measured on the client over 127.0.0.1:
  TTFT  time to first token: request sent -> first streamed chunk
  ITL   inter-token latency: the gaps between later chunks
  TPOT  time per output token after the first: (latency - TTFT) / (output tokens - 1)
and requests/s and output tokens/s over the whole run (first send -> last finish), against the
offered rate. One warm-up request goes first.

The server: by default a subprocess ``python -m pagedllm.entrypoints.cli serve MODEL``, so the
client does not share an interpreter with it; ``--server inprocess`` runs it in a thread of this
process (faster start, used by the smoke test); ``--base-url`` uses a server already running.

``--compare single,core-async`` starts one server per serving mode and sends them the same load
in --rounds interleaved rounds (the order alternating round by round, one server loaded at a time),
then prints each mode's medians and its ratios to the first mode:
  single      the engine core in the API server's process (PAGEDLLM_ENABLE_MULTIPROCESSING=0)
  core        the engine core in its own process (what ``pagedllm serve`` does by default)
  core-async  the engine core in its own process with --async-scheduling

``--data-parallel-size 1,2`` serves the same load once per size (a fresh server each, replicas
behind one API server) and prints the ratio of each to the first.

    python -m benchmarks.latency [--request-rate 4] [--workload cpu] [--base-url URL]
                                 [--data-parallel-size 1,2]
    python -m benchmarks.latency --compare single,core-async --rounds 3
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import ExitStack, contextmanager
from typing import Iterator

from benchmarks.common import (
    add_model_args,
    add_workload_args,
    engine_args,
    log,
    percentile,
    resolve_model,
    resolve_workload,
    write_json,
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(base_url: str, timeout: float, alive=lambda: True) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive():
            raise RuntimeError("the server exited before it was ready")
        try:
            if httpx.get(base_url + "/health", timeout=2.0, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"the server at {base_url} was not ready after {timeout:.0f} s")


def _cli_flags(kwargs: dict) -> list[str]:
    flags = []
    for key, value in kwargs.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + key.replace("_", "-"))
        else:
            flags += [flag, str(value)]
    return flags


# --compare: each serving mode's engine-argument overrides and whether the core has its own process.
SERVING_MODES = {
    "single": ({}, False),
    "core": ({}, True),
    "core-async": ({"async_scheduling": True}, True),
}


@contextmanager
def subprocess_server(model: str, llm_kwargs: dict, timeout: float,
                      multiprocess: bool = True) -> Iterator[str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", model, "--host", "127.0.0.1",
           "--port", str(port), "--log-level", "warning"] + _cli_flags(llm_kwargs)
    log("starting the server: " + " ".join(cmd))
    with tempfile.TemporaryFile("w+") as out:
        env = dict(os.environ, PAGEDLLM_ENABLE_MULTIPROCESSING="1" if multiprocess else "0")
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            _wait_ready(f"http://127.0.0.1:{port}", timeout, alive=lambda: proc.poll() is None)
            yield f"http://127.0.0.1:{port}"
        except BaseException:
            out.seek(0)
            log("server output (tail):\n" + out.read()[-4000:])
            raise
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@contextmanager
def inprocess_server(model: str, llm_kwargs: dict, timeout: float,
                     multiprocess: bool = False) -> Iterator[str]:
    import uvicorn

    from pagedllm.engine.async_engine import AsyncLLM
    from pagedllm.entrypoints.openai.server import build_app

    port = _free_port()
    app = build_app(AsyncLLM.from_engine_args(model, multiprocess=multiprocess, **llm_kwargs), [model])
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="pagedllm-server", daemon=True)
    thread.start()
    try:
        _wait_ready(f"http://127.0.0.1:{port}", timeout, alive=thread.is_alive)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


async def _send(client, model_name: str, prompt: list[int], max_tokens: int) -> dict:
    payload = {"model": model_name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
               "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, last, itl, chunks, usage = None, t0, [], 0, None
    async with client.stream("POST", "/v1/completions", json=payload) as resp:
        if resp.status_code != 200:
            body = (await resp.aread()).decode(errors="replace")
            return {"ok": False, "error": f"HTTP {resp.status_code}: {body[:200]}"}
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            now = time.perf_counter()
            if chunk.get("usage"):
                usage = chunk["usage"].get("completion_tokens")
            if chunk.get("choices"):
                if ttft is None:
                    ttft = now - t0
                else:
                    itl.append(now - last)
                last = now
                chunks += 1
    if ttft is None:
        return {"ok": False, "error": "no token streamed"}
    num_tokens = usage if usage is not None else chunks
    latency = last - t0
    return {"ok": True, "ttft": ttft, "itl": itl, "latency": latency, "output_tokens": num_tokens,
            "tpot": (latency - ttft) / (num_tokens - 1) if num_tokens > 1 else None, "end": last}


async def run_load(base_url: str, prompts: list[list[int]], output_lens: list[int], rate: float,
                   max_concurrency: int | None, seed: int = 1) -> dict:
    import httpx

    rng = random.Random(seed)
    offsets, t = [], 0.0
    for _ in prompts:
        offsets.append(t)
        if not math.isinf(rate):
            t += rng.expovariate(rate)
    limits = httpx.Limits(max_connections=max_concurrency or len(prompts) + 1)
    async with httpx.AsyncClient(base_url=base_url, timeout=None, trust_env=False,
                                 limits=limits) as client:
        model_name = (await client.get("/v1/models")).json()["data"][0]["id"]
        await _send(client, model_name, prompts[0][:16], 4)  # warm-up
        gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None

        async def one(i: int, start: float) -> dict:
            await asyncio.sleep(max(start + offsets[i] - time.perf_counter(), 0.0))
            if gate is None:
                return await _send(client, model_name, prompts[i], output_lens[i])
            async with gate:
                return await _send(client, model_name, prompts[i], output_lens[i])

        start = time.perf_counter()
        results = await asyncio.gather(*(one(i, start) for i in range(len(prompts))))
    ok = [r for r in results if r["ok"]]
    duration = (max(r["end"] for r in ok) - start) if ok else float("nan")
    ms = 1000.0

    def stats(values: list[float]) -> dict:
        return {"mean_ms": sum(values) / len(values) * ms if values else float("nan"),
                "p50_ms": percentile(values, 50) * ms, "p99_ms": percentile(values, 99) * ms}

    num_out = sum(r["output_tokens"] for r in ok)
    return {"completed": len(ok), "failed": len(results) - len(ok),
            "errors": [r["error"] for r in results if not r["ok"]][:5], "duration_s": duration,
            "request_throughput": len(ok) / duration, "output_throughput": num_out / duration,
            "total_output_tokens": num_out, "ttft": stats([r["ttft"] for r in ok]),
            "itl": stats([x for r in ok for x in r["itl"]]),
            "tpot": stats([r["tpot"] for r in ok if r["tpot"] is not None]),
            "e2el": stats([r["latency"] for r in ok])}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="pagedllm bench latency", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser)
    add_workload_args(parser)
    parser.add_argument("--request-rate", type=float, default=4.0,
                        help="mean requests per second (Poisson); inf sends all at once")
    parser.add_argument("--max-concurrency", type=int, help="most requests in flight at once")
    parser.add_argument("--server", default="subprocess", choices=["subprocess", "inprocess"])
    parser.add_argument("--base-url", help="use this running server (http://127.0.0.1:PORT)")
    parser.add_argument("--server-timeout", type=float, default=300.0, help="seconds to wait for it")
    parser.add_argument("--data-parallel-size", type=_sizes, default=None, metavar="N[,N...]",
                        help="replicas behind the server; several sizes: one run each, compared")
    parser.add_argument("--compare", type=_modes, default=None, metavar="MODE[,MODE...]",
                        help="serving modes, one server each, loaded in interleaved rounds: "
                             + ", ".join(SERVING_MODES))
    parser.add_argument("--rounds", type=int, default=1, help="with --compare: rounds per mode")
    args = parser.parse_args(argv)
    if args.compare and (args.base_url or args.data_parallel_size):
        raise SystemExit("--compare starts its own servers, one per mode: drop --base-url and "
                         "--data-parallel-size")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")

    model = resolve_model(args)
    workload = resolve_workload(args, model)
    log(f"latency: {workload.num_requests} requests at {args.request_rate:g} req/s; model {model}")

    def load(base_url: str) -> dict:
        return asyncio.run(run_load(base_url, workload.prompts, workload.output_lens,
                                    args.request_rate, args.max_concurrency))

    server = subprocess_server if args.server == "subprocess" else inprocess_server
    results: list[dict] = []  # one per load, in the order they ran

    def run(url: str, label: str | None = None, data_parallel_size: int = 1) -> None:
        r = load(url)
        _print_run(workload, args, label, r)
        results.append({"benchmark": "latency", "model": model, "workload": workload.name,
                        "num_requests": workload.num_requests, "request_rate": args.request_rate,
                        "max_concurrency": args.max_concurrency, "config": label,
                        "data_parallel_size": data_parallel_size, **r})

    if args.base_url:
        run(args.base_url.rstrip("/"))
    elif args.compare:
        with ExitStack() as stack:
            urls = {}
            for mode in args.compare:
                overrides, multiprocess = SERVING_MODES[mode]
                urls[mode] = stack.enter_context(server(model, engine_args(args, **overrides),
                                                        args.server_timeout, multiprocess))
            for i in range(args.rounds):
                for mode in args.compare if i % 2 == 0 else args.compare[::-1]:
                    run(urls[mode], mode)
    else:
        for size in args.data_parallel_size or [None]:
            extra = {} if size is None else {"data_parallel_size": size}
            with server(model, engine_args(args, **extra), args.server_timeout) as url:
                run(url, None if size is None else f"dp={size}", size or 1)
    out = results[0] if len(results) == 1 else {"benchmark": "latency", "runs": results}
    if len({r["config"] for r in results}) > 1:
        out["summary"] = _compare(results)
    write_json(args.json, out)


# The figures --compare summarises (medians over a mode's rounds), and how each prints.
_KEYS = {"output tok/s": lambda r: r["output_throughput"], "TTFT p50": lambda r: r["ttft"]["p50_ms"],
         "ITL p50": lambda r: r["itl"]["p50_ms"], "ITL p99": lambda r: r["itl"]["p99_ms"],
         "TPOT p50": lambda r: r["tpot"]["p50_ms"]}


def _print_run(workload, args: argparse.Namespace, label: str | None, r: dict) -> None:
    if r["failed"]:
        log(f"{r['failed']} requests failed, e.g. {r['errors'][0]}")
    offered = "all at once" if math.isinf(args.request_rate) else f"{args.request_rate:g} req/s offered"
    ratio = "" if math.isinf(args.request_rate) else f" ({r['request_throughput'] / args.request_rate:.2f}x)"
    tag = "" if label is None else f" {label}"
    print(f"latency {workload.name}{tag} ({r['completed']}/{workload.num_requests} ok, {offered}): "
          f"{r['request_throughput']:.2f} req/s{ratio}, {r['output_throughput']:.1f} out tok/s | "
          f"TTFT p50 {r['ttft']['p50_ms']:.0f} ms p99 {r['ttft']['p99_ms']:.0f} ms | "
          f"ITL p50 {r['itl']['p50_ms']:.1f} ms p99 {r['itl']['p99_ms']:.1f} ms | "
          f"TPOT p50 {r['tpot']['p50_ms']:.1f} ms", flush=True)


def _compare(runs: list[dict]) -> dict:
    """Each configuration's medians over its rounds, and its ratios to the first configuration
    (for tok/s higher is better; for the latencies lower is)."""
    labels = list(dict.fromkeys(r["config"] for r in runs))
    medians = {label: {key: statistics.median(get(r) for r in runs if r["config"] == label)
                       for key, get in _KEYS.items()} for label in labels}
    base = medians[labels[0]]
    for label in labels:
        m = medians[label]
        figures = ", ".join(f"{key} {m[key]:.1f}" for key in _KEYS)
        ratios = "" if label == labels[0] else " | vs " + labels[0] + ": " + ", ".join(
            f"{key} {m[key] / base[key]:.2f}x" for key in _KEYS)
        print(f"latency {label} (medians of {sum(r['config'] == label for r in runs)} rounds): "
              f"{figures}{ratios}", flush=True)
    return {"baseline": labels[0], "medians": medians}


def _modes(text: str) -> list[str]:
    modes = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [m for m in modes if m not in SERVING_MODES]
    if not modes or unknown or len(set(modes)) != len(modes):
        raise argparse.ArgumentTypeError(f"want distinct modes among {', '.join(SERVING_MODES)}, "
                                         f"got {text!r}")
    return modes


def _sizes(text: str) -> list[int]:
    sizes = [int(part) for part in text.split(",") if part.strip()]
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"want sizes >= 1 such as 1,2; got {text!r}")
    return sizes


if __name__ == "__main__":
    main(sys.argv[1:])

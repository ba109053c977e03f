"""Embeddings: pagedllm's pooling runner against sentence-transformers on one random model.

A random model saved with sentence-transformers into ``--folder``: ``--shape bert-base`` (110M,
the bge-base / e5-base shape; CLS pooling, a WordPiece vocabulary of made-up words) or
``qwen3-0.6b`` (Qwen3-Embedding-0.6B's shape: a Qwen3 decoder, last-token pooling over the end of
text its word-level tokenizer appends); ``tiny`` and ``qwen3-tiny`` for smoke runs; Normalize
after each. ``--num-texts`` texts of ``--min-len``..``--max-len`` tokens (random.Random(0)). Both
run in this process, float32, the same torch threads, in interleaved rounds (one warm-up each):

* bulk indexing: every text at once, texts/s (sentence-transformers: ``encode``, batch 32);
* single queries: ``--num-queries`` short texts one at a time, p50/p99 latency.

Peers in their own venvs (benchmarks/embed_peer.py, the same threads, timed inside the peer):
``--llama-cpp``: llama.cpp's embeddings (llama-cpp-python) on the same model as an F32 GGUF file
written by llama.cpp's own converter; ``--vllm``: vLLM CPU's pooling runner on the same folder.
After the rounds sentence-transformers and every peer embed the first texts once more, and the
largest difference from pagedllm's vectors is reported (``max_abs_diff``, ``min_cosine``).

Prints one line with the ratios (pagedllm's figure over the peer's); ``--json`` writes the figures.

    python -m benchmarks.embed [--shape bert-base|qwen3-0.6b --num-texts 1000 --rounds 3] [--llama-cpp] [--vllm]

``--mixed``: embeddings beside generation on one server, generation's inter-token latency with
and without them (benchmarks/embed_mixed.py; its own arguments).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
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
    # Qwen3-Embedding-0.6B's shape (its positions cut to what the texts need: vLLM sizes its KV
    # cache by them)
    "qwen3-0.6b": {"hidden_size": 1024, "num_hidden_layers": 28, "num_attention_heads": 16,
                   "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 3072, "vocab_size": 151936,
                   "max_position_embeddings": 2048, "rope_theta": 1e6, "rms_norm_eps": 1e-6},
    "qwen3-tiny": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
                   "head_dim": 32, "intermediate_size": 128, "vocab_size": 1000, "max_position_embeddings": 1024},
}
BERT_SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
EOS = "<|endoftext|>"  # Qwen3-Embedding's tokenizer appends it: the last token it pools


def is_decoder(shape: str) -> bool:
    return shape.startswith("qwen3")


def special_tokens(shape: str) -> int:
    """The tokens the tokenizer adds to a text: [CLS] and [SEP], or the decoder's end of text."""
    return 1 if is_decoder(shape) else 2


def build_embedder(shape: str, folder: Path) -> Path:
    """A random sentence-transformers embedder (built once per folder): BERT with CLS pooling, or
    a Qwen3 decoder with last-token pooling (Qwen3-Embedding's modules); Normalize after both."""
    out = folder / f"st-{shape}"
    if (out / "modules.json").is_file():
        return out
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    hf = folder / f"hf-{shape}"
    hf.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    (_save_qwen3 if is_decoder(shape) else _save_bert)(SHAPES[shape], hf)
    pooling = "lasttoken" if is_decoder(shape) else "cls"
    st = SentenceTransformer(modules=[Transformer(str(hf)), Pooling(SHAPES[shape]["hidden_size"], pooling),
                                      Normalize()])
    st.save(str(out))
    if is_decoder(shape):  # as Qwen3-Embedding ships: the causal LM's config and names, no LM head
        for name in ("config.json", "model.safetensors"):
            shutil.copyfile(hf / name, out / name)
    return out


def _save_bert(spec: dict, hf: Path) -> None:
    from transformers import BertConfig, BertModel, BertTokenizerFast

    words = [f"w{i}" for i in range(spec["vocab_size"] - len(BERT_SPECIAL))]
    (hf / "vocab.txt").write_text("\n".join([*BERT_SPECIAL, *words]))
    BertModel(BertConfig(max_position_embeddings=512, **spec)).save_pretrained(hf)
    BertTokenizerFast(str(hf / "vocab.txt")).save_pretrained(hf)


def _save_qwen3(spec: dict, hf: Path) -> None:
    """A Qwen3 causal LM (tied embeddings) and a word-level tokenizer of made-up words that
    appends the end of text, as Qwen3-Embedding's does."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    vocab = {EOS: 0, **{f"w{i}": i + 1 for i in range(spec["vocab_size"] - 1)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=EOS))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single=f"$A {EOS}", special_tokens=[(EOS, 0)])
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS, unk_token=EOS).save_pretrained(hf)
    config = Qwen3Config(tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, pad_token_id=0, **spec)
    Qwen3ForCausalLM(config).save_pretrained(hf)


def make_texts(n: int, min_len: int, max_len: int, vocab_size: int, seed: int, specials: int) -> list[str]:
    """Texts of min_len..max_len tokens (the tokenizer's ``specials`` included): one made-up word
    each, the words of every vocabulary (w0 up)."""
    rng = random.Random(seed)
    words = vocab_size - len(BERT_SPECIAL)
    return [" ".join(f"w{rng.randrange(words)}" for _ in range(rng.randint(min_len, max_len) - specials))
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
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--mixed" in argv:  # embeddings beside generation on one server: benchmarks/embed_mixed.py
        from benchmarks import embed_mixed

        return embed_mixed.main([a for a in argv if a != "--mixed"])
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
    specials = special_tokens(args.shape)
    texts = make_texts(args.num_texts, args.min_len, args.max_len, vocab, seed=0, specials=specials)
    queries = make_texts(args.num_queries, args.query_len, args.query_len, vocab, seed=1, specials=specials)
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
    result["sentence_transformers"].update(agreement(ours, st.encode(texts[:NUM_COMPARED]).tolist()))
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

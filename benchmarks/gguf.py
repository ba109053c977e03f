"""GGUF files: pagedllm against llama.cpp on the same file, the same threads, the same run.

The models are random, in the shapes of Qwen2.5-0.5B and Llama-3.2-1B (Llama architecture, the
32K synthetic tokenizer in place of their vocabularies), or a small mixture of experts
("moe-0.5b", Mixtral architecture: the experts stay quantized), made once: transformers writes the
float32 checkpoint, llama.cpp's own converter (convert_hf_to_gguf.py) turns it into an F32 GGUF
file and llama.cpp's quantizer (llama_model_quantize) into Q8_0, Q4_0 and Q4_K_M, exactly the
files a user downloads. Without llama.cpp (benchmarks/setup_llama_cpp.sh not run) it says so and
measures pagedllm alone, on Q8_0 / Q4_0 files the gguf package writes (benchmarks/gguf_writer.py).
Both engines then load each file, and in interleaved rounds:
  decode      one request: a 32-token prompt, 128 new tokens, greedy; tok/s of the 127 steps
              after the first token, and the share of the measured memory read bandwidth this is
              (weight bytes a step reads / time per step: llama.cpp's as the file holds them,
              pagedllm's as its weight table holds them, a few percent more where a fused layer
              widens a Q4_K part to its Q6_K sibling's format; docs/step_cost.md);
  prefill     one 512-token prompt, to its first token: prompt tok/s;
  batch       32 concurrent requests (the throughput benchmark's "cpu" workload): output tok/s;
              llama.cpp runs them in one llama_decode per step (continuous batching, its best
              batched mode; benchmarks/llama_cpp_peer.py).
pagedllm's peak RSS (from building the engine to the last round; the bandwidth probe before it
does not count) is reported against the file size plus its KV budget, beside its RSS once loaded.

    bash benchmarks/setup_llama_cpp.sh      # once: llama.cpp for this CPU, and its converter
    python -m benchmarks.gguf [--shape qwen2.5-0.5b llama-3.2-1b moe-0.5b] [--type Q4_K_M Q8_0 Q4_0]
                              [--rounds 3] [--no-llama-cpp] [--skip batch] [--activations float32]
Prints one line per (shape, type) with both engines' medians and the ratios.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import (
    CACHE_DIR,
    REPO_ROOT,
    TOKENIZER_DIR,
    ServedPeer,
    log,
    make_workload,
    reset_peak_rss,
    rss_bytes,
    time_decode_steps,
    write_json,
)
from benchmarks.llama_cpp_convert import convert_to_gguf, converter_missing

LLAMA_CPP_VENV = REPO_ROOT / ".venv-llama-cpp"
_COMMON = dict(vocab_size=32000, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
               rope_theta=500_000.0, rms_norm_eps=1e-5, tie_word_embeddings=True, head_dim=64)
SHAPES: dict[str, dict] = {
    "qwen2.5-0.5b": dict(_COMMON, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2),
    "llama-3.2-1b": dict(_COMMON, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8),
    # A small mixture of experts, benchmarks/common.py's qwen3-moe-0.5b shape (16 layers of 16
    # experts x 512, top-2) as Mixtral (llama.cpp's converter reads the synthetic tokenizer for
    # Llama-family files only): the experts stay in the file's format (layers/fused_moe.py).
    "moe-0.5b": dict(_COMMON, kind="Mixtral", hidden_size=1024, intermediate_size=512,
                     num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4,
                     num_local_experts=16, num_experts_per_tok=2),
    "tiny": dict(_COMMON, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2),
}
FTYPES = ("Q4_K_M", "Q8_0", "Q4_0")  # what benchmarks/llama_cpp_peer.py --quantize makes
KV_BUDGET = 1 << 30


def _peer_python(venv: Path = LLAMA_CPP_VENV) -> Path:
    python = venv / "bin" / "python"
    if not python.is_file():
        raise SystemExit(f"no llama.cpp venv at {venv}: run bash benchmarks/setup_llama_cpp.sh")
    return python


def llama_cpp_missing(venv: Path | None = None) -> str | None:
    """Why llama.cpp cannot make or run the files here; None when it can."""
    venv = venv or LLAMA_CPP_VENV
    if not (venv / "bin" / "python").is_file():
        return f"no llama.cpp venv at {venv}"
    return converter_missing()


def prepare(shape: str, types: list[str], by_llama_cpp: bool = True) -> dict[str, Path]:
    """The GGUF files of ``shape`` (made once, cached): type name -> path. Without llama.cpp
    the gguf package writes them from the float32 checkpoint, kept in the folder for that."""
    folder = CACHE_DIR / (f"gguf-{shape}" if by_llama_cpp else f"gguf-{shape}-gguf-py")
    spec = SHAPES[shape]
    if not by_llama_cpp:
        from benchmarks.gguf_writer import WRITABLE_TYPES

        unwritable = [t for t in types if t not in WRITABLE_TYPES]
        if unwritable or "kind" in spec:
            raise SystemExit(f"without llama.cpp the gguf package writes dense shapes in "
                             f"{', '.join(WRITABLE_TYPES)} only, not {shape} {' '.join(unwritable)}: "
                             "run bash benchmarks/setup_llama_cpp.sh")
    stamp = folder / "spec.json"
    if not stamp.is_file() or json.loads(stamp.read_text()) != spec:
        shutil.rmtree(folder, ignore_errors=True)
        (folder / "hf").mkdir(parents=True)
        log(f"building the random {shape} model ...")
        # In a child process: the float32 model must not count in this process's peak RSS.
        fields = {k: v for k, v in spec.items() if k != "kind"}
        kind = spec.get("kind", "Llama")  # the transformers class; Llama unless the shape says
        code = ("import sys, torch, transformers; torch.manual_seed(0); "
                f"m = transformers.{kind}ForCausalLM(transformers.{kind}Config(**{fields!r})).eval(); "
                "m.save_pretrained(sys.argv[1])")
        subprocess.run([sys.executable, "-c", code, str(folder / "hf")], check=True)
        if not by_llama_cpp:
            stamp.write_text(json.dumps(spec))
            return _write_with_gguf_package(folder, shape, types)
        for f in TOKENIZER_DIR.iterdir():
            shutil.copy(f, folder / "hf" / f.name)
        convert_to_gguf(folder / "hf", folder / "F32.gguf", "f32")
        shutil.rmtree(folder / "hf")
        stamp.write_text(json.dumps(spec))
    if not by_llama_cpp:
        return _write_with_gguf_package(folder, shape, types)
    paths = {}
    for name in types:
        path = folder / f"{name}.gguf"
        if not path.is_file():
            log(f"quantizing {shape} to {name} with llama.cpp ...")
            quantize(folder / "F32.gguf", path, name)
        paths[name] = path
    return paths


def quantize(source: Path, path: Path, type_name: str) -> None:
    """The GGUF file ``source`` quantized to ``path`` by llama.cpp's own quantizer (FTYPES)."""
    subprocess.run([str(_peer_python()), str(Path(__file__).with_name("llama_cpp_peer.py")),
                    "--quantize", str(source), str(path), type_name], check=True)


def _write_with_gguf_package(folder: Path, shape: str, types: list[str]) -> dict[str, Path]:
    from benchmarks.gguf_writer import write_gguf

    paths = {}
    for name in types:
        path = folder / f"{name}.gguf"
        if not path.is_file():
            log(f"writing {shape} as {name} with the gguf package (no llama.cpp) ...")
            tmp = path.with_suffix(".tmp")  # an interrupted write never leaves a half file
            write_gguf(folder / "hf", tmp, name)
            tmp.rename(path)
        paths[name] = path
    return paths


def carries_tokenizer(path: Path) -> bool:
    from gguf import GGUFReader

    return "tokenizer.ggml.tokens" in GGUFReader(str(path)).fields


def weight_bytes_per_token(path: Path) -> int:
    """Bytes of the tensors a decode step reads: all but the embedding table, whose one row a
    token looks up (a tied output head reads the whole table, so then it counts), and of a
    stack of experts the share one token's top-k reads."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    share = _expert_share(path, reader)
    tensors = {t.name: int(t.n_bytes) * (share if "_exps." in t.name else 1)
               for t in reader.tensors}
    if "output.weight" in tensors:
        return int(sum(tensors.values()) - tensors["token_embd.weight"])
    return int(sum(tensors.values()))


def _tensor_names(path: Path) -> set[str]:
    from gguf import GGUFReader

    return {t.name for t in GGUFReader(str(path)).tensors}


def _expert_share(path: Path, reader=None) -> float:  # noqa: ANN001 (a GGUFReader)
    """The share of a stack of experts one token's top-k reads (1.0 without experts)."""
    from gguf import GGUFReader

    reader = reader or GGUFReader(str(path))
    for field in reader.fields.values():
        if field.name.endswith(".expert_used_count"):
            used = int(field.parts[field.data[0]][0])
            count = next(int(f.parts[f.data[0]][0]) for f in reader.fields.values()
                         if f.name.endswith(".expert_count"))
            return used / count
    return 1.0


def read_bandwidth() -> float:
    """Bytes per second the machine reads from memory: the best of 5 sums over a 1 GiB tensor
    (torch's threads, as both engines use every core)."""
    import torch

    x = torch.ones(1 << 28)  # 1 GiB of float32, far larger than any cache
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return x.numel() * 4 / best


class PagedLLM:
    """pagedllm on one GGUF file, answering the same jobs as the llama.cpp peer."""

    def __init__(self, path: Path, threads: int, activations: str = "auto") -> None:
        import torch

        from pagedllm import LLM
        torch.set_num_threads(threads)
        # The gguf package's files carry no tokenizer: the one llama.cpp's converter embeds.
        tokenizer = None if carries_tokenizer(path) else str(TOKENIZER_DIR)
        self.llm = LLM(str(path), tokenizer=tokenizer, max_model_len=2048,
                       kv_cache_memory_bytes=KV_BUDGET, enable_prefix_caching=False,
                       max_num_seqs=64, seed=0, quantization_activations=activations)

    def held_bytes_per_token(self, path: Path) -> int:
        """Bytes of the weights a decode step reads as pagedllm holds them (the runner's weight
        table; a fused layer whose parts differ in type is held in the widest): the file's count
        with each layer's file bytes replaced by its held ones."""
        runner = self.llm.llm_engine.executor.runner
        stacks = {name for name, m in runner.model.named_modules() if type(m).__name__ == "FusedMoE"}
        share = _expert_share(path)
        # An untied embedding's one row per token is not read whole (a tied one's bytes are 0).
        return int(sum(row.nbytes * (share if row.name.rpartition(".")[0] in stacks else 1)
                       for row in runner.weight_table
                       if not (row.name.endswith("embed_tokens") and "output.weight" in _tensor_names(path))))

    def _generate(self, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
        from pagedllm import SamplingParams

        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def run_decode(self, prompt: list[int], max_tokens: int) -> dict:
        prefill_s, decode_s, ids = time_decode_steps(lambda n: self._generate([prompt], [n])[0], max_tokens)
        return {"prefill_s": prefill_s, "decode_s": decode_s, "token_ids": ids}

    def run_batch(self, prompts: list[list[int]], max_tokens: list[int]) -> dict:
        start = time.perf_counter()
        ids = self._generate(prompts, max_tokens)
        return {"elapsed_s": time.perf_counter() - start, "num_tokens": sum(map(len, ids)),
                "token_ids": ids}


def _jobs(skip: set[str]) -> list[tuple[str, dict]]:
    import random

    rng = random.Random(0)
    jobs = [("decode", {"kind": "decode", "prompt": [rng.randrange(3, 32000) for _ in range(32)],
                        "max_tokens": 128}),
            ("prefill", {"kind": "decode", "prompt": [rng.randrange(3, 32000) for _ in range(512)],
                         "max_tokens": 1})]
    w = make_workload("cpu", 32000)
    jobs.append(("batch", {"kind": "batch", "prompts": w.prompts, "max_tokens": w.output_lens}))
    return [(name, job) for name, job in jobs if name not in skip]


def _ask(engine, job: dict) -> dict:
    if isinstance(engine, ServedPeer):
        return engine.ask(json.dumps(job))
    if job["kind"] == "decode":
        return engine.run_decode(job["prompt"], job["max_tokens"])
    return engine.run_batch(job["prompts"], job["max_tokens"])


def _rate(name: str, job: dict, r: dict) -> float:
    if name == "decode":
        return (job["max_tokens"] - 1) / r["decode_s"]
    if name == "prefill":
        return len(job["prompt"]) / r["prefill_s"]
    return r["num_tokens"] / r["elapsed_s"]


def bench_file(path: Path, args: argparse.Namespace, bandwidth: float) -> dict:
    jobs = _jobs(set(args.skip))
    reset_peak_rss()
    engines: dict[str, object] = {"pagedllm": PagedLLM(path, args.threads, args.activations)}
    rss_loaded = rss_bytes("VmRSS")
    if args.llama_cpp:
        n_ctx = 32 * 1024
        engines["llama.cpp"] = ServedPeer(
            "llama.cpp peer", [str(_peer_python(args.llama_cpp_venv)),
                               str(Path(__file__).with_name("llama_cpp_peer.py")),
                               "--model", str(path), "--threads", str(args.threads),
                               "--n-ctx", str(n_ctx), "--n-seq-max", "32", "--serve"],
            env=dict(os.environ, OMP_NUM_THREADS=str(args.threads)))
        log(f"llama.cpp: {engines['llama.cpp'].ready.get('system_info', '?')}")
    rates: dict[str, dict[str, list[float]]] = {e: {n: [] for n, _ in jobs} for e in engines}
    num_tokens: dict[str, dict[str, int]] = {e: {} for e in engines}  # of the last round
    same_ids: dict[str, bool] = {}
    try:
        for warm_or_round in range(args.rounds + 1):  # round 0 warms every engine up
            for name, job in jobs:
                results = {}
                for engine_name, engine in engines.items():
                    results[engine_name] = r = _ask(engine, job)
                    if warm_or_round:
                        rates[engine_name][name].append(_rate(name, job, r))
                        ids = r["token_ids"]
                        num_tokens[engine_name][name] = (len(ids) if job["kind"] == "decode"
                                                         else sum(map(len, ids)))
                if len(results) == 2:
                    a, b = (results[e]["token_ids"] for e in engines)
                    same_ids[name] = a == b
                if warm_or_round:
                    log(f"  round {warm_or_round} {name}: " + ", ".join(
                        f"{e} {rates[e][name][-1]:.1f} tok/s" for e in engines))
        rss = rss_bytes()
    finally:
        for engine in engines.values():
            if isinstance(engine, ServedPeer):
                engine.close()
    medians = {e: {n: statistics.median(v) for n, v in per.items()} for e, per in rates.items()}
    weight_bytes = weight_bytes_per_token(path)
    held_bytes = engines["pagedllm"].held_bytes_per_token(path)
    result = {"file": path.name, "file_bytes": path.stat().st_size, "medians": medians,
              "rss_loaded_bytes": rss_loaded, "peak_rss_bytes": rss,
              "rss_bound_bytes": int(1.1 * (path.stat().st_size + KV_BUDGET)),
              "weight_bytes_per_token": weight_bytes, "held_bytes_per_token": held_bytes,
              "read_bandwidth": bandwidth,
              "num_tokens": num_tokens, "same_greedy_ids": same_ids}
    if "decode" in medians["pagedllm"]:
        # Each engine's bytes: pagedllm's as it holds them, the peer's as the file holds them.
        result["decode_bandwidth_share"] = {
            e: m["decode"] * (held_bytes if e == "pagedllm" else weight_bytes) / bandwidth
            for e, m in medians.items()}
    if "llama.cpp" in medians:
        result["ratio_vs_llama_cpp"] = {n: medians["pagedllm"][n] / medians["llama.cpp"][n]
                                        for n in medians["pagedllm"]}
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", nargs="+", default=["qwen2.5-0.5b"], choices=sorted(SHAPES))
    p.add_argument("--type", nargs="+", default=["Q4_K_M", "Q8_0", "Q4_0"], choices=FTYPES)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--no-llama-cpp", dest="llama_cpp", action="store_false")
    p.add_argument("--llama-cpp-venv", type=Path, default=LLAMA_CPP_VENV,
                   help="the peer's venv (an AVX2 build: VENV=.venv-llama-cpp-v3 LLAMA_CPP_ISA=v3 "
                        "bash benchmarks/setup_llama_cpp.sh, with PAGEDLLM_CPU_ISA=v3 for ours)")
    p.add_argument("--skip", nargs="*", default=[], choices=["decode", "prefill", "batch"])
    p.add_argument("--activations", choices=["auto", "float32", "int8"], default="auto",
                   help="pagedllm's quantization_activations (auto, the engine's default: int8 "
                        "for the quantized layers, llama.cpp's strategy; float32: the exact path)")
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--read-bandwidth", type=float, help=argparse.SUPPRESS)  # the parent's probe
    args = p.parse_args(argv)
    from pagedllm.kernels.cpu_extension import cpu_description

    missing = llama_cpp_missing()
    if args.llama_cpp and llama_cpp_missing(args.llama_cpp_venv):
        log(f"llama.cpp is not installed ({llama_cpp_missing(args.llama_cpp_venv)}; run bash "
            "benchmarks/setup_llama_cpp.sh): measuring pagedllm alone")
        args.llama_cpp = False
    bandwidth = args.read_bandwidth or read_bandwidth()
    log(f"CPU: {cpu_description()}; memory read bandwidth {bandwidth / 1e9:.1f} GB/s")
    results = []
    for shape in args.shape:
        for type_name, path in prepare(shape, args.type, by_llama_cpp=missing is None).items():
            log(f"{shape} {type_name}: {path}")
            # One process per file: a file's peak RSS must not include the one before it.
            if len(args.shape) * len(args.type) > 1:
                with tempfile.NamedTemporaryFile(suffix=".json") as out:
                    subprocess.run([sys.executable, "-m", "benchmarks.gguf", "--shape", shape,
                                    "--type", type_name, "--rounds", str(args.rounds),
                                    "--threads", str(args.threads), "--json", out.name,
                                    "--activations", args.activations,
                                    "--llama-cpp-venv", str(args.llama_cpp_venv),
                                    "--read-bandwidth", str(bandwidth)]
                                   + ([] if args.llama_cpp else ["--no-llama-cpp"])
                                   + (["--skip", *args.skip] if args.skip else []),
                                   check=True, stdout=subprocess.DEVNULL, cwd=REPO_ROOT)
                    result = json.loads(Path(out.name).read_text())["results"][0]
            else:
                result = bench_file(path, args, bandwidth)
            result["shape"], result["type"] = shape, type_name
            result["activations"] = args.activations
            result["file_by"] = "gguf package" if missing else "llama.cpp"
            results.append(result)
            print(_line(result), flush=True)
    write_json(args.json, {"cpu": cpu_description(), "results": results})
    return 0


def _line(r: dict) -> str:
    m = r["medians"]
    note = "" if "llama.cpp" in m else ", pagedllm alone"
    if r.get("file_by") == "gguf package":
        note += ", file by the gguf package"
    parts = [f"{r['shape']} {r['type']} ({r.get('activations', 'float32')} activations{note}):"]
    for name in m["pagedllm"]:
        text = f"{name} {m['pagedllm'][name]:.1f} tok/s"
        if "llama.cpp" in m:
            text += f" vs llama.cpp {m['llama.cpp'][name]:.1f} ({r['ratio_vs_llama_cpp'][name]:.2f}x)"
        parts.append(text)
    if "decode_bandwidth_share" in r:
        parts.append("decode bandwidth " + ", ".join(
            f"{e} {100 * s:.0f}%" for e, s in r["decode_bandwidth_share"].items()))
    parts.append(f"peak RSS {r['peak_rss_bytes'] / 2**20:.0f} MiB (bound "
                 f"{r['rss_bound_bytes'] / 2**20:.0f}; {r['rss_loaded_bytes'] / 2**20:.0f} once loaded)")
    return parts[0] + " " + "; ".join(parts[1:])


if __name__ == "__main__":
    sys.exit(main())

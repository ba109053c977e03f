"""LoRA adapters: requests spread over 8 adapters against the same requests on the base alone.

A random Qwen2.5-0.5B-shape base (Qwen2: q/k/v biases, tied head; the synthetic tokenizer's
32k vocabulary) with 8 random PEFT adapters of rank 16 on every linear (q, k, v, o, gate, up,
down), written as PEFT folders. Runs, each with one warm-up call:
  mixed:   32 requests, 4 per adapter, in one batch, against the 32 on a base-only engine;
  decode:  batch-1 decode (one request) with one adapter against the base.
Reported: output tokens/s of each and the ratios adapter / base (targets: >= 0.8 mixed,
>= 0.9 batch-1), medians over ``--rounds`` rounds that alternate base and adapters.
``--base-format q4_k_m`` runs both engines on the base as a Q4_K_M GGUF file instead (llama.cpp's
converter, then its quantizer: the file a user downloads), with the same PEFT adapters.

    python -m benchmarks.lora [--shape qwen2.5-0.5b] [--num-requests 32 --input-len 128 --output-len 64]
                              [--rounds 3] [--base-format hf|q4_k_m]
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

from benchmarks.common import CACHE_DIR, add_engine_args, build_random_model, engine_args, log, write_json

_COMMON = dict(vocab_size=32000, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
               rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)
SHAPES: dict[str, dict] = {
    "qwen2.5-0.5b": dict(_COMMON, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2),
    "tiny": dict(_COMMON, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2),
}
NUM_ADAPTERS = 8


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


def timed_generate(llm, prompts, output_len: int, loras) -> float:
    """Output tokens/s of one generate() over ``prompts``."""
    from pagedllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                        lora_request=loras)
    elapsed = time.perf_counter() - t0
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def run(model: str, kwargs: dict, prompts, one, output_len: int, loras) -> dict:
    """Tokens/s of the batch and of batch-1 decode, on a base-only engine (``loras`` None) or
    with adapters (the batch spread over them, the single request on the first)."""
    from pagedllm import LLM

    llm = LLM(model, **kwargs)
    lora_list = None if loras is None else [loras[i % len(loras)] for i in range(len(prompts))]
    first = None if loras is None else loras[0]
    timed_generate(llm, prompts[:len(loras or [0]) * 2], 4, lora_list and lora_list[:2 * len(loras)])
    result = {"batch_tok_per_s": timed_generate(llm, prompts, output_len, lora_list),
              "decode_tok_per_s": timed_generate(llm, [one], output_len, first)}
    del llm
    gc.collect()
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="pagedllm bench lora", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--model-dir", help="where to build the base (default: the bench cache)")
    parser.add_argument("--rounds", type=int, default=3, help="base and adapter runs, alternated")
    parser.add_argument("--base-format", default="hf", choices=["hf", "q4_k_m"],
                        help="the base as its float32 checkpoint or as llama.cpp's Q4_K_M GGUF file")
    add_engine_args(parser)
    parser.add_argument("--json", metavar="FILE", help="also write the results to this JSON file")
    args = parser.parse_args(argv)

    from pagedllm import LoRARequest

    spec = SHAPES[args.shape]
    folder = Path(args.model_dir) if args.model_dir else CACHE_DIR / f"bench-lora-{args.shape}"
    base = build_random_model("Qwen2", spec, folder / "base", stamp=spec)
    adapters = write_adapters(base, folder, NUM_ADAPTERS, args.rank)
    model = str(base if args.base_format == "hf" else gguf_base(base, args.base_format.upper()))
    loras = [LoRARequest(f"adapter{i}", i + 1, str(p)) for i, p in enumerate(adapters)]
    rng = random.Random(0)
    prompts = [[rng.randrange(3, spec["vocab_size"]) for _ in range(args.input_len)]
               for _ in range(args.num_requests)]
    one = [rng.randrange(3, spec["vocab_size"]) for _ in range(args.input_len)]
    log(f"lora: {args.num_requests} requests x {args.input_len} in / {args.output_len} out over "
        f"{NUM_ADAPTERS} adapters of rank {args.rank}; base {args.shape} ({args.base_format})")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    # A GGUF base's engine reads the checkpoint's tokenizer (the prompts are ids; transformers
    # cannot rebuild this synthetic vocabulary from a qwen2 GGUF file).
    tokenizer = {} if args.base_format == "hf" else {"tokenizer": str(base)}
    lora_kwargs = engine_args(args, enable_lora=True, max_loras=NUM_ADAPTERS, max_lora_rank=args.rank, **tokenizer)
    rounds: dict[str, list[dict]] = {"base": [], "lora": []}
    for i in range(args.rounds):
        rounds["base"].append(run(model, engine_args(args, **tokenizer), prompts, one, args.output_len, None))
        rounds["lora"].append(run(model, lora_kwargs, prompts, one, args.output_len, loras))
        log(f"round {i + 1}: base {rounds['base'][-1]}, lora {rounds['lora'][-1]}")
    base_run, lora_run = ({key: statistics.median(r[key] for r in rounds[name]) for key in rounds[name][0]}
                          for name in ("base", "lora"))
    mixed = lora_run["batch_tok_per_s"] / base_run["batch_tok_per_s"]
    decode = lora_run["decode_tok_per_s"] / base_run["decode_tok_per_s"]
    form = "" if args.base_format == "hf" else f" {args.base_format.upper()}"
    print(f"lora ({args.shape}{form}, {NUM_ADAPTERS} adapters r{args.rank}): mixed {args.num_requests} req "
          f"{lora_run['batch_tok_per_s']:.1f} tok/s vs base {base_run['batch_tok_per_s']:.1f} "
          f"= {mixed:.2f}x | batch-1 decode {lora_run['decode_tok_per_s']:.1f} vs "
          f"{base_run['decode_tok_per_s']:.1f} tok/s = {decode:.2f}x (medians of {args.rounds} rounds)", flush=True)
    write_json(args.json, {"benchmark": "lora", "shape": args.shape, "base_format": args.base_format, "rank": args.rank,
                           "num_requests": args.num_requests, "input_len": args.input_len,
                           "output_len": args.output_len, "rounds": rounds, "base": base_run, "lora": lora_run,
                           "mixed_ratio": mixed, "decode_ratio": decode})


if __name__ == "__main__":
    main(sys.argv[1:])

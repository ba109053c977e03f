"""Speculative decoding with a draft model: pairs whose acceptance is known, against the target
alone, in the same run and threads.

Random models cannot tell real text, so the pairs are built for their acceptance. The target is
a random Qwen2 in the shape ``--shape`` made as predictable as a trained model (build_target): a
plain random model's logits are nearly flat, so at the 1.5B shape even its own Q4_0 copy agrees
on ~5% of greedy tokens, where a trained model's copy agrees on 70-90%. Its head is its token
embedding in a fixed random order and its residual branches are scaled down, so the next token
is mostly the order's successor of the current one, by a margin the layers shrink on some steps
(the scale per shape puts the Q4_0 copy's agreement at 70-90%; docs/speculative.md). It is
drafted by (a) its own weights at load-time Q4_0 (high acceptance), (b) a smaller plain random
model of the same vocabulary (near-zero acceptance: the "never slower" case), (c) its own weights
(full acceptance: the upper bound) and (d) a random EAGLE-3 head (near-zero acceptance; its c is
estimated from its weight bytes, the head cannot decode alone). For each batch size,
every request decodes ``--num-tokens`` greedy tokens after a short prompt; outputs must equal the
target's. Reported: tokens/s against the target alone, the acceptance rate, tokens per
verification step t, drafts per step k, and at batch 1 the efficiency: the measured speed-up over
the ideal t / (1 + k c), c the draft's batch-1 decode step over the target's (docs/speculative.md).

``--llama-cpp`` adds llama.cpp's own speculative decoding on one GGUF pair (the target as an F32
GGUF, its Q4_0 draft from llama-quantize: benchmarks/llama_cpp_speculative.py): batch-1 decode
tok/s of each engine with the draft and alone, on those same two files, rounds interleaved.

    pagedllm bench speculative_draft [--shape qwen2.5-1.5b] [--batch-sizes 1 8 32] [--num-tokens 128]
                                     [--pairs q4_0 small self eagle3] [--llama-cpp [--rounds 3]]
"""
from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks import llama_cpp_speculative as llama_cpp
from benchmarks.common import (
    CACHE_DIR,
    add_engine_args,
    build_random_model,
    engine_args,
    log,
    time_decode_steps,
    write_json,
)

_COMMON = dict(vocab_size=32000, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
               rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)
PAIRS = ("q4_0", "small", "self", "eagle3")  # the drafts of the target, in report order
SHAPES: dict[str, tuple[dict, dict]] = {  # (target, the smaller draft)
    "qwen2.5-1.5b": (dict(_COMMON, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                          num_attention_heads=12, num_key_value_heads=2),
                     dict(_COMMON, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                          num_attention_heads=14, num_key_value_heads=2)),
    "qwen2.5-3b": (dict(_COMMON, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                        num_attention_heads=16, num_key_value_heads=2),
                   dict(_COMMON, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                        num_attention_heads=14, num_key_value_heads=2)),
    "tiny": (dict(_COMMON, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2),
             dict(_COMMON, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1)),
}


# The constructed target's branch scales (predictable_target): the MLP scaled per shape so that
# the target's own Q4_0 copy agrees on 70-90% of greedy tokens, as a trained model's does
# (docs/speculative.md); attention at a small share of that, so the context nudges a step rather
# than drowns it (undamped, its average over the context pulls every step towards the same few
# tokens and the greedy text loops).
MLP_SCALE = {"tiny": 3.3, "qwen2.5-1.5b": 0.04, "qwen2.5-3b": 0.03}  # 3b: from 1.5b, unmeasured
_ATTENTION_SHARE = 0.03


def predictable_target(mlp_scale: float, attention_scale: float, seed: int = 1) -> Callable[[Any], None]:
    """build_random_model's ``edit`` that gives a random model a trained model's confidence (the
    model's head must be untied): the head becomes the token embedding in a fixed random order,
    so a hidden state near token x's embedding scores one token, order^-1(x), far above the
    others; the MLP branches (down_proj) are scaled by ``mlp_scale`` and the attention branches
    (o_proj) by ``attention_scale``, so the residual stream stays near the current token's
    embedding, pulled off it by the layers just enough that some steps' top two are close."""
    def edit(model: Any) -> None:
        import torch

        embedding = model.get_input_embeddings().weight
        order = torch.randperm(embedding.shape[0], generator=torch.Generator().manual_seed(seed))
        model.get_output_embeddings().weight.copy_(embedding[order])
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(attention_scale)
            layer.mlp.down_proj.weight.mul_(mlp_scale)
    return edit


def build_target(shape: str, root: Path) -> Path:
    """The benchmark's target: a random Qwen2 in the shape, made predictable (predictable_target)
    with the shape's MLP scale; built once."""
    fields = {**SHAPES[shape][0], "tie_word_embeddings": False}
    mlp, attention = MLP_SCALE[shape], MLP_SCALE[shape] * _ATTENTION_SHARE
    stamp = {"fields": fields, "mlp_scale": mlp, "attention_scale": attention,
             "head": "the embedding, rows in a random order (seed 1)"}
    return build_random_model("Qwen2", fields, root / f"bench-spec-{shape}-predictable", stamp,
                              edit=predictable_target(mlp, attention))


def build_eagle3_head(fields: dict, folder: Path, draft_vocab: int = 8000) -> Path:
    """A random EAGLE-3 head (the EAGLE authors' layout, models/eagle3.py) for the target of
    ``fields``, its vocabulary the target's first ``draft_vocab`` tokens; built once."""
    import json

    import torch
    from safetensors.torch import save_file

    h, inter, layers = fields["hidden_size"], fields["intermediate_size"], fields["num_hidden_layers"]
    heads, kv_heads = fields["num_attention_heads"], fields["num_key_value_heads"]
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": h,
              "intermediate_size": inter, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
              "num_hidden_layers": 1, "vocab_size": fields["vocab_size"], "draft_vocab_size": draft_vocab,
              "rms_norm_eps": fields["rms_norm_eps"], "rope_theta": fields["rope_theta"],
              "max_position_embeddings": fields["max_position_embeddings"],
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": [min(2, layers - 1), layers // 2,
                                                                     max(layers - 3, 0)]}}
    if (folder / "config.json").is_file() and json.loads((folder / "config.json").read_text()) == config:
        return folder
    g = torch.Generator().manual_seed(0)

    def rand(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=g) * cols ** -0.5

    d = h // heads
    t = {"fc.weight": rand(h, 3 * h), "midlayer.self_attn.q_proj.weight": rand(heads * d, 2 * h),
         "midlayer.self_attn.k_proj.weight": rand(kv_heads * d, 2 * h),
         "midlayer.self_attn.v_proj.weight": rand(kv_heads * d, 2 * h),
         "midlayer.self_attn.o_proj.weight": rand(h, heads * d), "midlayer.mlp.gate_proj.weight": rand(inter, h),
         "midlayer.mlp.up_proj.weight": rand(inter, h), "midlayer.mlp.down_proj.weight": rand(h, inter),
         "lm_head.weight": rand(draft_vocab, h), "d2t": torch.zeros(draft_vocab, dtype=torch.long)}
    for name in ("midlayer.input_layernorm", "midlayer.hidden_norm", "midlayer.post_attention_layernorm", "norm"):
        t[f"{name}.weight"] = torch.ones(h)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(t, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _weight_bytes(folder: str) -> int:
    return sum(f.stat().st_size for f in Path(folder).glob("*.safetensors"))


def decode(model: str, batch: int, num_tokens: int, llm_kwargs: dict) -> dict:
    """``batch`` requests of ``num_tokens`` greedy tokens each, timed after a warm-up."""
    from pagedllm import LLM, SamplingParams

    llm = LLM(model, **llm_kwargs)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 32000) for _ in range(16)]} for _ in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    before = llm.get_metrics()
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    result = {"tok_per_s": batch * num_tokens / elapsed, "token_ids": [o.outputs[0].token_ids for o in outputs],
              **_spec_counts(before, llm.get_metrics())}
    llm = None
    gc.collect()  # the engine holds cycles: a 1.5B F32 target is 6 GB, never two alive at once
    return result


def _spec_counts(before: dict, after: dict) -> dict:
    """Acceptance, tokens per verification step and drafts per step between two metric reads."""
    d = {k: after[f"pagedllm:spec_decode_num_{k}"] - before[f"pagedllm:spec_decode_num_{k}"]
         for k in ("drafts", "draft_tokens", "accepted_tokens")}
    return {"acceptance": d["accepted_tokens"] / max(d["draft_tokens"], 1),
            "tokens_per_step": 1 + d["accepted_tokens"] / max(d["drafts"], 1),
            "drafts_per_step": d["draft_tokens"] / max(d["drafts"], 1)}


# The llama.cpp comparison's prompt. llama-speculative-simple takes text only: llama-tokenize turns
# it into ids with the GGUF file's vocabulary, and pagedllm is given those ids.
PROMPT = "The quick brown fox jumps over the lazy dog while the early morning train leaves the station."


def decode_steps(model: str, prompt_ids: list[int], num_tokens: int, llm_kwargs: dict) -> dict:
    """One greedy request of ``num_tokens`` tokens on a fresh engine: the rate of its steps alone,
    as llama.cpp reports it (the prompt's prefill, timed as a one-token request, taken off; no
    prefix cache, so both requests prefill). The engine is freed before returning."""
    from pagedllm import LLM, SamplingParams

    llm = LLM(model, **{**llm_kwargs, "enable_prefix_caching": False})
    prompt = {"prompt_token_ids": prompt_ids}

    def generate(max_tokens: int):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        return llm.generate(prompt, params, use_tqdm=False)[0]

    generate(4)  # warm-up
    before = llm.get_metrics()  # the one-token request verifies no draft
    _, steps_s, output = time_decode_steps(generate, num_tokens)
    result = {"tok_per_s": (num_tokens - 1) / steps_s, "token_ids": list(output.outputs[0].token_ids),
              **_spec_counts(before, llm.get_metrics())}
    llm = output = None  # the closure holds the cell, not the engine
    gc.collect()  # a 1.5B F32 target is 6 GB: never two alive, nor one beside llama.cpp's
    return result


def versus_llama_cpp(target_folder: Path, args: argparse.Namespace) -> dict:
    """pagedllm and llama.cpp on one GGUF pair at batch 1, each with the Q4_0 draft and alone:
    ``args.rounds`` rounds, the engines interleaved in each, medians reported."""
    import torch

    torch.set_num_threads(args.threads)  # llama.cpp gets the same number (-t, OMP_NUM_THREADS)
    target, draft = llama_cpp.gguf_pair(target_folder, args.threads)
    ids = llama_cpp.prompt_ids(target, PROMPT)
    k = args.num_speculative_tokens
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": k}
    # The HF folder's tokenizer, the one the converter wrote into the file: transformers cannot
    # rebuild it from the file (a BPE without byte-level pieces, filed under gpt2), and the
    # prompt comes as ids anyway.
    base = engine_args(args, max_num_seqs=1, tokenizer=str(target_folder))
    runs: dict[str, list[dict]] = {"pagedllm_alone": [], "pagedllm_spec": [], "llama_cpp_alone": [],
                                   "llama_cpp_spec": []}
    for r in range(args.rounds):
        runs["pagedllm_alone"].append(decode_steps(str(target), ids, args.num_tokens, base))
        runs["pagedllm_spec"].append(decode_steps(str(target), ids, args.num_tokens,
                                                  {**base, "speculative_config": spec}))
        # llama-bench's context before its steps: the prompt, as in the runs with a draft
        runs["llama_cpp_alone"].append({"tok_per_s": llama_cpp.target_alone(
            target, args.num_tokens, len(ids), args.threads)})
        runs["llama_cpp_spec"].append(llama_cpp.speculative(target, draft, PROMPT, args.num_tokens, k,
                                                            args.threads))
        log(f"round {r + 1}/{args.rounds}: " + ", ".join(
            f"{name} {v[-1]['tok_per_s']:.1f}" for name, v in runs.items()) + " tok/s")
    med = {name: {key: statistics.median(run[key] for run in v) for key in v[0] if key != "token_ids"}
           for name, v in runs.items()}
    agree = all(run["token_ids"] == runs["pagedllm_alone"][0]["token_ids"]
                for run in runs["pagedllm_alone"] + runs["pagedllm_spec"])
    return {"target": str(target), "draft": str(draft), "num_speculative_tokens": k,
            "threads": args.threads, "rounds": args.rounds, "num_tokens": args.num_tokens,
            "prompt": PROMPT, "prompt_token_ids": ids, "medians": med, "runs": runs,
            "pagedllm_greedy_agree": agree,
            "ratio_spec": med["pagedllm_spec"]["tok_per_s"] / med["llama_cpp_spec"]["tok_per_s"],
            "ratio_alone": med["pagedllm_alone"]["tok_per_s"] / med["llama_cpp_alone"]["tok_per_s"]}


def _llama_cpp_line(shape: str, c: dict) -> str:
    m = c["medians"]

    def engine(name: str) -> str:
        spec, alone = m[f"{name}_spec"], m[f"{name}_alone"]
        return (f"{name.replace('_', '.')} {spec['tok_per_s']:.1f} tok/s (acc {spec['acceptance']:.0%}, "
                f"{spec['tok_per_s'] / alone['tok_per_s']:.2f}x its alone {alone['tok_per_s']:.1f})")

    return (f"speculative_draft {shape} vs llama.cpp (F32 + Q4_0 GGUF, b1, k {c['num_speculative_tokens']}, "
            f"{c['threads']} threads, median of {c['rounds']}): {engine('pagedllm')} | {engine('llama_cpp')} "
            f"| pagedllm/llama.cpp {c['ratio_spec']:.2f}x with the draft, {c['ratio_alone']:.2f}x alone")


def pair_table(target: str, pairs: dict[str, dict], args: argparse.Namespace) -> list[dict]:
    """Each pair against the target alone, at each batch size, on pagedllm."""
    k = args.num_speculative_tokens
    base = engine_args(args, max_num_seqs=max(args.batch_sizes))
    # c: a draft decode step over the target's, each alone at batch 1.
    alone = decode(target, 1, args.num_tokens, base)["tok_per_s"]
    cost = {name: alone / decode(p["model"], 1, args.num_tokens,
                                 {**base, "quantization": p.get("quantization")})["tok_per_s"]
            for name, p in pairs.items() if name != "eagle3"}
    if "eagle3" in pairs:  # a decode step reads every weight once
        cost["eagle3"] = _weight_bytes(pairs["eagle3"]["model"]) / _weight_bytes(target)
    results = []
    for batch in args.batch_sizes:
        plain = decode(target, batch, args.num_tokens, base)
        for name, pair in pairs.items():
            spec = {"method": "draft_model", "num_speculative_tokens": k, **pair}  # eagle3: its own method
            run = decode(target, batch, args.num_tokens, {**base, "speculative_config": spec})
            speedup = run["tok_per_s"] / plain["tok_per_s"]
            ideal = run["tokens_per_step"] / (1 + run["drafts_per_step"] * cost[name])
            agree = sum(a == b for a, b in zip(plain["token_ids"], run["token_ids"]))
            distinct = statistics.mean(len(set(ids)) for ids in plain["token_ids"])  # a loop repeats
            results.append({"batch": batch, "draft": name, "speedup": speedup, "ideal": ideal,
                            "plain_tok_per_s": plain["tok_per_s"], "spec_tok_per_s": run["tok_per_s"],
                            "acceptance": run["acceptance"], "tokens_per_step": run["tokens_per_step"],
                            "drafts_per_step": run["drafts_per_step"], "cost_ratio": cost[name],
                            "greedy_agree": agree, "num_requests": batch,
                            "target_distinct_tokens": distinct})
            log(f"batch {batch} draft {name}: {run['tok_per_s']:.1f} vs {plain['tok_per_s']:.1f} tok/s "
                f"({speedup:.2f}x), acceptance {run['acceptance']:.0%}, {run['tokens_per_step']:.2f} "
                f"tokens/step, k {run['drafts_per_step']:.1f}, c {cost[name]:.2f}, greedy agree {agree}/{batch}, "
                f"the target's text {distinct:.0f} distinct of {args.num_tokens} tokens")
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="pagedllm bench speculative_draft", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen2.5-1.5b", choices=sorted(SHAPES))
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--num-tokens", type=int, default=128)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--pairs", nargs="*", default=list(PAIRS), choices=PAIRS,
                        help="the drafts measured on pagedllm (none: only the llama.cpp comparison)")
    parser.add_argument("--llama-cpp", action="store_true",
                        help=f"also llama.cpp's speculative decoding on a GGUF pair (once: {llama_cpp.SETUP})")
    parser.add_argument("--rounds", type=int, default=3, help="--llama-cpp: interleaved rounds, medians")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="--llama-cpp: the threads of both engines")
    parser.add_argument("--model-dir", default=str(CACHE_DIR), help="where the random models are built")
    parser.add_argument("--json", metavar="FILE", help="also write the results to this JSON file")
    add_engine_args(parser)
    args = parser.parse_args(argv)
    if args.llama_cpp and llama_cpp.tools_missing():
        raise SystemExit(f"--llama-cpp: {llama_cpp.tools_missing()}")

    target_fields, draft_fields = SHAPES[args.shape]
    root = Path(args.model_dir)
    target_folder = build_target(args.shape, root)
    target = str(target_folder)
    pairs: dict[str, dict] = {}
    if "small" in args.pairs:
        # A plain random model: it predicts other tokens than the target's order.
        fields = {**draft_fields, "tie_word_embeddings": False}
        pairs["small"] = {"model": str(build_random_model("Qwen2", fields, root / f"bench-spec-{args.shape}-draft",
                                                          fields))}
    if "eagle3" in args.pairs:
        pairs["eagle3"] = {"method": "eagle3",
                           "model": str(build_eagle3_head(target_fields, root / f"bench-spec-{args.shape}-eagle3"))}
    pairs.update({"q4_0": {"model": target, "quantization": "q4_0"}, "self": {"model": target}})
    pairs = {name: pairs[name] for name in PAIRS if name in args.pairs}
    result: dict = {"benchmark": "speculative_draft", "shape": args.shape, "results": []}
    if pairs:
        results = result["results"] = pair_table(target, pairs, args)
        print("speculative_draft " + args.shape + ": " + " | ".join(
            f"b{r['batch']} {r['draft']} {r['speedup']:.2f}x (acc {r['acceptance']:.0%}"
            + (f", eff {r['speedup'] / r['ideal']:.0%}" if r["batch"] == 1 else "") + ")" for r in results),
            flush=True)
    if args.llama_cpp:
        result["llama_cpp"] = versus_llama_cpp(target_folder, args)
        print(_llama_cpp_line(args.shape, result["llama_cpp"]), flush=True)
    write_json(args.json, result)


if __name__ == "__main__":
    main()

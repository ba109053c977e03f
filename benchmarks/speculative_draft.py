"""Speculative decoding with a draft model: pairs whose acceptance is known, against the target
alone, in the same run and threads.

Random models cannot tell real text, so the pairs are built for their acceptance: the target (a
random Qwen2 in the shape ``--shape``) drafted by (a) its own weights at load-time Q4_0 (high
acceptance), (b) a smaller random model of the same vocabulary (near-zero acceptance: the "never
slower" case), (c) its own weights (full acceptance: the upper bound) and (d) a random EAGLE-3 head
(near-zero acceptance; its c is estimated from its weight bytes, the head cannot decode alone). For each batch size,
every request decodes ``--num-tokens`` greedy tokens after a short prompt; outputs must equal the
target's. Reported: tokens/s against the target alone, the acceptance rate, tokens per
verification step t, drafts per step k, and at batch 1 the efficiency: the measured speed-up over
the ideal t / (1 + k c), c the draft's batch-1 decode step over the target's (docs/speculative.md).

    pagedllm bench speculative_draft [--shape qwen2.5-1.5b] [--batch-sizes 1 8 32] [--num-tokens 128]
"""
from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

from benchmarks.common import CACHE_DIR, add_engine_args, build_random_model, engine_args, log, write_json

_COMMON = dict(vocab_size=32000, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
               rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)
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
    after = llm.get_metrics()
    d = {k: after[f"pagedllm:spec_decode_num_{k}"] - before[f"pagedllm:spec_decode_num_{k}"]
         for k in ("drafts", "draft_tokens", "accepted_tokens")}
    return {"tok_per_s": batch * num_tokens / elapsed, "token_ids": [o.outputs[0].token_ids for o in outputs],
            "acceptance": d["accepted_tokens"] / max(d["draft_tokens"], 1),
            "tokens_per_step": 1 + d["accepted_tokens"] / max(d["drafts"], 1),
            "drafts_per_step": d["draft_tokens"] / max(d["drafts"], 1)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="pagedllm bench speculative_draft", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen2.5-1.5b", choices=sorted(SHAPES))
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--num-tokens", type=int, default=128)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--model-dir", default=str(CACHE_DIR), help="where the random models are built")
    parser.add_argument("--json", metavar="FILE", help="also write the results to this JSON file")
    add_engine_args(parser)
    args = parser.parse_args(argv)

    target_fields, draft_fields = SHAPES[args.shape]
    root = Path(args.model_dir)
    target = str(build_random_model("Qwen2", target_fields, root / f"bench-spec-{args.shape}", target_fields))
    # Untied: a random head of its own predicts other tokens than the target (whose tied
    # embeddings make a random model favour repeating its input).
    draft_fields = {**draft_fields, "tie_word_embeddings": False}
    small = str(build_random_model("Qwen2", draft_fields, root / f"bench-spec-{args.shape}-draft", draft_fields))
    k = args.num_speculative_tokens
    head = str(build_eagle3_head(target_fields, root / f"bench-spec-{args.shape}-eagle3"))
    pairs = {"q4_0": {"model": target, "quantization": "q4_0"}, "small": {"model": small},
             "self": {"model": target}, "eagle3": {"method": "eagle3", "model": head}}
    base = engine_args(args, max_num_seqs=max(args.batch_sizes))
    # c: a draft decode step over the target's, each alone at batch 1.
    alone = decode(target, 1, args.num_tokens, base)["tok_per_s"]
    cost = {name: alone / decode(p["model"], 1, args.num_tokens,
                                 {**base, "quantization": p.get("quantization")})["tok_per_s"]
            for name, p in pairs.items() if name != "eagle3"}
    cost["eagle3"] = _weight_bytes(head) / _weight_bytes(target)  # a decode step reads every weight once
    results = []
    for batch in args.batch_sizes:
        plain = decode(target, batch, args.num_tokens, base)
        for name, pair in pairs.items():
            spec = {"method": "draft_model", "num_speculative_tokens": k, **pair}  # eagle3: its own method
            run = decode(target, batch, args.num_tokens, {**base, "speculative_config": spec})
            speedup = run["tok_per_s"] / plain["tok_per_s"]
            ideal = run["tokens_per_step"] / (1 + run["drafts_per_step"] * cost[name])
            agree = sum(a == b for a, b in zip(plain["token_ids"], run["token_ids"]))
            results.append({"batch": batch, "draft": name, "speedup": speedup, "ideal": ideal,
                            "plain_tok_per_s": plain["tok_per_s"], "spec_tok_per_s": run["tok_per_s"],
                            "acceptance": run["acceptance"], "tokens_per_step": run["tokens_per_step"],
                            "drafts_per_step": run["drafts_per_step"], "cost_ratio": cost[name],
                            "greedy_agree": agree, "num_requests": batch})
            log(f"batch {batch} draft {name}: {run['tok_per_s']:.1f} vs {plain['tok_per_s']:.1f} tok/s "
                f"({speedup:.2f}x), acceptance {run['acceptance']:.0%}, {run['tokens_per_step']:.2f} "
                f"tokens/step, k {run['drafts_per_step']:.1f}, c {cost[name]:.2f}, greedy agree {agree}/{batch}")
    print("speculative_draft " + args.shape + ": " + " | ".join(
        f"b{r['batch']} {r['draft']} {r['speedup']:.2f}x (acc {r['acceptance']:.0%}"
        + (f", eff {r['speedup'] / r['ideal']:.0%}" if r["batch"] == 1 else "") + ")" for r in results), flush=True)
    write_json(args.json, {"benchmark": "speculative_draft", "shape": args.shape, "results": results})


if __name__ == "__main__":
    main()

"""Tiny random checkpoints for the speculative decoding tests, in the published layouts, and the
chi-square check that sampled output keeps the target's distribution."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = ROOT.parent / "shared" / "models" / "synthetic-tokenizer-32k"


def _copy_tokenizer(path: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER / name, path / name)


def tiny_llama(path: Path, vocab: int, seed: int, layers: int = 2, hidden: int = 32,
               max_positions: int = 256) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=max_positions, tie_word_embeddings=False, bos_token_id=0,
                      eos_token_id=vocab - 1)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # sharp distributions: greedy ties are out of reach of rounding
        model.lm_head.weight.mul_(40.0)
    model.save_pretrained(path)
    _copy_tokenizer(path)
    return str(path)


def _layer_tensors(prefix: str, hidden: int, in_size: int, seed: int, qkv_bias: bool = False) -> dict:
    """One Llama decoder layer's tensors (4 heads of 8, 2 KV heads) with q/k/v over ``in_size`` inputs."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 0.3) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    heads, kv_heads, head_dim, inter = 4, 2, hidden // 4, 2 * hidden
    t = {f"{prefix}input_layernorm.weight": 1 + rand(hidden, scale=0.1),
         f"{prefix}post_attention_layernorm.weight": 1 + rand(hidden, scale=0.1),
         f"{prefix}self_attn.q_proj.weight": rand(heads * head_dim, in_size),
         f"{prefix}self_attn.k_proj.weight": rand(kv_heads * head_dim, in_size),
         f"{prefix}self_attn.v_proj.weight": rand(kv_heads * head_dim, in_size),
         f"{prefix}self_attn.o_proj.weight": rand(hidden, heads * head_dim),
         f"{prefix}mlp.gate_proj.weight": rand(inter, hidden),
         f"{prefix}mlp.up_proj.weight": rand(inter, hidden),
         f"{prefix}mlp.down_proj.weight": rand(hidden, inter)}
    if qkv_bias:
        for name, size in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
            t[f"{prefix}self_attn.{name}_proj.bias"] = rand(size * head_dim)
    return t


def tiny_eagle3(path: Path, vocab: int, draft_vocab: int, seed: int, hidden: int = 32,
                layout: str = "eagle", aux_layer_ids: list[int] | None = None) -> str:
    """An EAGLE-3 head of random weights: ``layout`` "eagle" (the EAGLE authors': ``midlayer.``)
    or "speculators" (RedHatAI's: ``layers.0.``, its own embedding); its vocabulary is every
    other target token from 1 (d2t), so the t2d/d2t mapping is exercised."""
    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed + 1000)
    layer = "midlayer." if layout == "eagle" else "layers.0."
    t = _layer_tensors(layer, hidden, 2 * hidden, seed)
    t[f"{layer}hidden_norm.weight"] = 1 + torch.randn(hidden, generator=g) * 0.1
    t["fc.weight"] = torch.randn(hidden, 3 * hidden, generator=g) * 0.3
    t["norm.weight"] = 1 + torch.randn(hidden, generator=g) * 0.1
    t["lm_head.weight"] = torch.randn(draft_vocab, hidden, generator=g) * 3.0
    targets = torch.arange(draft_vocab) * 2 + 1
    t["d2t"] = targets - torch.arange(draft_vocab)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[targets] = True
    t["t2d"] = t2d
    if layout == "speculators":
        t["embed_tokens.weight"] = torch.randn(vocab, hidden, generator=g)
    save_file(t, str(path / "model.safetensors"))
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": hidden,
              "intermediate_size": 2 * hidden, "num_attention_heads": 4, "num_key_value_heads": 2,
              "num_hidden_layers": 1, "vocab_size": vocab, "draft_vocab_size": draft_vocab,
              "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 256}
    if aux_layer_ids is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_layer_ids}
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def tiny_mimo(path: Path, vocab: int, seed: int, layers: int = 2, hidden: int = 32) -> str:
    """A random Qwen2 body saved as MiMo, with one MTP layer (``model.mtp_layers.0.*``)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=0,
                      eos_token_id=vocab - 1)
    model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)
    model.save_pretrained(path)
    _copy_tokenizer(path)
    weights = load_file(str(path / "model.safetensors"))
    prefix = "model.mtp_layers.0."
    weights.update(_layer_tensors(prefix, hidden, hidden, seed + 1, qkv_bias=True))
    g = torch.Generator().manual_seed(seed + 2)
    for name in ("token_layernorm", "hidden_layernorm", "final_layernorm"):
        weights[f"{prefix}{name}.weight"] = 1 + torch.randn(hidden, generator=g) * 0.1
    weights[f"{prefix}input_proj.weight"] = torch.randn(hidden, 2 * hidden, generator=g) * 0.3
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config.update(architectures=["MiMoForCausalLM"], num_nextn_predict_layers=1)
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def sampled_distribution_pvalue(llm, target: str, prompt: list[int], vocab: int, n: int = 3000,
                                temp: float = 1.5, depth: int = 3) -> float:
    """The chi-square p-value of the joint distribution of the first ``depth`` tokens ``llm``
    samples (``n`` seeds) against the exact one from transformers' logits of ``target``;
    checks both verification branches (acceptances and residual draws) ran."""
    from scipy.stats import chisquare
    from transformers import AutoModelForCausalLM

    from pagedllm import SamplingParams

    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    exact: dict[tuple[int, ...], float] = {}

    def expand(prefix: list[int], prob: float) -> None:
        if len(prefix) == len(prompt) + depth:
            exact[tuple(prefix[len(prompt):])] = prob
            return
        with torch.no_grad():
            p = torch.softmax(hf(torch.tensor([prefix])).logits[0, -1].float() / temp, dim=-1)
        for t in range(vocab):
            expand(prefix + [t], prob * p[t].item())

    expand(list(prompt), 1.0)
    outs = llm.generate([{"prompt_token_ids": prompt}] * n,
                        [SamplingParams(temperature=temp, seed=s, max_tokens=depth, ignore_eos=True)
                         for s in range(n)], use_tqdm=False)
    m = llm.get_metrics()
    accepted, proposed = m["pagedllm:spec_decode_num_accepted_tokens"], m["pagedllm:spec_decode_num_draft_tokens"]
    assert 0 < accepted < proposed  # both branches of the test ran: acceptances and residual draws
    counts: dict[tuple[int, ...], int] = {}
    for o in outs:
        key = tuple(o.outputs[0].token_ids)
        counts[key] = counts.get(key, 0) + 1
    keys = sorted(exact, key=lambda k: -exact[k])
    big = [k for k in keys if exact[k] * n >= 5]  # rare outcomes pooled: expected counts >= 5
    obs = [counts.get(k, 0) for k in big] + [n - sum(counts.get(k, 0) for k in big)]
    exp = [exact[k] * n for k in big] + [n * (1 - sum(exact[k] for k in big))]
    return chisquare(obs, exp).pvalue


def assert_idle(llm) -> None:
    """Nothing left running and every block back: the state an engine owes when idle."""
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    engine.engine_core.scheduler.check_integrity()
    assert llm.get_metrics()["pagedllm:kv_cache_usage_perc"] == 0.0  # no leaked blocks

"""NomicBERT (nomic-embed-text's remote-code architecture) against an independent float64
computation written here from the checkpoint's layout: rotary positions, post-norm, SwiGLU
(fc11 * silu(fc12)), no biases, mean pooling. sentence-transformers cannot load it without
trust_remote_code, so the folder's modules.json and pooling config are written by hand."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from pagedllm import LLM
from pagedllm.errors import ModelLoadError
from tests.pooling.st_models import write_bert_tokenizer

HIDDEN, HEADS, LAYERS, INNER, BASE = 32, 4, 2, 256, 1000.0
TEXTS = ["the cat sat on the mat", "a dog", "red cats ran far on a blue mat the end", "s"]


def _save(folder, **config_overrides):
    tokenizer, vocab_size = write_bert_tokenizer(folder)
    tokenizer.save_pretrained(folder)
    config = {"architectures": ["NomicBertModel"], "model_type": "nomic_bert", "vocab_size": vocab_size,
              "n_embd": HIDDEN, "n_head": HEADS, "n_layer": LAYERS, "n_inner": INNER, "n_positions": 128,
              "rotary_emb_base": BASE, "rotary_emb_fraction": 1.0, "rotary_emb_interleaved": False,
              "activation_function": "swiglu", "qkv_proj_bias": False, "mlp_fc1_bias": False,
              "mlp_fc2_bias": False, "prenorm": False, "causal": False, "type_vocab_size": 2,
              "layer_norm_epsilon": 1e-12, "pad_vocab_size_multiple": 1, **config_overrides}
    (folder / "config.json").write_text(json.dumps(config))
    gen = torch.Generator().manual_seed(0)

    def rand(*shape, scale=0.2):
        return torch.randn(*shape, generator=gen) * scale

    weights = {"embeddings.word_embeddings.weight": rand(vocab_size, HIDDEN, scale=1.0),
               "embeddings.token_type_embeddings.weight": rand(2, HIDDEN),
               "emb_ln.weight": 1 + rand(HIDDEN, scale=0.1), "emb_ln.bias": rand(HIDDEN, scale=0.1)}
    for i in range(LAYERS):
        p = f"encoder.layers.{i}."
        weights |= {p + "attn.Wqkv.weight": rand(3 * HIDDEN, HIDDEN), p + "attn.out_proj.weight": rand(HIDDEN, HIDDEN),
                    p + "mlp.fc11.weight": rand(INNER, HIDDEN), p + "mlp.fc12.weight": rand(INNER, HIDDEN),
                    p + "mlp.fc2.weight": rand(HIDDEN, INNER, scale=0.1)}
        for norm in ("norm1", "norm2"):
            weights |= {p + f"{norm}.weight": 1 + rand(HIDDEN, scale=0.1), p + f"{norm}.bias": rand(HIDDEN, scale=0.1)}
    save_file(weights, str(folder / "model.safetensors"))
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": HIDDEN, "pooling_mode_mean_tokens": True}))
    return weights


def _reference(weights, ids):
    """The encoder in float64, one input alone, then the mean of its rows."""
    w = {k: v.double() for k, v in weights.items()}
    n, d = len(ids), HIDDEN // HEADS

    def norm(x, name):
        return torch.nn.functional.layer_norm(x, (HIDDEN,), w[name + ".weight"], w[name + ".bias"], eps=1e-12)

    def rotate(x):  # x [n, H, d]: the half-split rotation with angle pos * BASE^(-2i/d)
        inv = BASE ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
        ang = torch.arange(n, dtype=torch.float64)[:, None] * inv[None]
        cos, sin = torch.cat((ang.cos(), ang.cos()), -1)[:, None], torch.cat((ang.sin(), ang.sin()), -1)[:, None]
        return x * cos + torch.cat((-x[..., d // 2:], x[..., :d // 2]), -1) * sin

    x = norm(w["embeddings.word_embeddings.weight"][ids] + w["embeddings.token_type_embeddings.weight"][0], "emb_ln")
    for i in range(LAYERS):
        p = f"encoder.layers.{i}."
        q, k, v = (x @ w[p + "attn.Wqkv.weight"].T).view(n, 3, HEADS, d).unbind(1)
        q, k = rotate(q), rotate(k)
        probs = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) / d ** 0.5, dim=-1)
        attn = torch.einsum("hqk,khd->qhd", probs, v).reshape(n, HIDDEN) @ w[p + "attn.out_proj.weight"].T
        x = norm(attn + x, p + "norm1")
        mlp = ((x @ w[p + "mlp.fc11.weight"].T) * torch.nn.functional.silu(x @ w[p + "mlp.fc12.weight"].T))
        x = norm(mlp @ w[p + "mlp.fc2.weight"].T + x, p + "norm2")
    return x.mean(0)


def test_nomic_bert_embeddings_match_an_independent_computation(tmp_path):
    weights = _save(tmp_path)
    llm = LLM(str(tmp_path), max_num_batched_tokens=24)  # the inputs share steps
    assert llm.llm_engine.runner_type == "pooling" and llm.llm_engine.max_model_len == 128
    for out in llm.embed(TEXTS):
        got = torch.tensor(out.outputs.embedding, dtype=torch.float64)
        want = _reference(weights, out.prompt_token_ids)
        assert float(got @ want / (got.norm() * want.norm())) >= 0.99999
        assert float((got - want).abs().max()) <= 1e-4


def test_nomic_bert_refuses_what_it_does_not_compute(tmp_path):
    _save(tmp_path, prenorm=True)
    with pytest.raises(ModelLoadError, match="prenorm"):
        LLM(str(tmp_path))

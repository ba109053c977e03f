"""Loader and registry errors, and the rope settings in both transformers spellings."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from pagedllm.checkpoint.loader import load_model
from pagedllm.errors import ModelLoadError, UnsupportedModelError
from pagedllm.layers.rotary import RopeConfig, compute_inv_freq
from pagedllm.models import supported_architectures

CPU = torch.device("cpu")
TINY = dict(architectures=["LlamaForCausalLM"], vocab_size=32, hidden_size=16,
            intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, tie_word_embeddings=False)


def write_model(path, config: dict = TINY, drop: str | None = None) -> None:
    """A config.json and a model.safetensors with the tensors a tiny Llama needs."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    h, i, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    d = h // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * d
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,),
              "lm_head.weight": (v, h)}
    layer = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
             "self_attn.q_proj.weight": (h, h), "self_attn.k_proj.weight": (kv, h),
             "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, h),
             "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h),
             "mlp.down_proj.weight": (h, i)}
    shapes.update({f"model.layers.0.{k}": s for k, s in layer.items()})
    tensors = {k: torch.randn(s) for k, s in shapes.items() if k != drop}
    save_file(tensors, str(path / "model.safetensors"))


def test_loads_handwritten_checkpoint(tmp_path):
    write_model(tmp_path)
    model, config = load_model(str(tmp_path), torch.float32, CPU)
    expected = load_file(str(tmp_path / "model.safetensors"))
    qkv = model.model.layers[0].self_attn.qkv_proj.weight
    # The fused projection holds q, k, v stacked in that order.
    assert torch.equal(qkv, torch.cat([expected[f"model.layers.0.self_attn.{n}_proj.weight"]
                                       for n in "qkv"]))
    assert not model.training and config["vocab_size"] == 32


def test_unknown_architecture(tmp_path):
    write_model(tmp_path, dict(TINY, architectures=["FooForCausalLM"]))
    with pytest.raises(UnsupportedModelError) as err:
        load_model(str(tmp_path), torch.float32, CPU)
    for name in ("FooForCausalLM", "LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert name in str(err.value)
    assert "MistralForCausalLM" in supported_architectures()


def test_missing_weight_file(tmp_path):
    write_model(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no model.safetensors"):
        load_model(str(tmp_path), torch.float32, CPU)


def test_missing_config(tmp_path):
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(str(tmp_path), torch.float32, CPU)


def test_missing_shard(tmp_path):
    write_model(tmp_path)
    (tmp_path / "model.safetensors").rename(tmp_path / "model-00001-of-00002.safetensors")
    index = {"metadata": {}, "weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors",
                                            "lm_head.weight": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match="model-00002-of-00002.safetensors"):
        load_model(str(tmp_path), torch.float32, CPU)


@pytest.mark.parametrize("drop", ["model.layers.0.self_attn.k_proj.weight", "lm_head.weight"])
def test_missing_tensor(tmp_path, drop):
    write_model(tmp_path, drop=drop)
    with pytest.raises(ModelLoadError, match=drop.replace(".", r"\.")):
        load_model(str(tmp_path), torch.float32, CPU)


def test_tied_checkpoint_needs_no_lm_head(tmp_path):
    write_model(tmp_path, dict(TINY, tie_word_embeddings=True), drop="lm_head.weight")
    model, _ = load_model(str(tmp_path), torch.float32, CPU)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_shape_mismatch(tmp_path):
    write_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(dict(TINY, intermediate_size=48)))
    with pytest.raises(ModelLoadError, match="shape"):
        load_model(str(tmp_path), torch.float32, CPU)


def test_bfloat16_load(tmp_path):
    write_model(tmp_path)
    model, _ = load_model(str(tmp_path), torch.bfloat16, CPU)
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32


ROPE_V5 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@pytest.mark.parametrize("rope_type", ["default", "linear", "llama3"])
def test_rope_both_spellings_match_transformers(rope_type):
    params = dict(ROPE_V5, rope_type=rope_type)
    if rope_type == "default":
        params = {"rope_type": "default", "rope_theta": 500000.0}
    v5 = {"max_position_embeddings": 131072, "rope_parameters": params}
    # transformers 4.x: theta at the top level, the rest in rope_scaling (key "type"), or null
    scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "rope_type")}
    v4 = {"max_position_embeddings": 131072, "rope_theta": 500000.0,
          "rope_scaling": dict(scaling, type=rope_type) if rope_type != "default" else None}
    assert RopeConfig.from_hf(v4) == RopeConfig.from_hf(v5)

    hf_config = LlamaConfig(hidden_size=2048, num_attention_heads=16, head_dim=128,
                            max_position_embeddings=131072, rope_parameters=params)
    hf_inv_freq = LlamaRotaryEmbedding(hf_config).inv_freq
    assert torch.allclose(compute_inv_freq(128, RopeConfig.from_hf(v5)), hf_inv_freq, rtol=1e-6, atol=0)


def test_unsupported_rope_type():
    with pytest.raises(UnsupportedModelError, match="mrope"):
        RopeConfig.from_hf({"rope_parameters": {"rope_type": "mrope", "rope_theta": 1e4, "factor": 4.0}})


def test_sliding_window_is_per_layer_and_leaves_the_context():
    """An active window goes to the layers (exact windowed attention); the context stays the
    model's max_position_embeddings. Qwen2's flag off: no window at all."""
    from pagedllm.models.llama import DecoderArgs
    mistral = dict(TINY, max_position_embeddings=32768, sliding_window=4096)
    args = DecoderArgs.from_hf(mistral)
    assert args.max_position_embeddings == 32768
    assert [spec.sliding_window for spec in args.layers] == [4096] * args.num_layers
    qwen = DecoderArgs.from_hf(dict(mistral, model_type="qwen2", use_sliding_window=False))
    assert qwen.max_position_embeddings == 32768
    assert [spec.sliding_window for spec in qwen.layers] == [None] * qwen.num_layers


def test_corrupt_weight_file(tmp_path):
    write_model(tmp_path)
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[:200])
    with pytest.raises(ModelLoadError, match="cannot read weights"):
        load_model(str(tmp_path), torch.float32, CPU)

"""Rope variants against transformers: yarn, longrope (short and long factors), partial rotary,
per-layer-type parameters, and the refusal of dynamic scaling."""
from __future__ import annotations

import pytest
import torch
from transformers import Gemma3TextConfig, LlamaConfig, Phi3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding
from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb as phi3_apply_rotary

from pagedllm.errors import UnsupportedModelError
from pagedllm.layers.rotary import RopeConfig, RotaryEmbedding, apply_rotary, attention_scaling, compute_inv_freq

HEAD_DIM = 64


def _longrope_config(partial: float = 1.0) -> Phi3Config:
    half = int(HEAD_DIM * partial) // 2
    return Phi3Config(hidden_size=HEAD_DIM * 4, num_attention_heads=4, max_position_embeddings=256,
                      original_max_position_embeddings=32, partial_rotary_factor=partial,
                      rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                       "short_factor": [1.0 + 0.05 * i for i in range(half)],
                                       "long_factor": [1.0 + 0.5 * i for i in range(half)],
                                       "partial_rotary_factor": partial})


@pytest.mark.parametrize("params", [
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 8.0, "original_max_position_embeddings": 64,
     "beta_fast": 16, "beta_slow": 2, "mscale": 0.9, "mscale_all_dim": 1.1},
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
     "attention_factor": 1.3, "truncate": False, "partial_rotary_factor": 0.5},
])
def test_yarn_matches_transformers(params):
    hf_config = LlamaConfig(hidden_size=HEAD_DIM * 4, num_attention_heads=4, head_dim=HEAD_DIM,
                            max_position_embeddings=256, rope_parameters=dict(params))
    hf_inv_freq, hf_scaling = ROPE_INIT_FUNCTIONS["yarn"](hf_config, "cpu")
    rope = RopeConfig.from_hf(hf_config.to_dict())
    assert torch.equal(compute_inv_freq(HEAD_DIM, rope), hf_inv_freq)
    assert attention_scaling(rope) == pytest.approx(hf_scaling, rel=1e-12)
    assert hf_scaling != 1.0


@pytest.mark.parametrize("partial", [1.0, 0.75])
def test_longrope_short_within_and_long_past_the_original_context(partial):
    hf_config = _longrope_config(partial)
    hf_rope = Phi3RotaryEmbedding(hf_config)
    ours = RotaryEmbedding(HEAD_DIM, RopeConfig.from_hf(hf_config.to_dict()))
    assert ours.rotary_dim == int(HEAD_DIM * partial)
    assert ours.attention_scaling == pytest.approx(hf_rope.attention_scaling) and ours.attention_scaling > 1
    x = torch.zeros(1, dtype=torch.float32)
    for length in (20, 32, 60):  # within, exactly at, past the original context (32)
        positions = torch.arange(length)
        hf_cos, hf_sin = hf_rope(x, positions[None])
        cos, sin = ours(positions, torch.float32)
        # transformers rotates a whole sequence by one set of factors (long once it outgrows
        # the original context); ours picks per position, so the rows past 32 agree.
        rows = slice(0, length) if length <= 32 else slice(32, length)
        assert torch.equal(cos[rows], hf_cos[0, rows]) and torch.equal(sin[rows], hf_sin[0, rows])
        if length > 32:  # and the rows within it keep the short factors
            short_cos, _ = hf_rope(x, positions[None, :32])
            assert torch.equal(cos[:32], short_cos[0])


def test_partial_rotary_leaves_the_tail_alone():
    hf_config = _longrope_config(0.5)
    cos, sin = RotaryEmbedding(HEAD_DIM, RopeConfig.from_hf(hf_config.to_dict()))(torch.arange(7), torch.float32)
    q = torch.randn(7, 3, HEAD_DIM, generator=torch.Generator().manual_seed(0))
    ours = apply_rotary(q, cos, sin)
    hf_q, _ = phi3_apply_rotary(q.transpose(0, 1)[None], q.transpose(0, 1)[None], cos[None], sin[None])
    assert torch.allclose(ours, hf_q[0].transpose(0, 1), atol=1e-6, rtol=0)
    assert torch.equal(ours[..., HEAD_DIM // 2:], q[..., HEAD_DIM // 2:])


def test_per_layer_type_parameters():
    config = Gemma3TextConfig(num_hidden_layers=2, head_dim=HEAD_DIM, rope_local_base_freq=10.0,
                              rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                                               "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                  "rope_theta": 1e6}}).to_dict()
    local, full = RopeConfig.from_hf(config, "sliding_attention"), RopeConfig.from_hf(config, "full_attention")
    assert (local.rope_type, local.theta) == ("default", 10.0)
    assert (full.rope_type, full.theta, full.factor) == ("linear", 1e6, 8.0)


def test_dynamic_rope_is_refused_with_the_reason():
    with pytest.raises(UnsupportedModelError, match="longest sequence.*longrope"):
        RopeConfig.from_hf({"rope_scaling": {"type": "dynamic", "factor": 2.0}, "rope_theta": 1e4})


def test_transformers4_spellings_read_the_same():
    """Phi-3.5's config.json (``rope_scaling`` type "longrope" or the older "su", the original
    context at the top level) and Gemma 3's (``rope_local_base_freq``) as transformers 4.x wrote them."""
    v5 = _longrope_config(0.75).to_dict()
    params = dict(v5["rope_parameters"])
    v4 = {"max_position_embeddings": 256, "original_max_position_embeddings": 32,
          "rope_theta": params.pop("rope_theta"), "partial_rotary_factor": params.pop("partial_rotary_factor"),
          "rope_scaling": {"type": "su", "short_factor": params["short_factor"],
                           "long_factor": params["long_factor"]}}
    assert RopeConfig.from_hf(v4) == RopeConfig.from_hf(v5)

    from pagedllm.models.gemma3 import _local_rope
    gemma_v4 = {"max_position_embeddings": 256, "rope_theta": 1e6, "rope_local_base_freq": 10.0,
                "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    assert (_local_rope(gemma_v4).theta, _local_rope(gemma_v4).rope_type) == (10.0, "default")
    full = RopeConfig.from_hf(gemma_v4, "full_attention")
    assert (full.theta, full.rope_type, full.factor) == (1e6, "linear", 8.0)

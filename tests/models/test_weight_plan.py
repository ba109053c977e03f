"""The planning pass (weight_plan/plan.py): after it every linear layer, vocabulary embedding
and head, and MoE projection holds exactly one weight format, the table names each once, and a
layer left on torch's matmul (``Dense``) computes what its plain weight did, bit for bit."""
from __future__ import annotations

import pytest
import torch
from paged_helpers import randomize_
from test_model_parity import make_hf_model, save
from test_moe import make_moe_model

from pagedllm.checkpoint.loader import load_model
from pagedllm.errors import ModelLoadError
from pagedllm.kernels.cpu_extension import load_cpu_ops, native_isa
from pagedllm.layers import FusedMoE, Linear, ParallelLMHead, VocabParallelEmbedding
from pagedllm.layers.quantization.mxfp4 import dequantize_mxfp4
from pagedllm.layers.weight_format import MXFP4, Dense, Half, Panels
from pagedllm.models.registry import get_model_class
from pagedllm.weight_plan.plan import plan_weights

CPU = torch.device("cpu")
needs_kernel = pytest.mark.skipif(native_isa() is None or load_cpu_ops() is None,
                                  reason="no pagedllm kernel for this CPU")


def _llama(tied: bool, dtype: torch.dtype = torch.float32) -> tuple[torch.nn.Module, dict]:
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 80, "max_position_embeddings": 64,
              "rms_norm_eps": 1e-5, "tie_word_embeddings": tied}
    model = get_model_class(config)(config)
    if tied:
        model.tie_weights()
    randomize_(model)
    return model.to(dtype).eval(), config


def _formatted(model: torch.nn.Module) -> dict[str, object]:
    """Every layer the plan must cover -> what it holds (an MoE projection by its name)."""
    held: dict[str, object] = {}
    for name, module in model.named_modules():
        if isinstance(module, (Linear, ParallelLMHead, VocabParallelEmbedding)):
            held[name] = module.weight_format
        elif isinstance(module, FusedMoE):
            for projection in FusedMoE.PROJECTIONS:
                held[f"{name}.{projection}"] = module.expert_formats.get(projection)
    return held


def _logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids))))


@pytest.mark.parametrize("tied", [True, False])
def test_torch_matmul_layers_hold_dense_and_compute_the_same_bits(tied, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CPU_KERNELS", "torch")
    model, config = _llama(tied)
    ids = [3, 17, 5, 60, 2, 9, 41]
    before = _logits(model, ids)
    assert all(fmt is None for fmt in _formatted(model).values())  # not planned yet
    table, activations = plan_weights(model, config, CPU, "auto")
    held = _formatted(model)
    assert all(isinstance(fmt, Dense) for fmt in held.values()), held
    assert [row.name for row in table] == ["lm_head", *[n for n in held if n != "lm_head"]]
    assert {row.format for row in table} == {"float32"} and activations == {}
    embedding, head = model.model.embed_tokens, model.lm_head
    assert (embedding.weight_format is head.weight_format) == tied  # one object for one weight
    by_name = {row.name: row.nbytes for row in table}
    assert by_name["model.embed_tokens"] == (0 if tied else embedding.weight.nbytes)
    assert by_name["lm_head"] == head.weight.nbytes
    assert head.weight is not None and head.weight_format.weight is head.weight  # one copy
    assert torch.equal(_logits(model, ids), before)


@needs_kernel
def test_kernel_layers_hold_panels_and_the_rest_dense(monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CPU_KERNELS", "pagedllm")
    model, config = _llama(tied=False)
    table, _ = plan_weights(model, config, CPU, "float32")
    held = _formatted(model)
    assert all(isinstance(fmt, Panels) for name, fmt in held.items() if name != "model.embed_tokens")
    assert isinstance(held["model.embed_tokens"], Dense)  # no kernel looks an embedding up
    assert sum(row.nbytes for row in table) == sum(fmt.nbytes for fmt in held.values())


@needs_kernel
def test_bf16_layers_hold_half_panels(monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CPU_KERNELS", "pagedllm")
    model, config = _llama(tied=True, dtype=torch.bfloat16)
    table, activations = plan_weights(model, config, CPU, "float32")
    held = _formatted(model)
    assert all(isinstance(fmt, Half) for fmt in held.values()), held
    assert model.model.embed_tokens.weight_format is model.lm_head.weight_format
    assert activations == {"bf16": "float32"} and {row.format for row in table} == {"bf16"}


def test_explicit_activations_nothing_takes_are_refused(monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CPU_KERNELS", "torch")
    model, config = _llama(tied=False)
    with pytest.raises(ModelLoadError, match="int8"):
        plan_weights(model, config, CPU, "int8")


def test_moe_projections_left_on_torch_matmul_hold_dense(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CPU_KERNELS", "torch")
    hf_model = make_moe_model("qwen3_moe")
    model, config = load_model(save(hf_model, tmp_path), torch.float32, CPU)
    ids = [1, 5, 36, 0, 17, 35, 2]
    before = _logits(model, ids)
    table, _ = plan_weights(model, config, CPU, "auto")
    experts = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert experts and all(isinstance(f, Dense) and f.weight is getattr(m, name)
                           for m in experts for name, f in m.expert_formats.items())
    assert all(fmt is not None for fmt in _formatted(model).values())
    assert len(table) == len(_formatted(model))
    assert torch.equal(_logits(model, ids), before)


def test_mxfp4_format_is_the_checkpoints_blocks_dequantized():
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 40, 2, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(118, 130, (3, 40, 2), dtype=torch.uint8, generator=gen)
    fmt = MXFP4(blocks, scales)
    assert (fmt.out_features, fmt.in_features, fmt.nbytes) == (40, 64, blocks.numel() + scales.numel())
    weight = fmt.dequantize(torch.float32)
    assert torch.equal(weight, dequantize_mxfp4(blocks, scales, torch.float32))
    one = MXFP4(blocks[1], scales[1])  # one expert: a linear layer's [out, in]
    ids = torch.tensor([0, 39, 7])
    assert torch.equal(one.rows(ids), weight[1][ids])
    assert torch.equal(one.dequantize_rows(ids), weight[1][ids].double())
    x = torch.randn(5, 64, generator=gen)
    assert torch.equal(one.apply(x, None), torch.nn.functional.linear(x, weight[1]))
    assert fmt.describe() == "mxfp4"


def test_dense_moves_nothing_on_a_loaded_hf_model(tmp_path, monkeypatch):
    """A model from the loader, planned with torch's matmul: the state_dict is still the
    checkpoint's (Dense holds the layers' own Parameters)."""
    monkeypatch.setenv("PAGEDLLM_CPU_KERNELS", "torch")
    from transformers import LlamaConfig

    hf_model = make_hf_model(LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1,
                                         vocab_size=64, tie_word_embeddings=False))
    model, config = load_model(save(hf_model, tmp_path), torch.float32, CPU)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    plan_weights(model, config, CPU, "float32")
    assert state.keys() == model.state_dict().keys()
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())

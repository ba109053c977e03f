"""Loading PEFT folders: LoRARequest's spelling, the fused projections' layout, and every refusal
(another base, a rank above max_lora_rank, a corrupt file, an unknown module, modules_to_save)
as one ValidationError line with nothing loaded."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from lora_helpers import build_adapter, build_base

from pagedllm import LLM, LoRARequest
from pagedllm.errors import ValidationError
from pagedllm.lora.request import LoRARequest as LoRARequestFromModule


def test_lora_request_spelling_and_checks():
    assert LoRARequest is LoRARequestFromModule
    req = LoRARequest("sql", 3, "/tmp/sql")
    assert (req.lora_name, req.lora_int_id, req.lora_path) == ("sql", 3, "/tmp/sql")
    for bad in (dict(lora_name="", lora_int_id=1), dict(lora_name="x", lora_int_id=0),
                dict(lora_name="x", lora_int_id=True)):
        with pytest.raises(ValidationError):
            LoRARequest(**bad)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_loading")
    base = build_base("llama", root / "base")
    llm = LLM(str(base), device="cpu", dtype="float32", enable_lora=True, max_loras=2,
              max_lora_rank=16)
    yield root, base, llm
    del llm


def _manager(llm):
    return llm.llm_engine.executor.runner.lora_manager


def test_fused_projections_stack_per_projection_pairs(llama):
    root, base, llm = llama
    peft = build_adapter(base, root / "qv", 4, 8, ["q_proj", "v_proj", "up_proj"])
    llm.llm_engine.add_lora(LoRARequest("qv", 1, str(root / "qv")))
    model = _manager(llm).loaded[1]
    qkv = model.layers["model.layers.0.self_attn.qkv_proj"]
    # q (4 heads x 16) at column 0, v after q and k (2 KV heads x 16 each); k untrained: absent.
    assert [(p.target.out_offset, p.target.out_size) for p in qkv] == [(0, 64), (96, 32)]
    gate_up = model.layers["model.layers.1.mlp.gate_up_proj"]
    assert [(p.target.out_offset, p.target.out_size) for p in gate_up] == [(96, 96)]
    state = dict(peft.named_parameters())
    a = state["base_model.model.model.layers.0.self_attn.v_proj.lora_A.default.weight"]
    b = state["base_model.model.model.layers.0.self_attn.v_proj.lora_B.default.weight"]
    torch.testing.assert_close(qkv[1].lora_a, a.detach())
    torch.testing.assert_close(qkv[1].lora_b, b.detach() * (8 / 4))  # alpha / r folded into B
    assert llm.llm_engine.list_loras() == [1]
    assert llm.llm_engine.remove_lora(1) and llm.llm_engine.list_loras() == []


def _refused(llm, request, *fragments):
    before = (list(_manager(llm).requests), llm.llm_engine.list_loras())
    with pytest.raises(ValidationError) as info:
        llm.llm_engine.add_lora(request)
    message = str(info.value)
    assert "\n" not in message and request.lora_name in message
    for fragment in fragments:
        assert fragment in message, message
    assert (list(_manager(llm).requests), llm.llm_engine.list_loras()) == before  # nothing kept
    return message


def test_adapter_for_another_base_names_module_and_shapes(llama, tmp_path):
    root, _, llm = llama
    other = build_base("llama", tmp_path / "other")
    config = json.loads((other / "config.json").read_text())
    config.update(hidden_size=32, intermediate_size=48)
    (tmp_path / "small").mkdir()
    (tmp_path / "small" / "config.json").write_text(json.dumps(config))
    shutil.copy(other / "tokenizer.json", tmp_path / "small")
    from transformers import AutoConfig, AutoModelForCausalLM

    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path / "small")).save_pretrained(
        tmp_path / "small")
    build_adapter(tmp_path / "small", tmp_path / "wrong", 4, 8, ["q_proj"])
    _refused(llm, LoRARequest("wrong", 2, str(tmp_path / "wrong")), "self_attn.q_proj",
             "(4, 32)", "64x64")


def test_rank_above_max_lora_rank(llama, tmp_path):
    _, base, llm = llama
    build_adapter(base, tmp_path / "big", 32, 32, ["q_proj"])
    _refused(llm, LoRARequest("big", 3, str(tmp_path / "big")), "rank 32", "max_lora_rank 16")


def test_corrupt_safetensors(llama, tmp_path):
    _, base, llm = llama
    build_adapter(base, tmp_path / "bad", 4, 8, ["q_proj"])
    path = tmp_path / "bad" / "adapter_model.safetensors"
    path.write_bytes(path.read_bytes()[:100])
    _refused(llm, LoRARequest("bad", 4, str(tmp_path / "bad")), "safetensors")


def test_unknown_module_and_unsupported_options(llama, tmp_path):
    _, base, llm = llama
    from safetensors.torch import load_file, save_file

    build_adapter(base, tmp_path / "odd", 4, 8, ["q_proj"])
    tensors = load_file(tmp_path / "odd" / "adapter_model.safetensors")
    save_file({k.replace("q_proj", "x_proj"): v for k, v in tensors.items()},
              tmp_path / "odd" / "adapter_model.safetensors")
    _refused(llm, LoRARequest("odd", 5, str(tmp_path / "odd")), "model.layers.0.self_attn.x_proj")
    save_file({k.replace("self_attn.q_proj", "block_sparse_moe.experts.3.w1"): v for k, v in tensors.items()},
              tmp_path / "odd" / "adapter_model.safetensors")
    _refused(llm, LoRARequest("odd", 5, str(tmp_path / "odd")), "model.layers.0.block_sparse_moe.experts.3.w1",
             "the base model has no MoE experts there")
    build_adapter(base, tmp_path / "mts", 4, 8, ["q_proj"])
    config = json.loads((tmp_path / "mts" / "adapter_config.json").read_text())
    config["modules_to_save"] = ["score"]
    (tmp_path / "mts" / "adapter_config.json").write_text(json.dumps(config))
    _refused(llm, LoRARequest("mts", 6, str(tmp_path / "mts")), "modules_to_save ['score']")
    config["modules_to_save"] = ["lm_head"]  # listed, but no weight saved
    (tmp_path / "mts" / "adapter_config.json").write_text(json.dumps(config))
    _refused(llm, LoRARequest("mts", 6, str(tmp_path / "mts")), "modules_to_save lists")
    _refused(llm, LoRARequest("missing", 7, str(tmp_path / "nowhere")), "adapter_config.json")


def test_lora_needs_enable_lora(tmp_path):
    base = build_base("qwen2", tmp_path / "base")
    llm = LLM(str(base), device="cpu", dtype="float32")
    with pytest.raises(ValidationError, match="enable_lora"):
        llm.generate([[1, 2, 3]], lora_request=LoRARequest("a", 1, str(tmp_path)), use_tqdm=False)


def test_expert_pairs_that_do_not_fit_refused_by_name(tmp_path):
    """PEFT's LoRA on an MoE block's fused expert tensors (``target_parameters``) whose shapes fit
    neither fused tensor, or a per-expert pair past the base's experts, is refused naming the experts;
    nothing of it is kept."""
    from lora_helpers import SYNTHETIC_TOKENIZER_DIR
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, MixtralConfig

    config = MixtralConfig(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                           num_experts_per_tok=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(tmp_path / "base")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(SYNTHETIC_TOKENIZER_DIR / name, tmp_path / "base" / name)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"],
                      target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    get_peft_model(model, lora).save_pretrained(tmp_path / "experts")
    from safetensors.torch import load_file, save_file

    path = tmp_path / "experts" / "adapter_model.safetensors"
    tensors = load_file(path)
    llm = LLM(str(tmp_path / "base"), device="cpu", dtype="float32", enable_lora=True, max_lora_rank=16)
    save_file({k: v[:-1] if k.endswith("experts.lora_A.weight") else v for k, v in tensors.items()}, path)
    _refused(llm, LoRARequest("experts", 1, str(tmp_path / "experts")), "model.layers.0.mlp.experts:",
             "fit neither fused expert tensor")
    pair = {"base_model.model.model.layers.0.block_sparse_moe.experts.4.w1.lora_A.weight": torch.zeros(4, 32),
            "base_model.model.model.layers.0.block_sparse_moe.experts.4.w1.lora_B.weight": torch.zeros(48, 4)}
    save_file(pair, path)
    _refused(llm, LoRARequest("experts", 1, str(tmp_path / "experts")), "experts.4.w1", "experts are 0..3")
    assert llm.llm_engine.executor.runner.lora_manager.list_loras() == []

"""LoRA on MoE experts against PEFT in float32, on tiny random Qwen3-MoE and Mixtral bases: PEFT's
``target_parameters`` on the fused ``experts.gate_up_proj`` / ``experts.down_proj`` (how it trains
transformers 5's experts), and the same update in the per-expert spelling (``experts.N.gate_proj``,
Mixtral's ``block_sparse_moe.experts.N.w1``), each alone and mixed in one batch with base rows and a
dense-only adapter; on a q8_0 base against PEFT on the dequantized experts."""
from __future__ import annotations

import shutil

import pytest
import torch
from lora_helpers import SYNTHETIC_TOKENIZER_DIR, VOCAB
from test_lora_generate import _check, _params, _prompts

from pagedllm import LLM, LoRARequest

# family -> the per-expert spelling's module prefix and projection names
FAMILIES = {
    "qwen3_moe": ("mlp.experts", ("gate_proj", "up_proj", "down_proj")),
    "mixtral": ("block_sparse_moe.experts", ("w1", "w3", "w2")),
}


def _config(family: str):
    from transformers import MixtralConfig, Qwen3MoeConfig

    common = {"vocab_size": VOCAB, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
              "bos_token_id": 1, "eos_token_id": 2, "initializer_range": 0.1, "tie_word_embeddings": False,
              "num_experts_per_tok": 2}
    if family == "qwen3_moe":
        return Qwen3MoeConfig(intermediate_size=96, moe_intermediate_size=48, num_experts=4, head_dim=16,
                              norm_topk_prob=True, **common)
    return MixtralConfig(intermediate_size=48, num_local_experts=4, **common)


def _build_base(family: str, folder):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(family), dtype=torch.float32)
    with torch.no_grad():  # transformers leaves fused experts as torch.empty gives them
        for name, p in model.named_parameters():
            if ".experts." in name:
                p.normal_(0.0, 0.1)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(SYNTHETIC_TOKENIZER_DIR / name, folder / name)
    return folder


def _build_adapter(base, folder, r: int, alpha: float, target_modules, target_parameters, seed: int,
                   use_rslora: bool = False):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=target_modules, lora_dropout=0.0,
                        target_parameters=target_parameters, use_rslora=use_rslora)
    peft_model = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5 / p.shape[-1] ** 0.5)
    peft_model.save_pretrained(folder)
    return peft_model.eval()


def _per_expert_copy(fused, folder, family: str, num_experts: int, inter: int, hidden: int) -> None:
    """``fused``'s adapter with its expert pairs in the per-expert spelling: the same update."""
    import json

    from safetensors.torch import load_file, save_file

    prefix, (gate, up, down) = FAMILIES[family]
    shutil.copytree(fused, folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    r = config["r"]
    out = {}
    for key, value in load_file(folder / "adapter_model.safetensors").items():
        if ".experts." not in key:
            out[key] = value
            continue
        if "lora_B" in key:
            continue
        layer = key.split(".mlp.experts")[0]
        b = load_file(folder / "adapter_model.safetensors")[key.replace("lora_A", "lora_B")]
        gate_up = value.shape[1] == hidden  # A's inputs: hidden for gate_up, intermediate for down
        for e in range(num_experts):
            a_e, b_e = value[e * r:(e + 1) * r], b.reshape(b.shape[0], r, num_experts)[:, :, e]
            names = [(gate, b_e[:inter]), (up, b_e[inter:])] if gate_up else [(down, b_e)]
            for proj, b_part in names:
                out[f"{layer}.{prefix}.{e}.{proj}.lora_A.weight"] = a_e.clone()
                out[f"{layer}.{prefix}.{e}.{proj}.lora_B.weight"] = b_part.clone()
    config["target_parameters"] = None
    (folder / "adapter_config.json").write_text(json.dumps(config))
    save_file(out, folder / "adapter_model.safetensors")


@pytest.fixture(scope="module", params=list(FAMILIES))
def moe_family(request, tmp_path_factory):
    """(family, base folder, [(adapter folder, PEFT model)]): both fused tensors and q_proj; gate_up
    only with rslora; a dense-only adapter; the first in the per-expert spelling."""
    family = request.param
    root = tmp_path_factory.mktemp(f"lora_{family}")
    base = _build_base(family, root / "base")
    both = _build_adapter(base, root / "both", 4, 8, ["q_proj"], ["mlp.experts.gate_up_proj",
                                                                   "mlp.experts.down_proj"], seed=1)
    gate_up = _build_adapter(base, root / "gate_up", 8, 16, ["o_proj"], ["mlp.experts.gate_up_proj"], seed=2,
                             use_rslora=True)
    dense = _build_adapter(base, root / "dense", 4, 8, ["q_proj", "v_proj"], None, seed=3)
    config = _config(family)
    inter = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    _per_expert_copy(root / "both", root / "per_expert", family, 4, inter, config.hidden_size)
    adapters = [(root / "both", both), (root / "gate_up", gate_up), (root / "dense", dense),
                (root / "per_expert", both)]
    return family, base, adapters


def _requests(adapters) -> list[LoRARequest]:
    return [LoRARequest(folder.name, i + 1, str(folder)) for i, (folder, _) in enumerate(adapters)]


@pytest.fixture(scope="module")
def moe_engine(moe_family):
    family, base, adapters = moe_family
    llm = LLM(str(base), device="cpu", dtype="float32", enable_lora=True, max_loras=4, max_lora_rank=16,
              max_num_batched_tokens=64, block_size=8)
    yield family, llm, adapters
    del llm


def test_experts_adapter_alone(moe_engine):
    family, llm, adapters = moe_engine
    manager = llm.llm_engine.executor.runner.lora_manager
    assert manager.expert_layers  # the experts are wrapped
    prompts = _prompts(11, [13, 19])
    for request, (_, peft_model) in zip(_requests(adapters), adapters):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _params(), use_tqdm=False,
                            lora_request=request)
        for prompt, out in zip(prompts, outs):
            _check(out, prompt, peft_model, False, f"{family} {request.lora_name}")


@pytest.mark.parametrize("dense_max_rows", [256, 0], ids=["masked", "grouped"])
def test_experts_adapters_mixed_with_base_rows(moe_engine, monkeypatch, dense_max_rows):
    monkeypatch.setattr("pagedllm.lora.mapping.DENSE_MAX_ROWS", dense_max_rows)
    family, llm, adapters = moe_engine
    requests = _requests(adapters)
    loras = [requests[0], None, requests[1], requests[2], None, requests[3]]
    prompts = _prompts(12, [9, 14, 11, 8, 12, 10])
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _params(), use_tqdm=False,
                        lora_request=loras)
    peft_of = {r.lora_int_id: m for r, (_, m) in zip(requests, adapters)}
    for prompt, lora, out in zip(prompts, loras, outs):
        peft_model = peft_of[lora.lora_int_id] if lora else adapters[0][1]
        _check(out, prompt, peft_model, lora is None, f"{family} mixed {lora}")
    # a base row's tokens do not depend on the adapters beside it
    alone = llm.generate([{"prompt_token_ids": prompts[1]}], _params(), use_tqdm=False)
    assert list(alone[0].outputs[0].token_ids) == list(outs[1].outputs[0].token_ids)


def test_experts_on_a_q8_0_base(moe_family):
    """The update is a separate term beside the quantized experts' product (the codes untouched)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    family, base, adapters = moe_family
    llm = LLM(str(base), device="cpu", dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16,
              quantization="q8_0", quantization_activations="float32")
    manager = llm.llm_engine.executor.runner.lora_manager
    name, experts = next(iter(manager.expert_layers.items()))
    fmt = experts.layer.expert_formats["gate_up_proj"]
    assert fmt.name == "q8", fmt.describe()
    request = _requests(adapters)[0]
    prompts = _prompts(13, [12, 9])
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _params(), use_tqdm=False,
                        lora_request=[request, None])
    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                          adapters[0][0]).eval()
    _dequantized_into(reference, manager)
    for prompt, lora, out in zip(prompts, [request, None], outs):
        _check(out, prompt, reference, lora is None, f"{family} q8_0 {lora}")


def _dequantized_into(reference, manager) -> None:
    """The reference's base weights set to those the quantized layers and experts hold, dequantized."""
    with torch.no_grad():
        for name, target in manager.targets.items():
            fmt = manager.layers[target.layer_name]
            rows = torch.arange(target.out_offset, target.out_offset + target.out_size)
            module = reference.base_model.model.get_submodule(name)
            getattr(module, "base_layer", module).weight.copy_(fmt.base.dequantize_rows(rows).float())
        for name, experts in manager.expert_layers.items():
            module = reference.base_model.model.get_submodule(name).get_base_layer()
            for proj, fmt in experts.layer.expert_formats.items():
                if not hasattr(fmt, "qweight"):  # kept in float32 (no whole blocks): exact already
                    continue
                param = getattr(module, proj)
                for e in range(param.shape[0]):
                    param[e].copy_(fmt.qweight.expert(e).dequantize(torch.float32))

"""GGUF adapters (llama.cpp's convert_lora_to_gguf.py layout, written here with the gguf package
from a PEFT adapter): the same outputs as that PEFT folder, on a Llama base (q and k rows in
llama.cpp's rope-pair order) and a Qwen2 base (rows as they are); a GGUF file that is no LoRA
adapter, or does not fit the base, is one clear refusal with nothing loaded."""
from __future__ import annotations

import pytest
import torch
from lora_helpers import build_adapter, build_base

from pagedllm import LLM, LoRARequest, SamplingParams
from pagedllm.errors import ValidationError

_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down"}
_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _permute(rows: torch.Tensor, num_heads: int) -> torch.Tensor:
    """convert_hf_to_gguf.py's LlamaModel.permute: HF's rotate-half rows to rope pairs."""
    return rows.reshape(num_heads, 2, rows.shape[0] // num_heads // 2, *rows.shape[1:]).swapaxes(
        1, 2).reshape(rows.shape)


def write_gguf_adapter(peft_model, path, arch: str, alpha: float, general_type: str = "adapter",
                       drop: str | None = None, narrow: str | None = None, half: bool = False) -> None:
    import gguf

    config = peft_model.base_model.model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_type(general_type)
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", alpha)
    for name, param in peft_model.named_parameters():
        if "lora_" not in name:
            continue
        module = name.split(".layers.")[1].split(".lora_")[0]  # "0.self_attn.q_proj"
        layer, _, hf = module.partition(".")
        tensor = param.detach().float().clone()
        side = "a" if ".lora_A." in name else "b"
        if side == "b" and arch == "llama" and hf in ("self_attn.q_proj", "self_attn.k_proj"):
            heads = config.num_attention_heads if hf.endswith("q_proj") else config.num_key_value_heads
            tensor = _permute(tensor, heads)
        key = f"blk.{layer}.{_NAMES[hf]}.weight.lora_{side}"
        if key == narrow:
            tensor = tensor[:, :32].contiguous()
        if key != drop:
            writer.add_tensor(key, tensor.numpy().astype("float16" if half else "float32"))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def family(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"lora_gguf_{request.param}")
    base = build_base(request.param, root / "base")
    peft_model = build_adapter(base, root / "peft", 8, 16, _TARGETS, seed=3)
    write_gguf_adapter(peft_model, root / "adapter.gguf", request.param, 16.0)
    # convert_lora_to_gguf.py's default type, F16, against the PEFT weights rounded alike.
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(param.half().float())
    peft_model.save_pretrained(root / "peft16")
    write_gguf_adapter(peft_model, root / "adapter16.gguf", request.param, 16.0, half=True)
    llm = LLM(str(base), device="cpu", dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16)
    yield request.param, root, peft_model, llm
    del llm


@pytest.mark.parametrize("suffix", ["", "16"], ids=["f32", "f16"])
def test_gguf_adapter_gives_the_peft_folders_outputs(family, suffix):
    arch, root, _, llm = family
    params = SamplingParams(temperature=0.0, max_tokens=8, prompt_logprobs=0, logprobs=0, ignore_eos=True)
    prompt = {"prompt_token_ids": [1, 17, 93, 250, 31, 404, 7, 66, 12]}
    peft, from_gguf, base = llm.generate(
        [prompt] * 3, params, use_tqdm=False,
        lora_request=[LoRARequest(f"peft{suffix}", 1 + 2 * len(suffix), str(root / f"peft{suffix}")),
                      LoRARequest(f"gguf{suffix}", 2 + 2 * len(suffix), str(root / f"adapter{suffix}.gguf")),
                      None])
    assert peft.outputs[0].token_ids == from_gguf.outputs[0].token_ids, arch
    for pos in range(1, len(prompt["prompt_token_ids"])):
        tok = prompt["prompt_token_ids"][pos]
        got, want = from_gguf.prompt_logprobs[pos][tok].logprob, peft.prompt_logprobs[pos][tok].logprob
        assert abs(got - want) <= 1e-5, (arch, pos)
        # The adapter changes the output: a wrong row order or scale could not pass the above.
        assert abs(base.prompt_logprobs[pos][tok].logprob - want) > 1e-4 or pos < 2


@pytest.mark.parametrize("case", ["model_file", "missing_pair", "other_base", "truncated"])
def test_gguf_refusals_load_nothing(family, tmp_path, case):
    arch, root, peft_model, llm = family
    path = tmp_path / f"{case}.gguf"
    if case == "model_file":
        write_gguf_adapter(peft_model, path, arch, 16.0, general_type="model")
        match = "no LoRA adapter"
    elif case == "missing_pair":
        write_gguf_adapter(peft_model, path, arch, 16.0, drop="blk.1.ffn_up.weight.lora_b")
        match = r"model\.layers\.1\.mlp\.up_proj has lora_a without its pair"
    elif case == "other_base":  # A of another hidden size
        write_gguf_adapter(peft_model, path, arch, 16.0, narrow="blk.0.attn_q.weight.lora_a")
        match = r"model\.layers\.0\.self_attn\.q_proj: lora_A \(8, 32\)"
    else:
        write_gguf_adapter(peft_model, path, arch, 16.0)
        with path.open("r+b") as f:  # cut short: a truncated download
            f.truncate(path.stat().st_size // 2)
        match = "GGUF"
    manager = llm.llm_engine.executor.runner.lora_manager
    before = (dict(manager.requests), list(manager.loaded))
    with pytest.raises(ValidationError, match=match):
        llm.llm_engine.add_lora(LoRARequest(case, 9, str(path)))
    assert (dict(manager.requests), list(manager.loaded)) == before

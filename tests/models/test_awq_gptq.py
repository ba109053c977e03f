"""AWQ and GPTQ checkpoints (layers/quantization/checkpoint_formats.py) against transformers
running the same model with the dequantized float weights: the tests quantize a tiny random
model's linears themselves (random codes, zeros and fp16 scales), pack them in each format
and write the float model they stand for alongside; a folder AutoAWQ itself quantized and packed
(a committed fixture) is checked against AutoAWQ's own dequantization."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from paged_helpers import STORIES_DIR, PagedRunner, check_greedy_logprobs
from safetensors.torch import load_file, save_file
from test_model_parity import TOL, check_mixed_batch, make_hf_model, save
from transformers import LlamaConfig, Qwen2Config

from pagedllm import LLM, SamplingParams
from pagedllm.checkpoint.loader import load_model
from pagedllm.errors import UnsupportedModelError, ValidationError
from pagedllm.layers.quantization import QuantizedWeight, quantized_kernels_available
from pagedllm.layers.quantization.checkpoint_formats import CheckpointQuant, resolve_quantization

pytestmark = pytest.mark.skipif(not quantized_kernels_available(torch.device("cpu")),
                                reason="the quantized formats need pagedllm's CPU kernels")

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
AUTOAWQ_FIXTURE = Path(__file__).parent / "fixtures" / "awq_tiny"
# pagedllm's fused linears -> the checkpoint linears stacked in them, in row order
FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
               "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
# vocab 512: the demo model's tokenizer fits (the LLM test runs through it)
COMMON = dict(vocab_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, tie_word_embeddings=False)
CONFIGS = {
    32: lambda: LlamaConfig(hidden_size=64, intermediate_size=96, **COMMON),
    128: lambda: Qwen2Config(hidden_size=128, intermediate_size=256, **COMMON),  # biases on qkv
}


def _pack(nibbles: np.ndarray) -> np.ndarray:
    """[..., 8] values 0..15 -> int32 [...]: nibble i from element i."""
    words = np.zeros(nibbles.shape[:-1], np.uint32)
    for i in range(8):
        words |= nibbles[..., i].astype(np.uint32) << (4 * i)
    return words.view(np.int32)


def pack_columns(mat: np.ndarray, order) -> np.ndarray:
    """[r, c] -> [r, c / 8], nibble i of word j holding column 8 j + order[i]."""
    r, c = mat.shape
    return _pack(mat.reshape(r, c // 8, 8)[:, :, order])


def pack_rows(mat: np.ndarray) -> np.ndarray:
    """[r, c] -> [r / 8, c], nibble i of row j holding row 8 j + i (GPTQ's qweight)."""
    r, c = mat.shape
    return _pack(mat.reshape(r // 8, 8, c).transpose(0, 2, 1))


def random_groups(out_f: int, in_f: int, group: int, gen: np.random.Generator, zero_low=0):
    codes = gen.integers(0, 16, (out_f, in_f)).astype(np.uint8)
    zeros = gen.integers(zero_low, 16, (out_f, in_f // group)).astype(np.uint8)
    scales = (gen.uniform(0.005, 0.02, (out_f, in_f // group))).astype(np.float16)
    return codes, zeros, scales


def dequantized(codes, zeros, scales, group) -> torch.Tensor:
    z = np.repeat(zeros.astype(np.float32), group, axis=1)
    s = np.repeat(scales.astype(np.float32), group, axis=1)
    return torch.from_numpy((codes.astype(np.float32) - z) * s)


def _quantized_linear(tensors: dict, name: str, weight: torch.Tensor, method: str, group: int,
                      gen: np.random.Generator, fmt: str, act_order: bool) -> None:
    """Random codes, zeros and scales for the [out, in] ``weight`` (a view, overwritten with
    their dequantized values), packed into ``tensors`` as linear ``name``'s in the format."""
    out_f, in_f = weight.shape
    # GPTQ v1 stores z - 1: zeros from 1 so that it stays a nibble
    codes, zeros, scales = random_groups(out_f, in_f, group, gen,
                                         zero_low=1 if fmt == "gptq" else 0)
    weight.copy_(dequantized(codes, zeros, scales, group))
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a))  # noqa: E731
    if method == "awq":
        tensors[f"{name}.qweight"] = t(pack_columns(codes.T, AWQ_ORDER))
        tensors[f"{name}.qzeros"] = t(pack_columns(zeros.T, AWQ_ORDER))
    else:
        stored = zeros - 1 if fmt == "gptq" else zeros
        tensors[f"{name}.qweight"] = t(pack_rows(codes.T))
        tensors[f"{name}.qzeros"] = t(pack_columns(stored.T, np.arange(8)))
        g_idx = np.arange(in_f) // group
        if act_order:
            g_idx = gen.permutation(g_idx)
        tensors[f"{name}.g_idx"] = t(g_idx.astype(np.int32))
    tensors[f"{name}.scales"] = t(scales.T)


def build_quantized(method: str, group: int, folder: Path, fmt: str = "gptq", seed: int = 0,
                    act_order: bool = False, config=None):
    """(the HF model holding the dequantized weights, the quantized checkpoint folder). A MoE
    ``config``'s experts are quantized too, one checkpoint linear per expert and projection
    (``experts.E.gate_proj``...), as AutoAWQ and GPTQModel write them."""
    hf_model = make_hf_model(config or CONFIGS[group](), seed)
    gen = np.random.default_rng(seed)
    tensors = {}
    quantized = set()
    with torch.no_grad():
        for name, module in hf_model.named_modules():
            if name.endswith(PROJECTIONS):
                _quantized_linear(tensors, name, module.weight, method, group, gen, fmt, act_order)
                quantized.add(f"{name}.weight")
        for name, param in hf_model.named_parameters():
            prefix = name.removesuffix(".gate_up_proj").removesuffix(".down_proj")
            if prefix == name or not prefix.endswith("mlp.experts"):
                continue
            for e in range(param.shape[0]):  # transformers' fused [E, 2I, H] / [E, H, I]
                if name.endswith("down_proj"):
                    parts = {"down_proj": param[e]}
                else:
                    gate, up = param[e].chunk(2)
                    parts = {"gate_proj": gate, "up_proj": up}
                for proj, weight in parts.items():
                    _quantized_linear(tensors, f"{prefix}.{e}.{proj}", weight, method, group,
                                      gen, fmt, act_order)
            quantized.add(name)
    for name, value in hf_model.state_dict().items():
        if name not in quantized:
            tensors[name] = value.contiguous()
    folder.mkdir(parents=True)
    save_file(tensors, folder / "model.safetensors")
    config = hf_model.config.to_dict()
    config["quantization_config"] = (
        {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
         "version": "gemm"} if method == "awq" else
        {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False, "sym": False,
         "checkpoint_format": fmt})
    (folder / "config.json").write_text(json.dumps(config))
    for name in TOKENIZER_FILES:
        shutil.copy(STORIES_DIR / "hf" / name, folder / name)
    return hf_model, folder


def _edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"].update(changes)
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("method,fmt", [("awq", None), ("gptq", "gptq"), ("gptq", "gptq_v2")])
@pytest.mark.parametrize("group", [32, 128])
def test_mixed_batch_matches_transformers(method, fmt, group, tmp_path):
    hf_model, folder = build_quantized(method, group, tmp_path / "q", fmt or "gptq")
    model, _ = load_model(str(folder), torch.float32, torch.device("cpu"))
    layers = [m for n, m in model.named_modules() if n.endswith(("qkv_proj", "o_proj",
                                                                 "gate_up_proj", "down_proj"))]
    assert layers and all(m.weight is None and m.weight_format.qweight.format == "q4" for m in layers)
    assert all(m.weight_format.qweight.group_size == group for m in layers)
    check_mixed_batch(model, hf_model, PagedRunner(model, block_size=4))


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_moe_experts_stay_quantized_and_match_transformers(method, tmp_path):
    """A Qwen3-MoE checkpoint with every expert quantized per expert: the experts are held as
    stacked q4 weights (no float matrix), and a mixed batch matches transformers on the
    dequantized weights."""
    from transformers import Qwen3MoeConfig

    from pagedllm.layers import FusedMoE

    config = Qwen3MoeConfig(hidden_size=64, intermediate_size=96, moe_intermediate_size=64,
                            num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
                            head_dim=16, **COMMON)
    config._experts_implementation = "eager"
    hf_model, folder = build_quantized(method, 32, tmp_path / "q", config=config)
    model, _ = load_model(str(folder), torch.float32, torch.device("cpu"))
    experts = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert experts and all(m.gate_up_proj is None and m.down_proj is None for m in experts)
    assert all([f.qweight.format for f in m.expert_formats.values()] == ["q4"] * 2 for m in experts)
    assert all(m.expert_formats["down_proj"].qweight.codes.shape[0] == 4 for m in experts)
    check_mixed_batch(model, hf_model, PagedRunner(model, block_size=4))


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_llm_chunked_prefill_and_prefix_caching(method, tmp_path):
    hf_model, folder = build_quantized(method, 32, tmp_path / "q", seed=1)
    llm = LLM(str(folder), device="cpu", enforce_eager=True, kv_cache_memory_bytes=1 << 20,
              max_num_batched_tokens=8, enable_prefix_caching=True, block_size=4)
    # auto keeps AWQ/GPTQ on the exact path (float32 activations), which this test compares
    assert set(llm.llm_engine.executor.runner.activations.values()) == {"float32"}
    rng = np.random.default_rng(3)
    shared = rng.integers(3, 512, 13).tolist()
    prompts = [shared + rng.integers(3, 512, n).tolist() for n in (2, 5)] + [shared]
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=0, ignore_eos=True)
    for _ in range(2):  # the second round hits the prefix cache
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        check_greedy_logprobs(hf_model, prompts, outputs)


def test_awq_nibble_order():
    """AWQ interleaves the eight columns of a word (0, 2, 4, 6, 1, 3, 5, 7): reading it in plain
    order would scramble them."""
    gen = np.random.default_rng(0)
    codes, zeros, scales = random_groups(16, 64, 32, gen)
    quant = CheckpointQuant("awq", 32, False)
    tensors = {"qweight": pack_columns(codes.T, AWQ_ORDER),
               "qzeros": pack_columns(zeros.T, AWQ_ORDER), "scales": scales.T.copy()}
    got, s, offsets = quant.unpack("layer", tensors)
    np.testing.assert_array_equal(got, codes)
    np.testing.assert_array_equal(offsets, -zeros.astype(np.float32) * scales.astype(np.float32))
    plain = dict(tensors, qweight=pack_columns(codes.T, np.arange(8)))
    assert not np.array_equal(quant.unpack("layer", plain)[0], codes)
    weight = QuantizedWeight.from_q4(got, s, offsets, 32).dequantize()
    torch.testing.assert_close(weight, dequantized(codes, zeros, scales, 32), rtol=0, atol=1e-6)


def test_gptq_act_order_refused(tmp_path):
    _, folder = build_quantized("gptq", 32, tmp_path / "perm", act_order=True)
    with pytest.raises(UnsupportedModelError, match="act-order .* not supported"):
        load_model(str(folder), torch.float32, torch.device("cpu"))
    _edit_config(folder, desc_act=True)
    with pytest.raises(UnsupportedModelError, match="desc_act=true.* not supported"):
        load_model(str(folder), torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("changes,message", [
    ({"bits": 8}, "8 bits is not supported; supported: 4 bits"),
    ({"quant_method": "bitsandbytes"}, "'bitsandbytes' is not supported; supported checkpoint "
                                       "formats: awq, gptq"),
    ({"checkpoint_format": "marlin"}, "'marlin' is not supported"),
])
def test_bad_quantization_config(tmp_path, changes, message):
    _, folder = build_quantized("gptq", 32, tmp_path / "bad")
    _edit_config(folder, **changes)
    with pytest.raises(UnsupportedModelError, match=message):
        load_model(str(folder), torch.float32, torch.device("cpu"))


def test_quantization_flag_must_match_the_checkpoint(tmp_path):
    _, folder = build_quantized("awq", 32, tmp_path / "awq")
    with pytest.raises(ValidationError, match="quantization gptq does not match the checkpoint "
                                              r"\(awq\); supported: awq, gptq, gguf, mxfp4, q8_0, q4_0"):
        load_model(str(folder), torch.float32, torch.device("cpu"), "gptq")
    with pytest.raises(ValidationError, match="already awq"):
        load_model(str(folder), torch.float32, torch.device("cpu"), "q8_0")
    with pytest.raises(ValidationError, match="'int3' is not supported; supported: awq"):
        LLM(str(folder), device="cpu", quantization="int3")
    plain = save(make_hf_model(CONFIGS[32]()), tmp_path / "plain")
    with pytest.raises(ValidationError, match="does not match the checkpoint .not quantized."):
        load_model(plain, torch.float32, torch.device("cpu"), "awq")
    # a .gguf path is gguf; unset, each checkpoint says what it is
    assert resolve_quantization("gguf", None, is_gguf=True) == "gguf"
    with pytest.raises(ValidationError, match=r"awq does not match the checkpoint \(gguf\)"):
        resolve_quantization("awq", None, is_gguf=True)
    assert resolve_quantization(None, json.loads((folder / "config.json").read_text()),
                                is_gguf=False) == "awq"
    assert resolve_quantization(None, {}, is_gguf=False) is None


@pytest.mark.slow  # two worker processes per model load
def test_tensor_parallel_splits_whole_groups(tmp_path, monkeypatch):
    """tp=2 over mp workers: each rank reads its rows (q, k, v, gate, up) or its group-aligned
    input columns (o_proj, down_proj); a split that would cut a group is refused at load."""
    from pagedllm.errors import ModelLoadError

    monkeypatch.setitem(CONFIGS, 32, lambda: LlamaConfig(hidden_size=128, intermediate_size=128,
                                                         **COMMON))
    hf_model, folder = build_quantized("gptq", 32, tmp_path / "even")
    llm = LLM(str(folder), device="cpu", enforce_eager=True, kv_cache_memory_bytes=1 << 20,
              tensor_parallel_size=2)
    prompt = list(range(5, 20))
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    check_greedy_logprobs(hf_model, [prompt], outputs)
    del llm
    # down_proj's 96 inputs over two ranks: 48 each, which cuts a group of 32
    monkeypatch.setitem(CONFIGS, 32, lambda: LlamaConfig(hidden_size=64, intermediate_size=96,
                                                         **COMMON))
    _, folder = build_quantized("awq", 32, tmp_path / "cut")
    with pytest.raises(ModelLoadError, match="cuts a quantization group of 32"):
        LLM(str(folder), device="cpu", enforce_eager=True, kv_cache_memory_bytes=1 << 20,
            tensor_parallel_size=2)


def test_autoawq_folder_matches_its_own_dequantization():
    """A folder AutoAWQ quantized and packed itself (calibrated scales folded into the norms,
    GEMM packing), not the tests' packer, committed with AutoAWQ's dequantize_gemm of every
    linear and transformers' logits on those weights (fixtures/make_awq_fixture.py): pagedllm's
    weights dequantize to AutoAWQ's, and its paged logits match transformers'."""
    reference = load_file(AUTOAWQ_FIXTURE / "reference.safetensors")
    model, _ = load_model(str(AUTOAWQ_FIXTURE), torch.float32, torch.device("cpu"))
    checked = set()
    for name, module in model.named_modules():
        prefix, _, fused = name.rpartition(".")
        if fused not in FUSED_PARTS:
            continue
        assert module.weight is None and module.weight_format.qweight.group_size == 32
        weight = module.weight_format.qweight.dequantize()  # [out, in], the fused parts stacked by rows
        sizes = getattr(module, "output_sizes", [weight.shape[0]])
        for part, rows in zip(FUSED_PARTS[fused], weight.split(sizes), strict=True):
            key = f"{prefix}.{part}.weight"
            torch.testing.assert_close(rows, reference[key], rtol=0, atol=1e-6,
                                       msg=lambda m, key=key: f"{key}: {m}")
            checked.add(key)
    assert checked == {key for key in reference if key.endswith(".weight")}
    ids = reference["input_ids"].tolist()
    runner = PagedRunner(model, block_size=4)
    # a prefill, a chunk over the cached prefix, a decode
    got = torch.cat([runner.step([("r", ids[a:b])])["r"] for a, b in ((0, 10), (10, 23), (23, 24))])
    expected = torch.log_softmax(reference["logits"], dim=-1)
    torch.testing.assert_close(got, expected, rtol=0, atol=TOL)

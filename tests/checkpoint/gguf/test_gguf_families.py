"""GGUF files of the families beyond Llama/Qwen: tiny random transformers models written as
llama.cpp's converter writes them (its architecture names, tensor names, stacked experts
``[E, out, in]``, Gemma's norms stored as ``w + 1``, Phi-3's fused qkv and gate_up, Llama-style
q/k row permutation for Mixtral and Granite, the family's metadata keys), then loaded and run
through the paged cache: greedy ids equal and log-probs within 1e-4 of transformers running
the values the file holds (the weights rounded through the file's type, in HF layout)."""
from __future__ import annotations

import copy

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf_helpers import _add_tensor, _write_metadata, permute
from paged_helpers import randomize_
from test_gguf import _check_greedy_and_logprobs
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    GraniteConfig,
    MixtralConfig,
    Olmo2Config,
    OlmoeConfig,
    Phi3Config,
    Qwen2MoeConfig,
    Qwen3MoeConfig,
)

from pagedllm.checkpoint.gguf import read_gguf_config
from pagedllm.checkpoint.loader import load_model
from pagedllm.errors import UnsupportedModelError
from pagedllm.layers import FusedMoE
from pagedllm.layers.quantization import quantized_kernels_available
from pagedllm.layers.weight_format import Quantized

CPU = torch.device("cpu")
V = gguf.GGUFValueType
DIMS = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
MOE = dict(DIMS, intermediate_size=256, tie_word_embeddings=False)
HEAD_DIM = 64
WINDOW = 6  # shorter than the test's 20 tokens: the window slides


def _longrope(partial: float) -> dict:
    half = int(HEAD_DIM * partial) // 2
    return {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": partial,
            "short_factor": [1.0 + 0.1 * i for i in range(half)],
            "long_factor": [2.0 + 0.5 * i for i in range(half)]}


# name -> (GGUF architecture, transformers config, HF architecture, extra metadata)
CASES = {
    "gemma2": lambda: ("gemma2", Gemma2Config(
        **DIMS, head_dim=HEAD_DIM, query_pre_attn_scalar=HEAD_DIM, sliding_window=WINDOW,
        attn_logit_softcapping=1.5, final_logit_softcapping=2.0), "Gemma2ForCausalLM",
        {"attn_logit_softcapping": (1.5, V.FLOAT32), "final_logit_softcapping": (2.0, V.FLOAT32),
         "attention.sliding_window": (WINDOW, V.UINT32)}),
    # the window pattern as the file lists it; local layers rotate with rope.freq_base_swa, the
    # global ones with rope.freq_base and the linear scaling
    "gemma3": lambda: ("gemma3", Gemma3TextConfig(
        **DIMS, head_dim=HEAD_DIM, query_pre_attn_scalar=HEAD_DIM, sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"], final_logit_softcapping=None,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                         "full_attention": {"rope_type": "linear", "factor": 4.0,
                                            "rope_theta": 10000.0}}), "Gemma3ForCausalLM",
        {"attention.sliding_window": (WINDOW, V.UINT32), "rope.freq_base_swa": (10.0, V.FLOAT32),
         "rope.scaling.type": ("linear", V.STRING), "rope.scaling.factor": (4.0, V.FLOAT32),
         "attention.sliding_window_pattern": ([True, False], V.ARRAY)}),
    # partial rotary and longrope (short factors: within the original context of 32)
    "phi3": lambda: ("phi3", Phi3Config(
        **DIMS, tie_word_embeddings=False, pad_token_id=0, original_max_position_embeddings=32,
        rope_parameters=_longrope(0.75)), "Phi3ForCausalLM",
        {"rope.dimension_count": (48, V.UINT32), "attention.sliding_window": (0, V.UINT32),
         "rope.scaling.original_context_length": (32, V.UINT32)}),
    "granite": lambda: ("granite", GraniteConfig(
        **DIMS, embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.3,
        logits_scaling=2.5, tie_word_embeddings=False), "GraniteForCausalLM",
        {"attention.scale": (0.3, V.FLOAT32), "embedding_scale": (3.0, V.FLOAT32),
         "residual_scale": (0.5, V.FLOAT32), "logit_scale": (2.5, V.FLOAT32)}),
    "olmo2": lambda: ("olmo2", Olmo2Config(**DIMS, tie_word_embeddings=False), "Olmo2ForCausalLM",
                      {}),
    "qwen2moe": lambda: ("qwen2moe", Qwen2MoeConfig(
        **MOE, moe_intermediate_size=256, shared_expert_intermediate_size=512, num_experts=4,
        num_experts_per_tok=2, norm_topk_prob=False), "Qwen2MoeForCausalLM",
        {"expert_count": (4, V.UINT32), "expert_used_count": (2, V.UINT32),
         "expert_feed_forward_length": (256, V.UINT32),
         "expert_shared_feed_forward_length": (512, V.UINT32)}),
    "qwen3moe": lambda: ("qwen3moe", Qwen3MoeConfig(
        **MOE, moe_intermediate_size=256, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=True, head_dim=HEAD_DIM), "Qwen3MoeForCausalLM",
        {"expert_count": (4, V.UINT32), "expert_used_count": (2, V.UINT32),
         "expert_feed_forward_length": (256, V.UINT32)}),
    "mixtral": lambda: ("llama", MixtralConfig(**MOE, num_local_experts=4, num_experts_per_tok=2),
                        "MixtralForCausalLM",
                        {"expert_count": (4, V.UINT32), "expert_used_count": (2, V.UINT32)}),
    "olmoe": lambda: ("olmoe", OlmoeConfig(**MOE, num_experts=4, num_experts_per_tok=2,
                                           pad_token_id=None, eos_token_id=None),
                      "OlmoeForCausalLM",
                      {"expert_count": (4, V.UINT32), "expert_used_count": (2, V.UINT32)}),
}

_NAMES = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.qkv_proj": "attn_qkv",
          "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
          "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp",
          "mlp.experts.down_proj": "ffn_down_exps", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
          "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
          "mlp.shared_expert.down_proj": "ffn_down_shexp",
          "post_feedforward_layernorm": "post_ffw_norm"}


def _gguf_names(arch: str, hf_name: str, w: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """The converter's tensors for one HF tensor (an experts' gate_up splits in two)."""
    glob = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}
    if hf_name in glob:
        return [(glob[hf_name], w)]
    _, _, layer, rest = hf_name.split(".", 3)
    module, _, attr = rest.rpartition(".") if rest.endswith((".weight", ".bias")) else (rest, "", "weight")
    if module == "mlp.experts.gate_up_proj":
        half = w.shape[1] // 2
        return [(f"blk.{layer}.ffn_gate_exps.weight", w[:, :half]),
                (f"blk.{layer}.ffn_up_exps.weight", w[:, half:])]
    gemma_like = arch in ("gemma2", "gemma3", "olmo2")
    names = {**_NAMES, "post_attention_layernorm": "post_attention_norm" if gemma_like else "ffn_norm",
             "pre_feedforward_layernorm": "ffn_norm"}
    return [(f"blk.{layer}.{names[module]}.{attr}", w)]


_GGUF_ARCHS = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}


def _types(spec: str):
    def pick(name: str, shape: tuple) -> int:
        if len(shape) == 1 or "ffn_gate_inp" in name:  # norms, biases, routers stay F32 (llama.cpp)
            return T.F32
        return {"f32": T.F32, "f16": T.F16, "q8_0": T.Q8_0, "q4_0": T.Q4_0}[spec]
    return pick


def _stored(w: np.ndarray, type_id: int) -> np.ndarray:
    """What a reader of the file gets back for ``w`` stored as ``type_id``."""
    if type_id == T.F32:
        return w
    if type_id == T.F16:
        return w.astype(np.float16).astype(np.float32)
    return gguf.quants.dequantize(gguf.quants.quantize(w, type_id), type_id)


def write_family_gguf(path, hf_model, arch: str, spec: str, metadata: dict,
                      general_architecture: str | None = None):
    """``(path, reference)``: the model as the converter writes it, and transformers' model
    holding the values the file holds (``general_architecture``: another name in the file)."""
    cfg, pick = hf_model.config, _types(spec)
    reference = copy.deepcopy(hf_model)
    ref_params = dict(reference.named_parameters())
    # llama.cpp's own HF -> GGUF name table (gguf-py's): the names written here must be its
    names_map = gguf.get_tensor_name_map(_GGUF_ARCHS.get(arch, gguf.MODEL_ARCH.LLAMA),
                                         cfg.num_hidden_layers)
    writer = gguf.GGUFWriter(path, general_architecture or arch)
    _write_metadata(writer, cfg, arch, HEAD_DIM, False,
                    {f"{arch}.{k}": v for k, v in metadata.items()})
    for name, value in hf_model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        w = value.detach().float().numpy()
        stored_hf = []
        for g, part in _gguf_names(arch, name, w):
            if "_exps." not in g:  # the stacked experts are named after the converter merges them
                assert names_map.get_name(name, try_suffixes=(".weight", ".bias")) == g, name
            t = pick(g, part.shape)
            stored_hf.append(_stored(np.ascontiguousarray(part), t))
            if arch in ("gemma2", "gemma3") and g.endswith("norm.weight"):
                part = part + 1  # the converter's Gemma norm convention
            if arch in ("llama", "granite") and (".attn_q." in g or ".attn_k." in g):
                part = permute(part, cfg.num_attention_heads if ".attn_q." in g
                               else cfg.num_key_value_heads)
            _add_tensor(writer, g, np.ascontiguousarray(part), t)
        with torch.no_grad():
            ref_params[name].copy_(torch.from_numpy(np.concatenate(stored_hf, axis=1)
                                                    if len(stored_hf) > 1 else stored_hf[0]))
    if arch == "phi3":  # llama.cpp's longrope: the factors as tensors
        rope = cfg.rope_parameters
        for kind in ("long", "short"):
            writer.add_tensor(f"rope_factors_{kind}.weight",
                              np.asarray(rope[f"{kind}_factor"], dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, reference


def _hf_model(config, architecture: str):
    config.architectures = [architecture]
    if hasattr(config, "num_experts_per_tok"):
        config._experts_implementation = "eager"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                             attn_implementation="eager").eval()
    randomize_(model)
    return model


RUNS = [("gemma2", "q8_0"), ("gemma3", "f16"), ("phi3", "q8_0"), ("granite", "q8_0"),
        ("olmo2", "f32"), ("qwen2moe", "q8_0"), ("qwen3moe", "f16"), ("mixtral", "q4_0"),
        ("olmoe", "f32")]


@pytest.mark.parametrize("name,spec", RUNS, ids=[f"{n}-{s}" for n, s in RUNS])
def test_family_gguf_matches_transformers(name, spec, tmp_path):
    arch, config, architecture, metadata = CASES[name]()
    hf_model = _hf_model(config, architecture)
    path, reference = write_family_gguf(tmp_path / "m.gguf", hf_model, arch, spec, metadata)
    model, loaded = load_model(str(path), torch.float32, CPU)
    assert loaded["architectures"] == [architecture]
    _check_greedy_and_logprobs(model, reference)
    linears = [m for n, m in model.named_modules()
               if n.endswith(("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))]
    if spec in ("q8_0", "q4_0") and quantized_kernels_available(CPU):
        # the linears keep the file's quantized weight, fused in the file (Phi-3) or not
        assert linears and all(isinstance(m.weight_format, Quantized) and m.weight is None
                               for m in linears)
        # and so do the stacked experts: no float matrix of theirs is ever allocated
        held = {"q8_0": "q8", "q4_0": "q4"}[spec]
        for m in model.modules():
            if isinstance(m, FusedMoE):
                assert m.gate_up_proj is None and m.down_proj is None
                assert [f.qweight.format for f in m.expert_formats.values()] == [held] * 2
                for q in (f.qweight for f in m.expert_formats.values()):  # the format's size, no more
                    rows = -(-q.out_features // 64) * 64  # whole panels
                    # codes, then the file's fp16 scales (and Q4_0's offsets, -8 d)
                    per_weight = {"q8": 1 + 2 / 32, "q4": 0.5 + 4 / 32}[held]
                    assert q.nbytes == m.num_experts * rows * q.in_features * per_weight


def test_family_metadata_becomes_the_config(tmp_path):
    arch, config, architecture, metadata = CASES["gemma3"]()
    path, _ = write_family_gguf(tmp_path / "g.gguf", _hf_model(config, architecture), arch, "f32",
                                metadata)
    gemma3 = read_gguf_config(path)
    assert gemma3 == {**gemma3, "architectures": ["Gemma3ForCausalLM"], "sliding_window": WINDOW,
                      "layer_types": ["sliding_attention", "full_attention"],
                      "rope_local_base_freq": 10.0, "query_pre_attn_scalar": HEAD_DIM,
                      "rope_scaling": {"rope_type": "linear", "factor": 4.0},
                      "hidden_activation": "gelu_pytorch_tanh"}
    arch, config, architecture, metadata = CASES["qwen2moe"]()
    path, _ = write_family_gguf(tmp_path / "q.gguf", _hf_model(config, architecture), arch, "f32",
                                metadata)
    moe = read_gguf_config(path)
    assert moe == {**moe, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 256,
                   "shared_expert_intermediate_size": 512, "norm_topk_prob": False, "qkv_bias": True}


def test_unsupported_architecture_is_one_line(tmp_path):
    arch, config, architecture, metadata = CASES["olmo2"]()
    path, _ = write_family_gguf(tmp_path / "m.gguf", _hf_model(config, architecture), arch, "f32",
                                metadata, general_architecture="starcoder2")
    with pytest.raises(UnsupportedModelError,
                       match=r"'starcoder2' is not supported; supported: bert, gemma2, gemma3, granite, "
                             r"llama, nomic-bert, olmo2, olmoe, phi3, qwen2, qwen2moe, qwen3, qwen3moe$"):
        load_model(str(path), torch.float32, CPU)


TP_RUNS = [("gemma2", "q8_0"), ("phi3", "q8_0"), ("olmo2", "f32"), ("qwen2moe", "q8_0")]
TP_TOKENS = [1, 5, 95, 0, 17, 48, 2, 18, 9, 60, 33]


def _tp_logits(path: str) -> list:
    model, _ = load_model(path, torch.float32, CPU)
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(TP_TOKENS),
                                          torch.arange(len(TP_TOKENS)))).tolist()


def _tp_rank(rank: int, port: int, paths: list[str], queue) -> None:
    from pagedllm.distributed.launch import DistributedInit
    from pagedllm.distributed.parallel_state import destroy_distributed, init_distributed

    torch.set_num_threads(1)
    init_distributed(DistributedInit(rank, 2, "127.0.0.1", port, "cpu", rank, 2, timeout_s=120))
    queue.put((rank, [_tp_logits(p) for p in paths]))
    destroy_distributed()


@pytest.mark.slow  # two spawned ranks import torch and transformers, then load four models
def test_two_ranks_compute_the_unsharded_logits(tmp_path):
    """Each rank reads its rows of the file's tensors (quantized ones stay quantized; Phi-3's
    fused and the stacked experts split per rank after dequantizing): the unsharded logits."""
    from rank_processes import run_on_ranks

    paths = []
    for name, spec in TP_RUNS:
        arch, config, architecture, metadata = CASES[name]()
        path, _ = write_family_gguf(tmp_path / f"{name}.gguf", _hf_model(config, architecture),
                                    arch, spec, metadata)
        paths.append(str(path))
    want = [_tp_logits(p) for p in paths]
    results = run_on_ranks(_tp_rank, (paths,), timeout=300)
    for rank in (0, 1):
        for (name, _), got, ref in zip(TP_RUNS, results[rank], want):
            torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-5, atol=1e-5,
                                       msg=name)

"""GPT-OSS against transformers' GptOssForCausalLM on a tiny random model (float32): attention
sinks, alternating sliding-window/full layers, yarn rope, the biased top-k-then-softmax router,
biased experts with the clamped SwiGLU in the fused transposed/interleaved layout; MXFP4
checkpoints against transformers' own dequantizer and loader; the tensor-parallel sizes a
GPT-OSS config allows."""
from __future__ import annotations

import json

import pytest
import torch
from paged_helpers import PagedRunner, check_llm_greedy_with_prefix_hit, hf_log_probs
from safetensors.torch import load_file, save_file
from test_model_parity import check_mixed_batch, make_hf_model, save
from transformers import AutoModelForCausalLM, GptOssConfig, Mxfp4Config

from pagedllm.checkpoint.loader import load_model
from pagedllm.distributed.tp_sizes import check_tensor_parallel_size, valid_tensor_parallel_sizes
from pagedllm.errors import ValidationError
from pagedllm.layers import FusedMoE
from pagedllm.layers.quantization.mxfp4 import dequantize_mxfp4
from pagedllm.weight_plan.plan import plan_weights


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_gpt_oss(vocab_size: int = 96, intermediate_size: int = 32):
    # Layer 0 sliding (window 4, well inside the test sequences), layer 1 full; yarn rope as
    # the real model's (truncate false) scaled to a 256-token context; a small swiglu_limit so
    # the clamps act.
    rope = dict(rope_type="yarn", rope_theta=150000.0, factor=4.0, beta_fast=32.0, beta_slow=1.0,
                truncate=False, original_max_position_embeddings=64)
    config = GptOssConfig(vocab_size=vocab_size, hidden_size=64,
                          intermediate_size=intermediate_size, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                          num_experts_per_tok=2, sliding_window=4, max_position_embeddings=256,
                          rope_parameters=rope,
                          swiglu_limit=1.0, tie_word_embeddings=False, pad_token_id=0,
                          eos_token_id=None, attn_implementation="eager",
                          experts_implementation="eager")
    hf_model = make_hf_model(config)
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            if name.endswith("mlp.router.weight"):
                param.mul_(8.0)  # top-k margins far above float32 rounding
            elif name.endswith("self_attn.sinks"):
                param.mul_(15.0)  # sinks ~N(0, 1.5): they take a real share of the softmax
    return hf_model


def test_mixed_flat_batch_matches_transformers(tmp_path):
    hf_model = make_gpt_oss()
    saved = load_file(save(hf_model, tmp_path) + "/model.safetensors")
    # transformers 5 writes the experts fused, transposed: [E, H, 2I] and [E, I, H].
    assert saved["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 64, 64)
    assert saved["model.layers.0.mlp.experts.down_proj"].shape == (4, 32, 64)
    model, config = load_model(str(tmp_path), torch.float32, torch.device("cpu"))
    plan_weights(model, config, torch.device("cpu"), "float32")  # experts and routers on the kernels
    attns = [layer.self_attn.attn for layer in model.model.layers]
    assert [a.sliding_window for a in attns] == [4, None]
    assert all(torch.equal(a.sinks, saved[f"model.layers.{i}.self_attn.sinks"])
               for i, a in enumerate(attns))
    assert all(isinstance(layer.mlp.experts, FusedMoE) for layer in model.model.layers)
    check_mixed_batch(model, hf_model, PagedRunner(model, block_size=4))
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 96, (20,), generator=gen).tolist()
    with torch.inference_mode():
        ours = model.compute_logits(model(torch.tensor(ids), torch.arange(20)))
    ref = hf_log_probs(hf_model, ids)
    assert ours.argmax(-1).tolist() == ref.argmax(-1).tolist()
    assert (torch.log_softmax(ours, -1) - ref).abs().max().item() < 1e-4


def test_llm_greedy_with_chunked_prefill_window_edge_and_prefix_caching(tmp_path):
    """The whole engine: prefills chunked by a 16-token budget across the 4-token window's edge
    (chunks start mid-window), two prompts sharing 16 tokens of prefix (a prefix-cache hit),
    every greedy continuation equal to transformers' generate."""
    hf_model = make_gpt_oss(vocab_size=32000)
    folder = tmp_path / "gpt_oss"
    save(hf_model, folder)
    check_llm_greedy_with_prefix_hit(hf_model, folder, last_prompt_len=23)


def _pack_mxfp4(codes: torch.Tensor, exponents: torch.Tensor):
    """Known e2m1 codes ``[..., G * 32]`` (0..15) and scale exponents ``[..., G]`` -> the
    checkpoint's (blocks, scales); what they stand for is transformers' to say."""
    pairs = codes.to(torch.uint8).view(*codes.shape[:-1], -1, 16, 2)
    blocks = pairs[..., 0] | (pairs[..., 1] << 4)  # the low nibble is the earlier value
    return blocks, (exponents + 127).to(torch.uint8)


def hf_dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """transformers' MXFP4 dequantizer (the one its GPT-OSS loader runs), ``[..., G, 16]`` ->
    ``[..., G * 32]``: it hands back [E, in, rows] for the experts, so the last two axes swap back."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    return convert_moe_packed_tensors(blocks, scales, dtype=dtype).transpose(1, 2)


def test_mxfp4_dequantization_matches_transformers():
    # Every code in every position, exponents from tiny to large; one hand-made byte as well.
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (3, 5, 2 * 32), generator=gen)
    codes[0, 0, :16] = torch.arange(16)
    exponents = torch.randint(-20, 20, (3, 5, 2), generator=gen)
    blocks, scales = _pack_mxfp4(codes, exponents)
    assert blocks.shape == (3, 5, 2, 16) and scales.shape == (3, 5, 2)
    for dtype in (torch.float32, torch.bfloat16):
        got = dequantize_mxfp4(blocks, scales, dtype, rows_per_chunk=4)
        want = hf_dequantize_mxfp4(blocks, scales, dtype)
        assert got.dtype == dtype and got.shape == want.shape == (3, 5, 64)
        assert torch.equal(got, want)
    # 0x2F: low nibble 15 (-6.0) first, high nibble 2 (1.0); scale 2 ** (129 - 127) = 4.
    one = dequantize_mxfp4(torch.full((1, 16), 0x2F, dtype=torch.uint8),
                           torch.tensor([129], dtype=torch.uint8), torch.float32)
    assert one.shape == (32,) and one[:2].tolist() == [-24.0, 4.0]


def save_mxfp4(hf_model, folder) -> str:
    """Save ``hf_model`` as the Hub spells GPT-OSS: experts as ``*_blocks``/``*_scales``
    ``[E, rows, in / 32(, 16)]`` (rows: gate/up interleaved, as the float layout's columns)
    under quant_method mxfp4, from random codes. The reference model is transformers reading
    this folder back (``load_hf_mxfp4``), not ``hf_model``."""
    gen = torch.Generator().manual_seed(3)
    state = {k: v.contiguous() for k, v in hf_model.state_dict().items()}
    for name in [k for k in state if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        rows_first = state.pop(name).transpose(1, 2)  # [E, rows, in]
        codes = torch.randint(0, 16, rows_first.shape, generator=gen)
        exponents = torch.randint(-6, -2, (*rows_first.shape[:-1], rows_first.shape[-1] // 32),
                                  generator=gen)
        state[name + "_blocks"], state[name + "_scales"] = _pack_mxfp4(codes, exponents)
    save(hf_model, folder)  # config.json
    save_file(state, str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def load_hf_mxfp4(folder: str):
    """transformers' GptOssForCausalLM reading the MXFP4 folder, its experts dequantized to
    float32 by transformers' own loader (no triton kernels on CPU)."""
    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, quantization_config=Mxfp4Config(dequantize=True),
        attn_implementation="eager", experts_implementation="eager").eval()
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.dtype == torch.float32, "transformers kept the experts packed"
    return model


def test_mxfp4_checkpoint_loads_as_the_dequantized_model(tmp_path):
    folder = save_mxfp4(make_gpt_oss(), tmp_path)
    model, config = load_model(folder, torch.float32, torch.device("cpu"))
    experts = model.model.layers[0].mlp.experts
    assert experts.weight_format == "mxfp4" and not hasattr(experts, "gate_up_proj_blocks")
    plan_weights(model, config, torch.device("cpu"), "float32")
    check_mixed_batch(model, load_hf_mxfp4(folder), PagedRunner(model, block_size=4))


def test_quantization_mxfp4_is_accepted_for_mxfp4_checkpoints_only(tmp_path):
    """``quantization="mxfp4"`` (``-q mxfp4``) names what an MXFP4 checkpoint is: accepted for
    one (the same model as leaving it unset), refused in one line for a float checkpoint."""
    from pagedllm.config import ModelConfig
    from pagedllm.entrypoints.cli import engine_kwargs, make_parser

    folder = save_mxfp4(make_gpt_oss(), tmp_path / "mxfp4")
    model, _ = load_model(folder, torch.float32, torch.device("cpu"), quantization="mxfp4")
    check_mixed_batch(model, load_hf_mxfp4(folder), PagedRunner(model, block_size=4))
    assert ModelConfig(model=folder, quantization="mxfp4").quantization == "mxfp4"
    args = make_parser().parse_args(["serve", folder, "-q", "mxfp4"])
    assert engine_kwargs(args)["quantization"] == "mxfp4"
    with pytest.raises(ValidationError, match=r"quantization mxfp4 does not match the checkpoint "
                                              r"\(not quantized\)"):
        load_model(save(make_gpt_oss(), tmp_path / "float"), torch.float32, torch.device("cpu"),
                   quantization="mxfp4")


TP_TOKENS = [1, 5, 36, 0, 17, 35, 2, 18, 9, 77, 50, 3, 4]


def _tp_logits(folder: str) -> list:
    model, _ = load_model(folder, torch.float32, torch.device("cpu"))
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(TP_TOKENS),
                                          torch.arange(len(TP_TOKENS)))).tolist()


def _tp_rank(rank: int, port: int, folders: list[str], queue) -> None:
    from pagedllm.distributed.launch import DistributedInit
    from pagedllm.distributed.parallel_state import destroy_distributed, init_distributed

    torch.set_num_threads(1)
    init_distributed(DistributedInit(rank, 2, "127.0.0.1", port, "cpu", rank, 2, timeout_s=60))
    queue.put((rank, [_tp_logits(f) for f in folders]))
    destroy_distributed()


@pytest.mark.slow  # two spawned ranks import torch and transformers
def test_two_tensor_parallel_ranks_compute_the_unsharded_logits(tmp_path):
    """Heads and their sinks, each expert's units (interleaved gate/up columns; MXFP4 blocks)
    split over two gloo ranks, down's bias added once: each rank's logits equal the
    unsharded model's."""
    from rank_processes import run_on_ranks

    folders = [save(make_gpt_oss(), tmp_path / "float"),
               save_mxfp4(make_gpt_oss(intermediate_size=64), tmp_path / "mxfp4")]
    want = [_tp_logits(f) for f in folders]
    results = run_on_ranks(_tp_rank, (folders,), timeout=300)
    for rank in (0, 1):
        for got, ref in zip(results[rank], want):
            torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-5, atol=1e-5)


def _gpt_oss_dims(**overrides) -> dict:
    dims = dict(num_attention_heads=64, num_key_value_heads=8, intermediate_size=2880,
                quantization_config={"quant_method": "mxfp4"})
    return dims | overrides


def test_tensor_parallel_sizes_cover_expert_dimensions():
    # gpt-oss-20b/120b: 64 heads, 8 KV heads, experts 2880 wide = 90 MXFP4 blocks, so 4 (which
    # divides 2880 but not 90) and 8 do not split it.
    assert valid_tensor_parallel_sizes(_gpt_oss_dims()) == [1, 2]
    assert valid_tensor_parallel_sizes(_gpt_oss_dims(quantization_config=None)) == [1, 2, 4, 8,
                                                                                    16, 32, 64]
    with pytest.raises(ValidationError, match=r"MXFP4 blocks per expert row 90\); valid sizes: "
                                              r"1, 2$"):
        check_tensor_parallel_size(_gpt_oss_dims(), 4)
    # Qwen-MoE: the experts' and the shared expert's widths must split too, not only the
    # dense intermediate_size.
    moe = dict(num_attention_heads=16, num_key_value_heads=16, intermediate_size=5632,
               moe_intermediate_size=1408, shared_expert_intermediate_size=5632)
    assert valid_tensor_parallel_sizes(moe) == [1, 2, 4, 8, 16]
    assert valid_tensor_parallel_sizes(moe | {"moe_intermediate_size": 96}) == [1, 2, 4, 8, 16]
    assert valid_tensor_parallel_sizes(moe | {"moe_intermediate_size": 100}) == [1, 2, 4]
    assert valid_tensor_parallel_sizes(moe | {"shared_expert_intermediate_size": 20}) == [1, 2, 4]
    with pytest.raises(ValidationError, match="moe_intermediate_size 100"):
        check_tensor_parallel_size(moe | {"moe_intermediate_size": 100}, 8)
    check_tensor_parallel_size(moe, 8)

"""Mixture-of-experts: the FusedMoE layer against a plain per-expert loop, its batch independence,
both checkpoint spellings, and the four families (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE) against
transformers on tiny random models (float32, mixed flat batches)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from paged_helpers import PagedRunner, check_llm_greedy_with_prefix_hit, hf_log_probs
from safetensors.torch import save_file
from test_model_parity import check_mixed_batch, make_hf_model, max_diff, save
from transformers import MixtralConfig, OlmoeConfig, Qwen2MoeConfig, Qwen3MoeConfig

from pagedllm.checkpoint.loader import load_model
from pagedllm.errors import ModelLoadError, UnsupportedModelError
from pagedllm.kernels.cpu_extension import has_bf16_activations, load_cpu_ops
from pagedllm.layers import FusedMoE
from pagedllm.layers.moe_router import RoutingOrder, select_experts
from pagedllm.layers.weight_format import Panels
from pagedllm.weight_plan.plan import hold_checkpoint_experts, hold_experts, plan_weights

COMMON = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
              attn_implementation="eager", experts_implementation="eager")  # the plain reference

CONFIGS = {
    # Layer 0 dense (mlp_only_layers), layer 1 sparse; per-head q/k norm; renormalised top-k.
    "qwen3_moe": lambda: Qwen3MoeConfig(**COMMON, intermediate_size=80, moe_intermediate_size=32,
                                        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                                        mlp_only_layers=[0], head_dim=32),
    # Shared expert with a sigmoid gate, qkv bias, top-k weights not renormalised.
    "qwen2_moe": lambda: Qwen2MoeConfig(**COMMON, intermediate_size=80, moe_intermediate_size=32,
                                        shared_expert_intermediate_size=48, num_experts=8,
                                        num_experts_per_tok=3, norm_topk_prob=False),
    "mixtral": lambda: MixtralConfig(**COMMON, intermediate_size=32, num_local_experts=6,
                                     num_experts_per_tok=2),
    # q/k norm over the whole projections, and clip_qkv.
    "olmoe": lambda: OlmoeConfig(**COMMON, intermediate_size=32, num_experts=8,
                                 num_experts_per_tok=2, clip_qkv=2.5, pad_token_id=None,
                                 eos_token_id=None),
}
needs_kernel = pytest.mark.skipif(load_cpu_ops() is None, reason="the C++ extension did not build")


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny matmuls gain nothing from threads, and on a busy small machine every parallel region
    waits for a descheduled worker (seconds per test)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_moe_model(name: str, **overrides):
    config = CONFIGS[name]()
    for key, value in overrides.items():
        setattr(config, key, value)
    hf_model = make_hf_model(config)
    # Large router weights: the top-k choice is decided by margins far above float32 rounding,
    # so a 1e-7 difference between two correct implementations cannot flip an expert.
    with torch.no_grad():
        for param_name, param in hf_model.named_parameters():
            if param_name.endswith("mlp.gate.weight"):
                param.mul_(8.0)
    return hf_model


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_mixed_flat_batch_matches_transformers(name, tmp_path):
    hf_model = make_moe_model(name)
    model, config = load_model(save(hf_model, tmp_path), torch.float32, torch.device("cpu"))
    plan_weights(model, config, torch.device("cpu"), "float32")  # experts and routers on the kernels
    sparse = [isinstance(layer.mlp.experts, FusedMoE) if hasattr(layer.mlp, "experts") else False
              for layer in model.model.layers]
    assert sparse == ([False, True] if name == "qwen3_moe" else [True, True])
    check_mixed_batch(model, hf_model, PagedRunner(model, block_size=4))
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 96, (12,), generator=gen).tolist()
    with torch.inference_mode():
        ours = model.compute_logits(model(torch.tensor(ids), torch.arange(12)))
    assert ours.argmax(-1).tolist() == hf_log_probs(hf_model, ids).argmax(-1).tolist()


def _reference_moe(x, w13, w2, weights, ids):
    """transformers' loop: every expert over its tokens with F.linear, weighted, summed."""
    out = torch.zeros_like(x)
    for e in range(w13.shape[0]):
        token, choice = torch.where(ids == e)
        gate, up = F.linear(x[token], w13[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[e]) * weights[token, choice, None]
        out.index_add_(0, token, y)
    return out


def _random_layer(seed: int = 0, hidden: int = 48, inter: int = 40,
                  **kwargs) -> tuple[FusedMoE, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    layer = FusedMoE(num_experts=6, top_k=2, hidden_size=hidden, intermediate_size=inter,
                     hidden_act="silu", renormalize=True, **kwargs)
    with torch.no_grad():
        layer.gate_up_proj.copy_(torch.randn(layer.gate_up_proj.shape, generator=gen) * 0.2)
        layer.down_proj.copy_(torch.randn(layer.down_proj.shape, generator=gen) * 0.2)
    w13, w2 = layer.gate_up_proj.detach().clone(), layer.down_proj.detach().clone()
    return layer, w13, w2


@pytest.mark.parametrize("packed", [False, pytest.param(True, marks=needs_kernel)])
def test_layer_matches_per_expert_loop(packed):
    layer, w13, w2 = _random_layer()
    if packed:
        layer.process_weights_after_loading()
        hold_experts(layer)
        assert isinstance(layer.expert_formats["down_proj"], Panels) and layer.down_proj is None
    gen = torch.Generator().manual_seed(1)
    x, logits = torch.randn(37, 48, generator=gen), torch.randn(37, 6, generator=gen) * 4
    weights, ids = select_experts(logits, 2, renormalize=True)
    with torch.inference_mode():
        ours = layer(x, logits)
    assert max_diff(ours, _reference_moe(x, w13, w2, weights, ids)) < 1e-5


@needs_kernel
def test_a_row_has_the_same_bits_alone_and_in_any_batch():
    layer, _, _ = _random_layer(seed=3)
    layer.process_weights_after_loading()
    hold_experts(layer)
    gen = torch.Generator().manual_seed(2)
    x, logits = torch.randn(64, 48, generator=gen), torch.randn(64, 6, generator=gen) * 4
    with torch.inference_mode():
        full = layer(x, logits)
        for rows in ([5], [5, 9], list(range(3, 40)), [63, 5, 0]):
            part = layer(x[rows], logits[rows])
            assert torch.equal(part, full[rows]), rows


def _held_layer(fmt: str, seed: int = 0) -> tuple[FusedMoE, torch.Tensor, torch.Tensor]:
    """A random layer whose experts are held in ``fmt``: "bf16"/"fp16" (the model dtype, converted
    by process_weights_after_loading) or "q8_0"/"q4_0" (the experts stacked from their blocks, as a
    quantized checkpoint's loader does); and the float32 weights they hold."""
    from pagedllm.layers.quantization import quantize_linear

    # q8_0/q4_0 quantize whole blocks of 32 inputs: both projections' inputs are multiples
    layer, w13, w2 = _random_layer(seed, hidden=64, inter=96)
    if fmt in ("bf16", "fp16"):
        layer.to({"bf16": torch.bfloat16, "fp16": torch.float16}[fmt])
        w13, w2 = layer.gate_up_proj.detach().float(), layer.down_proj.detach().float()
    else:
        held = {}
        for attr, w in (("gate_up_proj", w13), ("down_proj", w2)):
            layer.drop_float_projection(attr)
            experts = {e: quantize_linear(w[e], fmt) for e in range(layer.num_experts)}
            hold_checkpoint_experts(layer, attr, experts)
            held[attr] = [experts[e].dequantize() for e in range(layer.num_experts)]
        w13, w2 = torch.stack(held["gate_up_proj"]), torch.stack(held["down_proj"])
    layer.process_weights_after_loading()
    hold_experts(layer)
    return layer, w13, w2


@needs_kernel
@pytest.mark.parametrize("fmt", ["bf16", "fp16", "q8_0", "q4_0"])
def test_experts_held_in_their_format_match_the_loop_bit_for_bit_in_any_batch(fmt):
    """bf16/fp16 experts stay half, a quantized checkpoint's stay quantized (no float matrix):
    the grouped kernel gives the per-expert loop's result on the weights they hold (float32
    rounding; half activations round between the projections), and a row's bits do not depend
    on its batch."""
    layer, w13, w2 = _held_layer(fmt)
    held = {"bf16": "bf16", "fp16": "fp16", "q8_0": "q8", "q4_0": "q4"}[fmt]
    assert layer.gate_up_proj is None and layer.down_proj is None
    assert not isinstance(layer.expert_formats["down_proj"], Panels)
    assert [f.qweight.format for f in layer.expert_formats.values()] == [held] * 2
    assert layer.expert_formats["gate_up_proj"].qweight.codes.shape[0] == 6
    gen = torch.Generator().manual_seed(1)
    x, logits = torch.randn(37, 64, generator=gen), torch.randn(37, 6, generator=gen) * 4
    dtype = (layer.expert_formats["down_proj"].qweight.codes.dtype if fmt in ("bf16", "fp16")
             else torch.float32)
    x = x.to(dtype)
    weights, ids = select_experts(logits, 2, renormalize=True)
    with torch.inference_mode():
        ours = layer(x, logits)
        expected = _reference_moe(x.float(), w13, w2, weights, ids)
        assert ours.dtype == dtype
        tolerance = 1e-5 if dtype == torch.float32 else 3e-2
        assert max_diff(ours.float(), expected) < tolerance * expected.abs().max()
        for rows in ([5], [5, 9], list(range(3, 30)), [36, 5, 0]):
            assert torch.equal(layer(x[rows], logits[rows]), ours[rows]), rows
        if fmt.startswith("q"):  # int8 activations reach the experts too (one setting per layer)
            from pagedllm.weight_plan.activation_choice import set_quantization_activations

            assert set_quantization_activations(layer, "int8") == 1
            int8 = layer(x, logits)
            assert not torch.equal(int8, ours)
            assert max_diff(int8, expected) < 3e-2 * expected.abs().max()
            for rows in ([5], [36, 5, 0]):
                assert torch.equal(layer(x[rows], logits[rows]), int8[rows]), rows
        if fmt == "bf16" and has_bf16_activations():  # bf16 activations: both projections
            from pagedllm.weight_plan.activation_choice import set_quantization_activations

            assert set_quantization_activations(layer, "bfloat16") == 1
            assert [f.qweight.format for f in layer.expert_formats.values()] == ["bf16_vnni"] * 2
            narrow = layer(x, logits)
            assert max_diff(narrow.float(), expected) < 3e-2 * expected.abs().max()
            for rows in ([5], [36, 5, 0]):
                assert torch.equal(layer(x[rows], logits[rows]), narrow[rows]), rows


def test_a_missing_quantized_expert_is_named():
    from pagedllm.layers.quantization import quantize_linear

    layer, w13, _ = _random_layer(hidden=64)
    layer.drop_float_projection("gate_up_proj")
    experts = {e: quantize_linear(w13[e], "q8_0") for e in range(5)}
    with pytest.raises(ModelLoadError, match="gate_up_proj: the checkpoint held 5 of 6 experts"):
        hold_checkpoint_experts(layer, "gate_up_proj", experts)
    with pytest.raises(ModelLoadError, match="the layer wants 80x64"):
        hold_checkpoint_experts(layer, "gate_up_proj", {**experts, 0: quantize_linear(w13[0][:64], "q8_0")})


@needs_kernel
@pytest.mark.parametrize("scheme", ["q8_0", "q4_0"])
def test_load_time_quantization_quantizes_the_experts(scheme, tmp_path):
    """quantization="q8_0" | "q4_0" on a full-precision MoE checkpoint: every expert quantized
    at load (no float matrix kept), and the model matches transformers holding the same
    dequantized weights."""
    from pagedllm.layers.quantization import quantize_linear

    hf_model = make_moe_model("qwen3_moe")
    folder = save(hf_model, tmp_path)
    model, config = load_model(folder, torch.float32, torch.device("cpu"), quantization=scheme)
    plan_weights(model, config, torch.device("cpu"), "float32", quantization=scheme)
    experts = [m for m in model.modules() if isinstance(m, FusedMoE)]
    held = {"q8_0": "q8", "q4_0": "q4"}[scheme]
    assert experts and all(m.gate_up_proj is None and m.down_proj is None for m in experts)
    assert all([f.qweight.format for f in m.expert_formats.values()] == [held] * 2 for m in experts)
    with torch.no_grad():  # the reference holds what the layers hold
        for name, param in hf_model.named_parameters():
            if name.startswith("model.layers.") and (
                    name.endswith(("gate_up_proj", "down_proj")) and param.dim() == 3):
                for e in range(param.shape[0]):
                    param[e] = quantize_linear(param[e], scheme).dequantize()
            elif (name.startswith("model.layers.") and name.endswith("proj.weight")
                  and param.shape[1] % 32 == 0):  # whole blocks only, as the loader
                param.copy_(quantize_linear(param, scheme).dequantize())
    check_mixed_batch(model, hf_model, PagedRunner(model, block_size=4))


def test_routing_orders_agree():
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(50, 8, generator=gen) * 3
    w1, ids1 = select_experts(logits, 3, renormalize=True)
    w2, ids2 = select_experts(logits, 3, renormalize=True, order=RoutingOrder.TOPK_SOFTMAX)
    assert torch.equal(ids1, ids2)
    assert max_diff(w1, w2) < 1e-6
    plain, _ = select_experts(logits, 3, renormalize=False)
    assert max_diff(plain, torch.softmax(logits, -1).gather(1, ids1)) < 1e-7
    with pytest.raises(UnsupportedModelError, match="num_experts_per_tok"):
        FusedMoE(4, 5, 8, 8, "silu", renormalize=True)


@pytest.mark.parametrize("name", ["qwen2_moe", "mixtral"])
def test_fused_checkpoint_spelling_loads_the_same_model(name, tmp_path):
    """transformers 5 writes one tensor per expert (Mixtral's under ``block_sparse_moe`` with
    w1/w3/w2); the fused ``experts.gate_up_proj`` / ``experts.down_proj`` of its in-memory state
    dict load into the same weights."""
    hf_model = make_moe_model(name)
    per_expert, _ = load_model(save(hf_model, tmp_path / "per_expert"), torch.float32,
                               torch.device("cpu"))
    fused_dir = tmp_path / "fused"
    save(hf_model, fused_dir)  # config.json
    state = {k: v.contiguous() for k, v in hf_model.state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    save_file(state, str(fused_dir / "model.safetensors"))
    fused, _ = load_model(str(fused_dir), torch.float32, torch.device("cpu"))
    ours = dict(per_expert.named_buffers()) | {n: p for n, p in per_expert.named_parameters()}
    theirs = dict(fused.named_buffers()) | {n: p for n, p in fused.named_parameters()}
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key
    for a, b in ((m1, m2) for m1, m2 in zip(per_expert.modules(), fused.modules())
                 if isinstance(m1, FusedMoE)):
        for attr in ("gate_up_proj", "down_proj"):
            x, y = getattr(a, attr), getattr(b, attr)
            assert (x is None and y is None) or torch.equal(x, y), attr
        assert a.expert_formats.keys() == b.expert_formats.keys()
        for attr, fmt in a.expert_formats.items():
            assert all(torch.equal(x, y) for x, y in zip(fmt.tensors(),
                                                         b.expert_formats[attr].tensors())), attr
    check_mixed_batch(fused, hf_model, PagedRunner(fused, block_size=4))


def test_missing_expert_is_named(tmp_path):
    hf_model = make_moe_model("qwen3_moe")
    path = save(hf_model, tmp_path)
    from safetensors.torch import load_file
    state = load_file(str(tmp_path / "model.safetensors"))
    del state["model.layers.1.mlp.experts.5.up_proj.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.mlp\.experts\.5\.up_proj\.weight"):
        load_model(path, torch.float32, torch.device("cpu"))


def test_llm_greedy_with_chunked_prefill_batching_and_prefix_caching(tmp_path):
    """Qwen3-MoE through the whole engine: four prompts in one batch, prefills chunked by a
    16-token budget, two prompts sharing 16 tokens of prefix (a prefix-cache hit); every greedy
    continuation equals transformers' generate."""
    config = CONFIGS["qwen3_moe"]()
    config.vocab_size, config.mlp_only_layers = 32000, []
    hf_model = make_hf_model(config)
    with torch.no_grad():
        for param_name, param in hf_model.named_parameters():
            if param_name.endswith("mlp.gate.weight"):
                param.mul_(8.0)
    folder = tmp_path / "qwen3_moe"
    save(hf_model, folder)
    check_llm_greedy_with_prefix_hit(hf_model, folder, last_prompt_len=21)


TP_TOKENS = [1, 5, 36, 0, 17, 35, 2, 18, 9, 77, 50]


def _tp_logits(folder: str) -> tuple[list, int]:
    model, _ = load_model(folder, torch.float32, torch.device("cpu"))
    with torch.inference_mode():
        logits = model.compute_logits(model(torch.tensor(TP_TOKENS), torch.arange(len(TP_TOKENS))))
    experts = sum(m.expert_formats["down_proj"].packed.numel() if "down_proj" in m.expert_formats
                  else m.down_proj.numel() for m in model.modules() if isinstance(m, FusedMoE))
    return logits.tolist(), experts


def _tp_rank(rank: int, port: int, folders: list[str], queue) -> None:
    from pagedllm.distributed.launch import DistributedInit
    from pagedllm.distributed.parallel_state import destroy_distributed, init_distributed

    torch.set_num_threads(1)
    init_distributed(DistributedInit(rank, 2, "127.0.0.1", port, "cpu", rank, 2, timeout_s=60))
    queue.put((rank, [_tp_logits(f) for f in folders]))
    destroy_distributed()


@pytest.mark.slow  # two spawned ranks import torch and transformers
def test_two_tensor_parallel_ranks_compute_the_unsharded_logits(tmp_path):
    """Each expert's intermediate dimension split over two gloo ranks (Qwen2-MoE's shared
    expert too), one all-reduce per layer; OLMoE's q/k norms gathered over the ranks' heads:
    every rank's logits equal the unsharded model's."""
    from rank_processes import run_on_ranks

    # OLMoE with one KV head: q's norm gathers split heads, k's the head both ranks replicate.
    folders = [save(make_moe_model(name, **overrides), tmp_path / name) for name, overrides in
               (("qwen2_moe", {}), ("mixtral", {}), ("olmoe", {"num_key_value_heads": 1}))]
    want = [_tp_logits(f) for f in folders]
    results = run_on_ranks(_tp_rank, (folders,), timeout=300)
    for rank in (0, 1):
        for (got, got_experts), (ref, ref_experts) in zip(results[rank], want):
            torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-5, atol=1e-5)
            assert 2 * got_experts <= ref_experts + 64 * 64  # half of each expert (+ padding)


@pytest.mark.slow  # inductor compiles a graph (~10-60 s on a small shared machine)
@pytest.mark.parametrize("packed", [False, pytest.param(True, marks=needs_kernel)])
def test_layer_compiles_without_graph_breaks(packed):
    """The data-dependent expert loop is one opaque op (the C++ fused_experts where the kernels
    hold the experts, else the Python loop's custom op), so the engine's fullgraph compile
    works."""
    layer, w13, w2 = _random_layer(seed=5)
    if packed:
        layer.process_weights_after_loading()
        hold_experts(layer)
    gen = torch.Generator().manual_seed(6)
    x, logits = torch.randn(9, 48, generator=gen), torch.randn(9, 6, generator=gen) * 4
    compiled = torch.compile(layer, fullgraph=True, dynamic=True)
    with torch.inference_mode():
        weights, ids = select_experts(logits, 2, renormalize=True)
        assert max_diff(compiled(x, logits), _reference_moe(x, w13, w2, weights, ids)) < 1e-5

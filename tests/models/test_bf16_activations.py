"""bf16 weights times activations rounded to bf16 (csrc/bf16_gemm.h: AMX tiles, or AVX512-BF16
dot products on a CPU without AMX; the engine's ``quantization_activations="bfloat16"``): against
float64 of the weight times x rounded to bf16
as the kernel rounds it, within float32 rounding; ragged shapes (in odd, not a multiple of the
32-k tile; out not a multiple of the panel), 1-257 rows, a row's bits independent of its batch;
stories260K in bfloat16 decoding the exact path's greedy ids; and the refusals, which run on
any CPU: the kernel tests skip where the CPU has no AVX512-BF16 (the grouped kernel's case lives
with the other formats' in test_quant_kernels.py)."""
from __future__ import annotations

import pytest
import torch

from pagedllm.errors import ModelLoadError
from pagedllm.kernels.cpu_extension import has_bf16_activations, load_cpu_ops, native_isa
from pagedllm.layers.quantization import QuantizedWeight
from pagedllm.layers.quantization.linear_method import check_kernel
from pagedllm.layers.weight_format import Quantized
from pagedllm.weight_plan.activation_choice import set_quantization_activations

pytestmark = pytest.mark.skipif(load_cpu_ops() is None or native_isa() is None,
                                reason="no AVX2/AVX-512 CPU kernels here")
needs_bf16x = pytest.mark.skipif(not has_bf16_activations(), reason="this CPU has no AVX512-BF16")

# Every tile shape (16 rows x 64 columns up to 16 rows, 32 x 32 above), partial tiles, several
# chunks of 128 rows (257).
ROWS = (1, 2, 15, 16, 17, 33, 72, 257)
# (out, in): in odd, under one 32-k tile, not a multiple of it; out not a multiple of 64.
SHAPES = [(100, 96), (64, 64), (130, 33), (70, 1), (33, 320), (200, 1000)]


@needs_bf16x
@pytest.mark.parametrize("n,k", SHAPES)
def test_bf16_path_matches_float64_on_the_rounded_activations(n, k):
    ops = load_cpu_ops()
    gen = torch.Generator().manual_seed(n * 1000 + k)
    w = torch.randn(n, k, generator=gen).bfloat16()
    qw = QuantizedWeight.from_half(w).to_vnni()
    bias = torch.randn(n, generator=gen)
    x = torch.randn(max(ROWS), k, generator=gen) * 3
    for m in ROWS:
        y = ops.quant_linear(x[:m], qw.codes, None, None, 0, n, bias, True)
        x64 = x[:m].bfloat16().double()
        expected = x64 @ w.double().T + bias.double()
        scale = x64.abs() @ w.double().abs().T + bias.double().abs()
        assert y.dtype == torch.float32 and y.shape == (m, n)
        assert ((y.double() - expected).abs() <= 1e-6 * scale + 1e-30).all(), m
        # a row's bits do not depend on its batch: each row alone gives the same
        for r in {0, m // 2, m - 1}:
            alone = ops.quant_linear(x[r:r + 1], qw.codes, None, None, 0, n, bias, True)
            assert torch.equal(alone[0], y[r]), (m, r)


@needs_bf16x
@pytest.mark.parametrize("n,k", SHAPES)
def test_bf16_x_gives_bf16_y_rounded_once_with_the_bias(n, k):
    """A bf16 model's x goes in as it is and y comes out bf16: the float32 path's sums plus the
    bias, rounded once (bit for bit), a row's bits independent of its batch."""
    ops = load_cpu_ops()
    gen = torch.Generator().manual_seed(n + k)
    qw = QuantizedWeight.from_half(torch.randn(n, k, generator=gen).bfloat16()).to_vnni()
    bias = torch.randn(n, generator=gen)
    x = torch.randn(max(ROWS), k, generator=gen).bfloat16()
    for m in ROWS:
        for b in (None, bias):
            y = ops.quant_linear(x[:m], qw.codes, None, None, 0, n, b, True)
            wide = ops.quant_linear(x[:m].float(), qw.codes, None, None, 0, n, None, True)
            expected = (wide if b is None else wide + b).bfloat16()
            assert y.dtype == torch.bfloat16 and torch.equal(y, expected), (m, b is None)
            assert torch.equal(ops.quant_linear(x[m - 1:m], qw.codes, None, None, 0, n, b, True)[0],
                               y[m - 1])
    with pytest.raises(RuntimeError, match="float32 tensor"):  # the exact path takes float32
        ops.quant_linear(x[:2], qw.codes, None, None, 0, n, None, False)


@needs_bf16x
def test_bf16_path_differs_from_the_exact_one_by_the_rounding_of_x():
    """The same weight on the float path (x in float32): the two differ by x's rounding to bf16
    (|dx| <= 2^-9 |x|), so |dy| <= 2^-9 sum |x w| (+ float32 rounding), and they do differ."""
    ops = load_cpu_ops()
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(300, 512, generator=gen).bfloat16()
    qw = QuantizedWeight.from_half(w)
    x = torch.randn(40, 512, generator=gen)
    narrow = ops.quant_linear(x, qw.to_vnni().codes, None, None, 0, 300, None, True)
    exact = ops.quant_linear(x, qw.codes, None, None, 0, 300, None, False)
    bound = 2.0 ** -9 * (x.double().abs() @ w.double().abs().T) * 1.01
    assert ((narrow.double() - exact.double()).abs() <= bound).all()
    assert not torch.equal(narrow, exact)


@needs_bf16x
def test_stories260k_in_bf16_decodes_the_exact_paths_greedy_ids():
    """stories260K in bfloat16, 32 greedy tokens after each of three prompts (decode steps of a
    batch of three), once with float32 activations (the exact path) and once rounded to bf16.
    The bf16 run is fed the exact run's tokens, so every step compares the two on the same
    context. The model's log probs are bf16 (steps of 0.0625 at magnitudes 8-16). Stated bound:
    a log prob moves by at most 0.125 for the tokens of log prob > -5 (observed on Sapphire
    Rapids: <= 0.07) and 0.25 over the vocabulary (observed <= 0.16); hence the same greedy id
    wherever the exact path's top two are more than 0.25 apart; free-running, all 32 tokens of
    each prompt agree here."""
    from paged_helpers import STORIES_DIR, decode_steps

    from pagedllm.checkpoint.loader import load_model
    from pagedllm.weight_plan.plan import choose_linear_kernels, hold_half_layers

    prompts = [[1, 365, 264, 292], [1, 403, 250, 263, 431], [1, 450]]
    likely_bound, vocab_bound = 0.125, 0.25

    def run(activations: str, forced: list[list[int]] | None) -> tuple[list[list[int]], list[torch.Tensor]]:
        model, _ = load_model(str(STORIES_DIR / "hf"), torch.bfloat16, torch.device("cpu"), None)
        hold_half_layers(model)
        choose_linear_kernels(model)
        assert set_quantization_activations(model, activations) > 0
        return decode_steps(model, prompts, 32, forced)

    exact_ids, exact_steps = run("float32", None)
    _, bf16_steps = run("bfloat16", exact_ids)
    for t, (exact, bf16) in enumerate(zip(exact_steps, bf16_steps)):
        gap = (bf16 - exact).abs()
        assert gap.max() <= vocab_bound, (t, float(gap.max()))
        assert gap[exact > -5].max() <= likely_bound, (t, float(gap[exact > -5].max()))
        top2 = exact.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 2 * likely_bound
        assert torch.equal(bf16.argmax(-1)[clear], exact.argmax(-1)[clear]), t
    free_ids, _ = run("bfloat16", None)
    assert free_ids == exact_ids


@needs_bf16x
def test_the_engine_runs_bf16_activations_on_the_bf16_layers():
    """LLM(dtype=bfloat16, quantization_activations=bfloat16): every bf16 layer's method takes
    them, and the story is the exact path's (as in the test above), eager and compiled."""
    from paged_helpers import STORIES_DIR

    from pagedllm import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [{"prompt_token_ids": [1, 365, 264, 292]}, {"prompt_token_ids": [1, 450]}]
    outs = {}
    for activations, eager in (("float32", True), ("bfloat16", True), ("bfloat16", False)):
        llm = LLM(str(STORIES_DIR / "hf"), device="cpu", dtype="bfloat16", enforce_eager=eager,
                  quantization_activations=activations, kv_cache_memory_bytes=1 << 20)
        model = llm.llm_engine.executor.runner.model
        methods = {m.weight_format.activations for m in model.modules()
                   if isinstance(getattr(m, "weight_format", None), Quantized)}
        assert methods == {activations}, methods
        outs[activations, eager] = [o.outputs[0].token_ids
                                    for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outs["bfloat16", True] == outs["bfloat16", False] == outs["float32", True]


def test_bf16_activations_are_refused_where_they_do_not_apply():
    """A float32 model has no bf16 layer: a one-line refusal naming what it applies to; fp16
    weights take none; and a CPU without AVX512-BF16 refuses them at load, saying what it needs."""
    from paged_helpers import STORIES_DIR

    from pagedllm import LLM

    with pytest.raises(ModelLoadError, match="applies to bf16 weights"):
        LLM(str(STORIES_DIR / "hf"), device="cpu", enforce_eager=True,
            quantization_activations="bfloat16", kv_cache_memory_bytes=1 << 20)
    fp16 = QuantizedWeight.from_half(torch.randn(64, 64).half())
    with pytest.raises(ModelLoadError, match="fp16 weights have none"):
        check_kernel(fp16, None, "bfloat16")
    bf16 = QuantizedWeight.from_half(torch.randn(64, 64).bfloat16()).to_vnni()
    if has_bf16_activations():
        check_kernel(bf16, None, "bfloat16")
    else:
        with pytest.raises(ModelLoadError, match="AVX512-BF16"):
            check_kernel(bf16, None, "bfloat16")

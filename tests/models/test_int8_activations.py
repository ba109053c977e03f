"""The q8/q4 kernels with int8-quantized activations (csrc/int8_gemm.h, the engine's
``quantization_activations="int8"``): against float64 of the dequantized weight times the
activations as the kernel quantized them (rebuilt here: per row, blocks of 32 k, or of the
largest of 16/8/4 dividing the group; scale amax / 127; codes rounded half to even), within
float32 rounding; against the exact float path within the bound the rounding of the activations
implies; every format and group size, ragged shapes, 1-257 rows, batch independence, both x86
levels this CPU runs; and a tiny Llama quantized to q8_0 at load decoding the same greedy ids
as the exact path."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_quant_kernels import _weight  # the random q8/q4/q5 weights both kernel tests use

from pagedllm.errors import ModelLoadError
from pagedllm.kernels.cpu_extension import can_run, load_cpu_ops, native_isa
from pagedllm.layers.weight_format import Blocks
from pagedllm.weight_plan.activation_choice import set_quantization_activations

pytestmark = pytest.mark.skipif(load_cpu_ops() is None or native_isa() is None,
                                reason="no AVX2/AVX-512 CPU kernels here")

ISAS = [pytest.param(isa, marks=pytest.mark.skipif(not can_run(isa), reason=f"this CPU cannot run {isa}"))
        for isa in ("native", "v3")]
# Every tile (1 row: the whole panel; 4-row tiles and their remainders), several chunks (257).
ROWS = (1, 2, 3, 4, 5, 8, 33, 72, 257)
# (format, out, in, group size, offsets): out not a multiple of the 64-column panel; groups of
# Q6_K (16), Q8_0/Q4_x (32), AWQ/GPTQ (128) and odd ones (48, 24, 20: activation blocks of 16,
# 8 and 4, which AVX-512 quantizes in vectors, in AVX2 vectors and in scalar code).
CASES = [("q8", 130, 320, 32, False), ("q8", 33, 48, 16, True), ("q8", 70, 256, 128, True),
         ("q8", 100, 96, 48, False), ("q4", 70, 256, 128, True), ("q4", 100, 96, 32, False),
         ("q4", 64, 160, 16, True), ("q4", 129, 384, 32, True), ("q5", 130, 320, 32, False),
         ("q5", 70, 256, 128, True), ("q5", 33, 48, 16, False), ("q8", 40, 96, 24, False),
         ("q8", 20, 80, 20, True)]


def _block(group: int) -> int:
    return next(b for b in (32, 16, 8, 4) if group % b == 0)


def quantized_activations(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] as the kernel quantizes it: (codes [M, K] in -127..127, scale [M, K / block]),
    in float32 arithmetic as in the kernel (scale = amax / 127, codes = round(x * (1 / scale)))."""
    xb = x.view(x.shape[0], -1, block)
    scale = xb.abs().amax(-1) / 127
    inv = torch.where(scale != 0, 1 / scale, torch.zeros_like(scale))
    codes = torch.round(xb * inv[..., None]).clamp(-127, 127)
    return codes.view_as(x), scale


def _run(ops, x, qw, bias=None, int8=True):
    return ops.quant_linear(x, qw.codes, qw.scales, qw.offsets, qw.group_size, qw.out_features,
                            bias, int8)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt,n,k,group,offsets", CASES)
def test_int8_path_matches_float64_on_the_quantized_activations(isa, fmt, n, k, group, offsets):
    ops = load_cpu_ops(isa)
    gen = torch.Generator().manual_seed(n * 1000 + k + group)
    qw = _weight(fmt, n, k, group, offsets, gen)
    w64 = qw.dequantize(torch.float64)
    bias = torch.randn(n, generator=gen)
    for rows in ROWS:
        x = torch.randn(rows, k, generator=gen) * torch.rand(rows, 1, generator=gen) * 4
        x[0, :group] = 0  # an all-zero block: scale 0, no division by zero
        y = _run(ops, x, qw, bias)
        exact = _run(ops, x, qw, bias, int8=False)
        assert y.shape == (rows, n) and y.dtype == torch.float32
        codes, scale = quantized_activations(x, _block(group))
        xq = (codes.view(rows, -1, _block(group)).double() * scale.double()[..., None]).view(rows, k)
        ref = F.linear(xq, w64, bias.double())
        magnitude = xq.abs() @ w64.abs().T + bias.double().abs()
        # float32 rounding of the block sums' scaling and of the sum over blocks
        assert ((y.double() - ref).abs() <= 2e-6 * magnitude.amax(1, keepdim=True)).all(), rows
        # against the exact path: each activation moved by at most half its block's step
        # (amax / 254), so |dy| <= sum over blocks of amax / 254 * sum |w| (+ float32 rounding)
        step = (x.view(rows, -1, _block(group)).abs().amax(-1) / 254).double()
        bound = step.repeat_interleave(_block(group), dim=1) @ w64.abs().T
        assert ((y.double() - exact.double()).abs() <= bound * 1.001 + 4e-6 * magnitude).all(), rows


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", ["q8", "q4", "q5"])
def test_int8_path_is_close_to_the_exact_one(isa, fmt):
    """Gaussian activations: the rounding's error is small against the result (relative RMS
    error under 1% for groups of 32 and 128; typically 0.3-0.5%)."""
    ops = load_cpu_ops(isa)
    gen = torch.Generator().manual_seed(11)
    for group in (32, 128):
        qw = _weight(fmt, 256, 1024, group, fmt == "q4", gen)
        x = torch.randn(16, 1024, generator=gen)
        y, exact = _run(ops, x, qw), _run(ops, x, qw, int8=False)
        relative = (y - exact).double().norm() / exact.double().norm()
        assert relative < 0.01, (group, float(relative))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", ["q8", "q4", "q5"])
def test_a_rows_int8_result_does_not_depend_on_its_batch(isa, fmt):
    ops = load_cpu_ops(isa)
    gen = torch.Generator().manual_seed(3)
    qw = _weight(fmt, 200, 512, 32, True, gen)
    x = torch.randn(300, 512, generator=gen)  # several chunks of rows
    full = _run(ops, x, qw)
    for rows in (1, 2, 3, 4, 5, 7, 12, 13, 33, 64, 65, 72, 130):
        for start in (0, 5, 300 - rows):
            assert torch.equal(_run(ops, x[start:start + rows], qw), full[start:start + rows]), (rows, start)


def test_a_group_of_no_multiple_of_4_falls_back_to_the_exact_path():
    """Groups whose size is not a multiple of 4 have no quads to dot: the float path runs."""
    ops = load_cpu_ops()
    gen = torch.Generator().manual_seed(4)
    qw = _weight("q8", 70, 42, 6, True, gen)
    x = torch.randn(3, 42, generator=gen)
    assert torch.equal(_run(ops, x, qw), _run(ops, x, qw, int8=False))


def test_the_option_reaches_the_q8_q4_methods_and_bad_values_are_refused():
    from pagedllm.layers import Linear, hold
    from pagedllm.layers.quantization import quantize_linear
    from pagedllm.layers.weight_format import Quantized

    model = torch.nn.Module()
    model.a, model.b = Linear(64, 70), Linear(64, 70)
    hold(model.a, Quantized.of(quantize_linear(model.a.weight.detach(), "q8_0")))
    assert set_quantization_activations(model, "int8") == 1  # b stays float32
    assert isinstance(model.a.weight_format, Blocks) and model.a.weight_format.activations == "int8"
    x = torch.randn(2, 64)
    ops = load_cpu_ops()
    assert torch.equal(model.a(x), _run(ops, x, model.a.weight_format.qweight, model.a.bias))
    with pytest.raises(ModelLoadError, match="supported: float32, int8"):
        set_quantization_activations(model, "int4")
    with pytest.raises(ModelLoadError, match="do not apply to q8 weights; they take float32 or int8"):
        Blocks(model.a.weight_format.qweight, "fp8")


def test_the_engine_option_is_checked():
    from pagedllm.config import ModelConfig
    from pagedllm.errors import ValidationError

    assert ModelConfig(model="m").quantization_activations == "auto"
    with pytest.raises(ValidationError, match="auto, float32, int8 or bfloat16"):
        ModelConfig(model="m", quantization_activations="int4")


def test_a_q8_0_llama_decodes_the_same_greedy_ids_with_int8_activations():
    """stories260K quantized to q8_0 at load, 32 greedy tokens after each of three prompts
    (decode steps of a batch of three). The int8 run is fed the exact run's tokens, so every
    step compares the two on the same context. Stated bound: a log prob moves by at most 0.25
    for the tokens of log prob > -5 (observed on AVX2: <= 0.18; the chosen token's <= 0.1) and
    0.5 over the vocabulary (observed <= 0.3); hence the same greedy id wherever the exact
    path's top two are more than 0.5 apart. Free-running, the ids are the exact path's up to
    the first near tie (here after 18 tokens: top two 0.03 apart); at least 16 must agree.
    The model is tiny (hidden size 64: two activation blocks per row), so its errors are the
    large end of what a real model sees."""
    from paged_helpers import STORIES_DIR, decode_steps

    from pagedllm.checkpoint.loader import load_model
    from pagedllm.weight_plan.plan import quantize_linears

    prompts = [[1, 365, 264, 292], [1, 403, 250, 263, 431], [1, 450]]
    likely_bound, vocab_bound = 0.25, 0.5

    def run(activations: str, forced: list[list[int]] | None) -> tuple[list[list[int]], list[torch.Tensor]]:
        model, _ = load_model(str(STORIES_DIR / "hf"), torch.float32, torch.device("cpu"), "q8_0")
        quantize_linears(model, "q8_0")  # the planning pass's step 2
        assert set_quantization_activations(model, activations) > 0
        return decode_steps(model, prompts, 32, forced)

    exact_ids, exact_steps = run("float32", None)
    int8_ids, int8_steps = run("int8", exact_ids)
    first_difference = None
    for t, (exact, int8) in enumerate(zip(exact_steps, int8_steps)):
        gap = (int8 - exact).abs()
        assert gap.max() <= vocab_bound, (t, float(gap.max()))
        assert gap[exact > -5].max() <= likely_bound, (t, float(gap[exact > -5].max()))
        top2 = exact.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 2 * likely_bound
        assert torch.equal(int8.argmax(-1)[clear], exact.argmax(-1)[clear]), t
        if first_difference is None and not torch.equal(int8.argmax(-1), exact.argmax(-1)):
            first_difference = t
    assert first_difference is None or first_difference >= 16, first_difference


def test_the_engine_applies_int8_activations_and_refuses_them_without_q8_q4_layers():
    """LLM(quantization=q8_0, quantization_activations=int8) runs the q8 layers through the int8
    path and tells the golden story's first tokens (16 greedy ids equal the exact path's, as in
    the test above); a float32 model has no q8/q4 layer to apply it to: a one-line refusal."""
    from paged_helpers import STORIES_DIR

    from pagedllm import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompt = [{"prompt_token_ids": [1, 365, 264, 292]}]
    outs = {}
    for activations in ("float32", "int8"):
        llm = LLM(str(STORIES_DIR / "hf"), device="cpu", enforce_eager=True, quantization="q8_0",
                  quantization_activations=activations, kv_cache_memory_bytes=1 << 20)
        model = llm.llm_engine.executor.runner.model
        methods = {type(m.weight_format).__name__ + ":" + m.weight_format.activations
                   for m in model.modules()
                   if isinstance(getattr(m, "weight_format", None), Blocks)}
        assert methods and all(m.endswith(activations) for m in methods), methods
        outs[activations] = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    assert outs["int8"] == outs["float32"]
    with pytest.raises(ModelLoadError, match="applies to q8/q4 weights"):
        LLM(str(STORIES_DIR / "hf"), device="cpu", enforce_eager=True,
            quantization_activations="int8", kv_cache_memory_bytes=1 << 20)

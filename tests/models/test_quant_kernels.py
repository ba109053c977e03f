"""Weights in other formats than float32 (layers/quantization/, csrc/quant_gemm.cpp): bf16, fp16,
q8, q4 and q5 panels against float64 on the dequantized weight at every tile's row counts, ragged
shapes, with and without bias, on every x86 level this CPU runs (and the AVX-512 build at least
compiles); a row's bits do not depend on its batch; the grouped (mixture-of-experts) kernel
gives each expert's rows the bits of its own call at any thread count; the packing is exact;
load-time quantization equals llama.cpp's reference quantizers (gguf's numpy port); a quantized
Linear and a bfloat16 model's layers go through ``linear`` unchanged."""
from __future__ import annotations

import dataclasses

import gguf
import pytest
import torch
import torch.nn.functional as F

from pagedllm.errors import ModelLoadError, ValidationError
from pagedllm.kernels.cpu_extension import (
    CSRC,
    can_run,
    compile_sources,
    has_bf16_activations,
    load_cpu_ops,
    native_isa,
)
from pagedllm.layers import Linear, ParallelLMHead, VocabParallelEmbedding
from pagedllm.layers.linear import hold, linear
from pagedllm.layers.quantization import QuantizedWeight, quantize_linear
from pagedllm.layers.quantization.quantized_weight import GroupScales, _from_kgroups, _high_bit_codes
from pagedllm.layers.weight_format import Quantized
from pagedllm.weight_plan import linear_choice as linear_kernel
from pagedllm.weight_plan.plan import choose_linear_kernels, hold_half_layers

pytestmark = pytest.mark.skipif(load_cpu_ops() is None, reason="no C++ compiler: no CPU kernels")

ISAS = [pytest.param(isa, marks=pytest.mark.skipif(not can_run(isa), reason=f"this CPU cannot run {isa}"))
        for isa in ("native", "v3")]
# Every tile on both levels (AVX2: 1 x 8 vectors up to 12 rows, 6 x 2 above; AVX-512: 6 x 4 up to
# 12 rows, 12 x 2 up to 64, 6 x 4 above), several chunks of rows (257).
ROWS = (1, 2, 5, 8, 33, 72, 257)
# (format, out, in, group size, offsets): out not a multiple of the 64-column panel, in not one
# of the 64-k block, groups of GGUF's sizes (16: Q6_K, 32) and AWQ/GPTQ's (128).
HALF_FORMATS = ("bf16", "fp16")
CASES = [("bf16", 100, 96, 0, False), ("fp16", 5, 37, 0, False), ("q8", 130, 320, 32, False),
         ("q8", 33, 48, 16, True), ("q4", 70, 256, 128, True), ("q4", 100, 96, 32, False),
         ("q4", 64, 160, 32, True), ("q5", 130, 320, 32, False), ("q5", 70, 96, 16, True),
         ("q5", 33, 42, 6, True), ("q6", 130, 512, 16, False), ("q6", 70, 96, 32, True),
         ("q6", 33, 42, 6, True)]


def _weight(fmt: str, n: int, k: int, group: int, offsets: bool, gen: torch.Generator) -> QuantizedWeight:
    if fmt in ("bf16", "fp16"):
        return QuantizedWeight.from_half(
            torch.randn(n, k, generator=gen).to(torch.bfloat16 if fmt == "bf16" else torch.float16))
    scales = torch.rand(n, k // group, generator=gen) + 0.01
    offs = torch.randn(n, k // group, generator=gen) if offsets else None
    if fmt == "q8":
        codes = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
        return QuantizedWeight.from_q8(codes, scales, offs, group)
    if fmt in ("q5", "q6"):
        bias = 16 if fmt == "q5" else 32
        codes = torch.randint(-bias, bias, (n, k), generator=gen, dtype=torch.int8)
        build = QuantizedWeight.from_q5 if fmt == "q5" else QuantizedWeight.from_q6
        return build(codes, scales, offs, group)
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    return QuantizedWeight.from_q4(codes, scales, offs, group)


def _run(ops, x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    return ops.quant_linear(x, qw.codes, qw.scales, qw.offsets, qw.group_size, qw.out_features, bias)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt,n,k,group,offsets", CASES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_kernel_matches_float64_of_the_dequantized_weight(isa, fmt, n, k, group, offsets, with_bias):
    ops = load_cpu_ops(isa)
    assert ops is not None, f"the {isa} build failed"
    gen = torch.Generator().manual_seed(n * 1000 + k)
    qw = _weight(fmt, n, k, group, offsets, gen)
    w64 = qw.dequantize(torch.float64)
    b = torch.randn(n, generator=gen) if with_bias else None
    for rows in ROWS:
        x = torch.randn(rows, k, generator=gen)
        y = _run(ops, x, qw, b)
        assert y.shape == (rows, n) and y.dtype == torch.float32
        ref = F.linear(x.double(), w64, None if b is None else b.double())
        # float32 rounding of the sums (the same bound as the float32 kernel's test)
        scale = (x.double().abs() @ w64.abs().T).amax()
        assert (y.double() - ref).abs().max() <= 2e-6 * scale, rows


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", ["bf16", "fp16", "q8", "q4", "q5", "q6"])
def test_a_rows_result_does_not_depend_on_its_batch(isa, fmt):
    ops = load_cpu_ops(isa)
    gen = torch.Generator().manual_seed(3)
    qw = _weight(fmt, 200, 512, 32, True, gen)
    x = torch.randn(300, 512, generator=gen)  # several chunks of the many-rows tile
    full = _run(ops, x, qw, None)
    for rows in (1, 3, 4, 5, 7, 12, 13, 33, 64, 65, 72, 130):
        for start in (0, 5, 300 - rows):
            part = _run(ops, x[start:start + rows], qw, None)
            assert torch.equal(part, full[start:start + rows]), (rows, start)


# (format, out, in, group size, offsets) for the grouped kernel: out not a multiple of the panel;
# in with a partial last quad where the format allows one (q8/q4 groups of 6: 42 k, 11 quads,
# groups not starting at quads); q8/q4 groups of 32 for the int8-activation path.
GROUPED_CASES = [("bf16", 130, 37, 0, False), ("fp16", 130, 37, 0, False),
                 ("q8", 130, 42, 6, False), ("q8", 130, 42, 6, True), ("q4", 130, 42, 6, False),
                 ("q4", 130, 42, 6, True), ("q8", 130, 96, 32, False), ("q8", 130, 96, 32, True),
                 ("q4", 130, 96, 32, False), ("q4", 130, 96, 32, True), ("q5", 130, 42, 6, True),
                 ("q5", 130, 96, 32, False), ("q5", 130, 96, 32, True), ("q6", 130, 42, 6, True),
                 ("q6", 130, 96, 16, False), ("q6", 130, 96, 32, True)]
# Five experts' rows: none, one, every tile size on both levels and paths (1, 3, 7, 13, 70:
# several chunks), a lone expert, no rows at all.
GROUPED_COUNTS = ([1, 0, 3, 7, 13], [0, 70, 0, 1, 0], [13, 3, 1, 0, 70], [0, 0, 0, 0, 7],
                  [0, 0, 0, 0, 0])


def _stacked(experts: list[QuantizedWeight]) -> tuple[torch.Tensor, torch.Tensor | None,
                                                        torch.Tensor | None]:
    """The grouped kernel's operands: every expert's tensors stacked along a leading dim."""
    def stack(name: str) -> torch.Tensor | None:
        tensors = [getattr(qw, name) for qw in experts]
        return None if tensors[0] is None else torch.stack(tensors)
    return stack("codes"), stack("scales"), stack("offsets")


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt,n,k,group,offsets", GROUPED_CASES)
@pytest.mark.parametrize("int8", [False, True])
def test_grouped_kernel_gives_each_expert_the_bits_of_its_own_call(isa, fmt, n, k, group, offsets,
                                                                  int8):
    """grouped_quant_linear (a mixture-of-experts layer's experts in one call) splits its
    (expert, panel) items over the threads by cost; each expert's rows still get exactly what
    quant_linear gives them alone, whatever the other experts' row counts and the thread count,
    on the float path and the narrow-activation one: int8 (x quantized once for every expert;
    groups of 6, where it does not apply, run the float path) or, for bf16, bf16 x (on a
    CPU with AVX512-BF16; elsewhere, and for fp16, the flag is refused)."""
    ops = load_cpu_ops(isa)
    gen = torch.Generator().manual_seed(n * 1000 + k + group)
    experts = [_weight(fmt, n, k, group, offsets, gen) for _ in range(5)]
    codes, scales, offs = _stacked(experts)
    if int8 and fmt == "bf16":  # narrow: the bf16-activation path, on the weights in its layout
        experts = [qw.to_vnni() for qw in experts]
        codes, scales, offs = _stacked(experts)
    if int8 and fmt in HALF_FORMATS and not (fmt == "bf16" and has_bf16_activations(isa)):
        with pytest.raises(RuntimeError, match="bf16 activations|fp16 weights have none"):
            ops.grouped_quant_linear(torch.randn(1, k), codes, scales, offs, group, [1, 0, 0, 0, 0], n, True)
        return
    threads = torch.get_num_threads()
    try:
        for counts in GROUPED_COUNTS:
            x = torch.randn(sum(counts), k, generator=gen)
            alone = torch.cat([ops.quant_linear(rows, qw.codes, qw.scales, qw.offsets, group, n,
                                                None, int8)
                               for qw, rows in zip(experts, x.split(counts))])
            for num_threads in (1, 2, 3):
                torch.set_num_threads(num_threads)
                y = ops.grouped_quant_linear(x, codes, scales, offs, group, counts, n, int8)
                assert y.shape == (sum(counts), n) and y.dtype == torch.float32
                assert torch.equal(y, alone), (counts, num_threads)
    finally:
        torch.set_num_threads(threads)


def test_grouped_kernel_refuses_operands_that_do_not_fit():
    ops = load_cpu_ops()
    gen = torch.Generator().manual_seed(9)
    experts = [_weight("q4", 130, 96, 32, True, gen) for _ in range(3)]
    codes, scales, offs = _stacked(experts)
    x = torch.randn(4, 96, generator=gen)
    with pytest.raises(RuntimeError, match="add up to 3, x has 4 rows"):
        ops.grouped_quant_linear(x, codes, scales, offs, 32, [1, 2, 0], 130)
    with pytest.raises(RuntimeError, match="must not be negative"):
        ops.grouped_quant_linear(x, codes, scales, offs, 32, [5, -1, 0], 130)
    with pytest.raises(RuntimeError, match="one per expert"):
        ops.grouped_quant_linear(x, codes, scales, offs, 32, [4], 130)
    with pytest.raises(RuntimeError, match=r"codes must be contiguous \[experts"):
        ops.grouped_quant_linear(x, experts[0].codes, scales, offs, 32, [4], 130)
    with pytest.raises(RuntimeError, match=r"scales must be .*\[experts, P"):
        ops.grouped_quant_linear(x, codes, experts[0].scales, offs, 32, [4, 0, 0], 130)
    with pytest.raises(RuntimeError, match=r"offsets must be .* shaped \[3, 3, 3, 64\]"):
        ops.grouped_quant_linear(x, codes, scales, offs[:2], 32, [4, 0, 0], 130)
    with pytest.raises(RuntimeError, match="x has 64 columns, the weight 24 rows"):
        ops.grouped_quant_linear(torch.randn(4, 64), codes, scales, offs, 32, [4, 0, 0], 130)


def test_grouped_kernels_fake_gives_its_output_shape():
    """The fake implementation (a compiled graph's view of the op): [rows, out_features]."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    gen = torch.Generator().manual_seed(10)
    codes, scales, offs = _stacked([_weight("q8", 130, 96, 32, False, gen) for _ in range(2)])
    with FakeTensorMode() as mode:
        x = mode.from_tensor(torch.randn(5, 96))
        y = torch.ops.pagedllm.grouped_quant_linear(x, mode.from_tensor(codes),
                                                    mode.from_tensor(scales), None, 32, [2, 3],
                                                    130, True)
    assert y.shape == (5, 130) and y.dtype == torch.float32


@pytest.mark.slow
def test_the_avx512_build_compiles(tmp_path):
    """This CPU may not run x86-64-v4; its build of the linear kernels (and of the MoE op that
    calls them) must still compile."""
    compile_sources("v4", tmp_path, [CSRC / "skinny_gemm.cpp", CSRC / "quant_gemm.cpp",
                                     CSRC / "fused_moe.cpp"])
    assert (tmp_path / "quant_gemm.o").stat().st_size > 0
    assert (tmp_path / "fused_moe.o").stat().st_size > 0


def test_packing_holds_the_arrays_exactly():
    """from_q8/from_q4 take plain [out, in] arrays (what a GGUF/AWQ loader has); dequantize gives
    back code * scale + offset for every element, the panels' padding dropped."""
    gen = torch.Generator().manual_seed(5)
    n, k, g = 70, 64, 16
    scales = torch.rand(n, k // g, generator=gen).numpy()
    offsets = torch.randn(n, k // g, generator=gen).numpy()
    codes4 = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8).numpy()
    codes8 = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8).numpy()
    per_k = lambda a: torch.as_tensor(a).double().repeat_interleave(g, dim=1)  # noqa: E731
    q4 = QuantizedWeight.from_q4(codes4, scales, offsets, g)
    # quads of 4 k per column (the int8-activation path's dot products read them as they lie)
    assert q4.codes.shape == (2, k // 4, 32 * 4) and q4.scales.shape == (2, k // g, 64)
    assert torch.equal(q4.dequantize(torch.float64),
                       torch.as_tensor(codes4).double() * per_k(scales) + per_k(offsets))
    q8 = QuantizedWeight.from_q8(codes8, scales, None, g)
    assert q8.codes.shape == (2, k // 4, 64 * 4)
    assert torch.equal(q8.dequantize(torch.float64), torch.as_tensor(codes8).double() * per_k(scales))
    # in not a multiple of 4: the last quad padded with zero codes, dropped by dequantize
    scales7 = torch.rand(n, 7, generator=gen)
    odd = QuantizedWeight.from_q4(codes4[:, :42], scales7, None, 6)
    assert odd.codes.shape == (2, 11, 128)
    assert torch.equal(odd.dequantize(torch.float64), torch.as_tensor(codes4[:, :42]).double()
                       * scales7.double().repeat_interleave(6, dim=1))
    # q4 with offsets: half a byte + 8 bytes per 16 weights; the last panel's padding included
    assert q4.nbytes == 2 * 64 * (k // 2 + 2 * 4 * k // g)
    # bf16: the values themselves, columns j and j + 32 of a panel side by side in a 32-bit lane
    w = torch.randn(n, k, generator=gen).bfloat16()
    half = QuantizedWeight.from_half(w)
    assert half.codes.shape == (2, k, 64) and torch.equal(half.dequantize(torch.bfloat16), w)
    assert torch.equal(half.codes[0, :, 0], w[0]) and torch.equal(half.codes[0, :, 1], w[32])
    assert torch.equal(half.codes[1, :, 2], w[65]) and not half.codes[1, :, 3].any()  # row 97: padding
    # bf16_vnni (the bf16-activation path's): per block b of 32 k, 4 tiles t of 16 columns, each 16 pair rows
    # q of 16 columns c: column 16t + c's k = 32b + 2q + i at (b, t, q, c, i)
    vnni = half.to_vnni()
    assert vnni.codes.shape == (2, k // 32, 2048) and torch.equal(vnni.dequantize(torch.bfloat16), w)
    tiles = vnni.codes.view(2, k // 32, 4, 16, 16, 2)
    assert torch.equal(tiles[0, 0, 0, :, 0, 0], w[0, 0:32:2]) and torch.equal(tiles[0, 0, 0, :, 0, 1], w[0, 1:32:2])
    assert torch.equal(tiles[0, 1, 2, :, 5, 1], w[37, 33:64:2])
    assert torch.equal(tiles[1, 0, 0, :, 1].flatten(), w[65, :32]) and not tiles[1, :, 2, :, 1].any()  # row 97
    ids = torch.tensor([0, 65, 31, 32])
    assert torch.equal(vnni.rows(ids), w[ids]) and torch.equal(half.rows(ids), w[ids])
    # in not a multiple of 32: zero k pad the last block, dropped by dequantize; stacked experts
    # convert whole
    odd = QuantizedWeight.from_half(w[:, :41]).to_vnni()
    odd_tiles = odd.codes.view(2, 2, 4, 16, 16, 2)
    assert odd.codes.shape == (2, 2, 2048) and not odd_tiles[:, 1, :, 4, :, 1].any()  # k = 41
    assert not odd_tiles[:, 1, :, 5:].any() and odd_tiles[:, 1, :, 4, :, 0].any()  # k 42-63 / 40
    assert torch.equal(odd.dequantize(torch.bfloat16), w[:, :41])
    assert torch.equal(odd.rows(ids), w[ids, :41])
    stacked = QuantizedWeight.stack([half, QuantizedWeight.from_half(-w)]).to_vnni()
    assert torch.equal(stacked.expert(1).dequantize(torch.bfloat16), -w)

def test_q5_layout_places_each_fifth_bit_by_the_rule():
    """q5 (GGUF Q5_0): a quad block is q4's 128 nibble bytes of code + 16, then 32 plane bytes;
    the fifth bit of nibble h of nibble byte b = 4j + i (column j + 32h, k = 4q + i) is bit
    2 (b // 32) + h of plane byte b % 32 (what csrc/quant_gemm.cpp's HighBitPanels reads)."""
    n, k = 70, 12
    for column, kk in ((0, 0), (32, 1), (8, 0), (40, 2), (31, 3), (63, 9), (64, 5)):
        codes = torch.full((n, k), -16, dtype=torch.int8)  # code + 16 = 0: no bit set
        codes[column, kk] = 0  # code + 16 = 16: the fifth bit alone
        qw = QuantizedWeight.from_q5(codes, torch.ones(n, k // 4), None, 4)
        assert qw.codes.shape == (2, k // 4, 160) and not qw.codes[..., :128].any()
        j, h, quad = column % 64 % 32, column % 64 // 32, kk // 4
        b = 4 * j + kk % 4
        plane = qw.codes[column // 64, :, 128:]
        assert plane[quad, b % 32] == 1 << (2 * (b // 32) + h) and int(plane.count_nonzero()) == 1
        assert torch.equal(qw.dequantize(torch.float64), codes.double())
    gen = torch.Generator().manual_seed(6)
    codes = torch.randint(-16, 16, (n, 64), generator=gen)
    scales, offsets = torch.rand(n, 2, generator=gen), torch.randn(n, 2, generator=gen)
    qw = QuantizedWeight.from_q5(codes, scales, offsets, 32)
    per_k = lambda a: a.double().repeat_interleave(32, dim=1)  # noqa: E731
    expected = codes.double() * per_k(scales) + per_k(offsets)
    assert torch.equal(qw.dequantize(torch.float64), expected)
    # 5/8 of a byte a weight + 8 bytes per 32 (scale, offset); the last panel's padding included
    assert qw.nbytes == 2 * 64 * (64 * 5 // 8 + 2 * 4 * 2)
    with pytest.raises(ModelLoadError, match="-16..15"):
        QuantizedWeight.from_q5(codes + 1, scales, None, 32)


def test_q6_layout_places_each_bit_pair_by_the_rule():
    """q6 (GGUF Q6_K): q4's 128 nibble bytes of code + 32, then 64 plane bytes; the high bit
    pair of nibble h of nibble byte b = 4j + i (column j + 32h, k = 4q + i) is bits
    2 (2 (b // 64) + h), + 1 of plane byte b % 64 (csrc/quant_gemm.cpp's HighBitPanels)."""
    n, k = 70, 12
    for column, kk, pair in ((0, 0, 1), (32, 1, 2), (16, 0, 3), (48, 2, 1), (31, 3, 2),
                             (63, 9, 3), (64, 5, 1)):
        codes = torch.full((n, k), -32, dtype=torch.int8)  # code + 32 = 0: no bit set
        codes[column, kk] = 16 * pair - 32  # the pair alone
        qw = QuantizedWeight.from_q6(codes, torch.ones(n, k // 4), None, 4)
        assert qw.codes.shape == (2, k // 4, 192) and not qw.codes[..., :128].any()
        j, h, quad = column % 64 % 32, column % 64 // 32, kk // 4
        b = 4 * j + kk % 4
        plane = qw.codes[column // 64, :, 128:]
        assert plane[quad, b % 64] == pair << (2 * (2 * (b // 64) + h))
        assert int(plane.count_nonzero()) == 1
        assert torch.equal(qw.dequantize(torch.float64), codes.double())
    gen = torch.Generator().manual_seed(7)
    codes = torch.randint(-32, 32, (n, 64), generator=gen)
    scales = torch.rand(n, 4, generator=gen)
    qw = QuantizedWeight.from_q6(codes, scales, None, 16)
    assert torch.equal(qw.dequantize(torch.float64),
                       codes.double() * scales.double().repeat_interleave(16, dim=1))
    assert qw.nbytes == 2 * 64 * (64 * 6 // 8 + 4 * 4)  # 3/4 of a byte a weight + the scales
    with pytest.raises(ModelLoadError, match="-32..31"):
        QuantizedWeight.from_q6(codes + 1, scales, None, 16)


# (format, group size, groups per super-block): GGUF's K-quants (Q4_K: q4 32 x 8; Q5_K: q8 32 x
# 8; Q6_K: q6 16 x 16) and q5, whose records no GGUF type makes but the kernel reads alike.
FORM_CASES = [("q4", 32, 8), ("q8", 32, 8), ("q6", 16, 16), ("q5", 32, 8), ("q4", 64, 2)]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt,group,per_super", FORM_CASES)
def test_every_form_of_the_group_floats_gives_the_same_bits(isa, fmt, group, per_super):
    """Scales and offsets held as super-block records (an fp16 d and int8 multipliers: GGUF's
    K-quants) or as float16 give bit for bit what the same floats held as float32 give, on the
    float path and the int8 one, alone and grouped; and they take the bytes their form says."""
    ops = load_cpu_ops(isa)
    gen = torch.Generator().manual_seed(group + per_super)
    n, k, num_experts = 130, 2 * group * per_super, 2
    supers = k // (group * per_super)

    def weight(records: bool) -> QuantizedWeight:
        low, high = {"q4": (0, 16), "q5": (-16, 16), "q6": (-32, 32), "q8": (-128, 128)}[fmt]
        codes = torch.randint(low, high, (n, k), generator=gen,
                              dtype=torch.uint8 if fmt == "q4" else torch.int8)
        d = (torch.rand(n, supers, generator=gen) / 50).half().numpy()
        dmin = (torch.rand(n, supers, generator=gen) / 50).half().numpy()
        multipliers = torch.randint(-64, 64, (n, k // group), generator=gen, dtype=torch.int8)
        mins = torch.randint(0, 64, (n, k // group), generator=gen, dtype=torch.int8)
        scales, offsets = GroupScales(d, multipliers.numpy()), GroupScales(-dmin, mins.numpy())
        build = {"q4": QuantizedWeight.from_q4, "q5": QuantizedWeight.from_q5,
                 "q6": QuantizedWeight.from_q6, "q8": QuantizedWeight.from_q8}[fmt]
        qw = build(codes, scales, offsets, group)
        assert qw.scales.dtype == qw.offsets.dtype == torch.uint8  # records
        assert qw.scales.shape == (3, supers, 64 * (2 + per_super))
        if records:
            return qw
        # the same floats as float32 panels
        as_f32 = build(codes, torch.as_tensor(scales.values()), torch.as_tensor(offsets.values()),
                       group)
        assert as_f32.scales.dtype == torch.float32 and torch.equal(
            as_f32.dequantize(torch.float64), qw.dequantize(torch.float64))
        return dataclasses.replace(qw, scales=as_f32.scales, offsets=as_f32.offsets)

    pairs = []
    for _ in range(num_experts):
        state = gen.get_state()
        compact = weight(True)
        gen.set_state(state)
        pairs.append((compact, weight(False)))
    compact, wide = pairs[0]
    code_bytes = {"q4": 0.5, "q5": 0.625, "q6": 0.75, "q8": 1}[fmt]
    assert compact.nbytes == 3 * 64 * (k * code_bytes + 2 * (2 * supers + k // group))
    ids = torch.tensor([129, 0, 64, 7])
    assert torch.equal(compact.rows(ids), wide.rows(ids))
    # plain fp16-exact floats are held as float16
    halves = torch.rand(n, k // group, generator=gen).half().float()
    q8 = QuantizedWeight.from_q8(torch.ones(n, k, dtype=torch.int8), halves, 2 * halves, group)
    assert q8.scales.dtype == q8.offsets.dtype == torch.float16
    assert torch.equal(q8.dequantize(), (3 * halves).repeat_interleave(group, dim=1))
    for int8 in (False, True):
        for rows in (1, 5, 33, 257):
            x = torch.randn(rows, k, generator=gen)
            y = ops.quant_linear(x, compact.codes, compact.scales, compact.offsets, group, n, None,
                                 int8)
            assert torch.equal(y, ops.quant_linear(x, wide.codes, wide.scales, wide.offsets,
                                                   group, n, None, int8)), (int8, rows)
        x, counts = torch.randn(9, k, generator=gen), [4, 5]
        for kind in (0, 1):
            stacked = QuantizedWeight.stack([pair[kind] for pair in pairs])
            assert (stacked.scales.dtype == torch.uint8) == (kind == 0)
            y = ops.grouped_quant_linear(x, stacked.codes, stacked.scales, stacked.offsets, group,
                                         counts, n, int8)
            if kind == 0:
                reference = y
            else:
                assert torch.equal(y, reference), int8
    # the float path against float64 on the dequantized weight
    x, w64 = torch.randn(5, k, generator=gen), compact.dequantize(torch.float64)
    y = ops.quant_linear(x, compact.codes, compact.scales, compact.offsets, group, n, None, False)
    scale = (x.double().abs() @ w64.abs().T).amax()  # float32 rounding of the sums
    assert (y.double() - x.double() @ w64.T).abs().max() <= 2e-6 * scale


@pytest.mark.parametrize("fmt,n,k,group,offsets", CASES)
def test_rows_are_the_lookup_of_the_dequantized_weight(fmt, n, k, group, offsets):
    """QuantizedWeight.rows (a tied embedding reading from its quantized head) gives the rows a
    float32 embedding would hold: ``code * scale`` then ``+ offset``, bit for bit (half formats:
    the 16-bit values themselves), any ids in any order and repeated."""
    gen = torch.Generator().manual_seed(n + k)
    qw = _weight(fmt, n, k, group, offsets, gen)
    ids = torch.tensor([n - 1, 0, 33 % n, 63 % n, 64 % n, n - 1, 5 % n])
    rows = qw.rows(ids)
    if fmt in ("bf16", "fp16"):
        assert rows.dtype == qw.codes.dtype
        assert torch.equal(rows.double(), qw.dequantize(torch.float64)[ids])
        return
    if fmt in ("q5", "q6"):
        codes = _high_bit_codes(qw.codes, k, 1 if fmt == "q5" else 2)
    else:
        codes = _from_kgroups(qw.codes, k, 4)
    if fmt == "q4":
        codes = torch.cat((codes & 15, codes >> 4), dim=-1)
    codes = codes.transpose(1, 2).reshape(-1, k)[:n].float()  # [n, k] as the loader had them
    expected = codes * qw.scales.transpose(1, 2).reshape(-1, k // group)[:n].repeat_interleave(
        group, dim=1)
    if offsets:
        expected += qw.offsets.transpose(1, 2).reshape(-1, k // group)[:n].repeat_interleave(
            group, dim=1)
    assert rows.dtype == torch.float32 and torch.equal(rows, expected[ids])


def test_bad_arrays_are_refused_with_what_is_supported():
    codes = torch.zeros(4, 64, dtype=torch.uint8)
    with pytest.raises(ModelLoadError, match="0..15"):
        QuantizedWeight.from_q4(codes + 16, torch.ones(4, 2), None, 32)
    with pytest.raises(ModelLoadError, match="group size 48"):
        QuantizedWeight.from_q4(codes, torch.ones(4, 1), None, 48)
    with pytest.raises(ModelLoadError, match="scales must be floats shaped"):
        QuantizedWeight.from_q8(codes.to(torch.int8), torch.ones(4, 3), None, 32)
    with pytest.raises(ModelLoadError, match="int8"):
        QuantizedWeight.from_q8(codes, torch.ones(4, 2), None, 32)
    with pytest.raises(ValidationError, match="supported: q8_0, q4_0"):
        quantize_linear(torch.ones(4, 64), "q3_k")
    with pytest.raises(ValidationError, match="blocks of 32"):
        quantize_linear(torch.ones(4, 40), "q8_0")


@pytest.mark.parametrize("scheme", ["q8_0", "q4_0"])
def test_load_time_quantization_is_llama_cpps(scheme):
    gen = torch.Generator().manual_seed(6)
    w = torch.randn(70, 256, generator=gen)
    w[3, :32] = 0  # an all-zero block: scale 0, no division by zero
    w[4, :32] = 1  # ties of the largest magnitude
    qtype = getattr(gguf.GGMLQuantizationType, scheme.upper())
    ref = gguf.quants.dequantize(gguf.quants.quantize(w.numpy(), qtype), qtype)
    assert torch.equal(quantize_linear(w, scheme).dequantize(), torch.as_tensor(ref))


def test_a_quantized_linear_goes_through_linear():
    """A Linear holding a q4 weight (ragged 100 x 96) runs the kernel from forward and from
    ``linear``, on 3-D inputs, holding only the quantized weight."""
    gen = torch.Generator().manual_seed(7)
    layer = Linear(96, 100)
    layer.bias.data.normal_(generator=gen)
    qw = quantize_linear(torch.randn(100, 96, generator=gen), "q4_0")
    hold(layer, Quantized.of(qw))
    assert layer.weight is None and layer.weight_format.qweight is qw
    assert qw.nbytes < 100 * 96 * 4 / 4  # a quarter of float32's bytes, with the panels' padding
    x = torch.randn(2, 3, 96, generator=gen)
    ref = F.linear(x.double(), qw.dequantize(torch.float64), layer.bias.double())
    for y in (layer(x), linear(layer, x, layer.bias)):
        assert y.shape == (2, 3, 100)
        assert (y.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
    with pytest.raises(ModelLoadError, match="does not fit"):
        hold(Linear(64, 100), Quantized.of(qw))
    head = ParallelLMHead(96, 100)  # an lm_head (GGUF's output.weight) takes one the same way
    hold(head, Quantized.of(qw))
    logits = head(x)
    assert logits.dtype == torch.float32
    assert (logits.double() - (ref - layer.bias.double())).abs().max() <= 1e-5 * ref.abs().max()


@pytest.mark.skipif(native_isa() is None, reason="no tuned kernel for this CPU")
def test_a_bfloat16_models_linears_hold_half_panels(monkeypatch):
    """The planning pass (hold_half_layers) holds bf16 layers as half panels, the
    tied embedding reading its rows from the head's panels: one copy, the same values."""
    monkeypatch.setenv("PAGEDLLM_CPU_KERNELS", "auto")
    model = torch.nn.Module()
    model.a = Linear(32, 100)
    model.embed = VocabParallelEmbedding(100, 32)
    model.head = ParallelLMHead(32, 100)
    model.head.tie_to(model.embed)
    gen = torch.Generator().manual_seed(8)
    for p in model.parameters():
        p.data.normal_(generator=gen)
    model.to(torch.bfloat16)
    weights = {name: m.weight.detach().clone() for name, m in (("a", model.a), ("head", model.head))}
    ids = torch.tensor([0, 63, 64, 99])
    want_embed = model.embed(ids)
    monkeypatch.setattr(linear_kernel, "_MEASURED", {})
    hold_half_layers(model)
    choose_linear_kernels(model)
    assert model.a.weight is None and model.a.weight_format.qweight.format == "bf16"
    assert model.head.weight is None and model.embed.weight is None
    assert torch.equal(model.embed(ids), want_embed)
    x = torch.randn(5, 32, generator=gen).to(torch.bfloat16)
    for name, y in (("a", model.a(x)), ("head", model.head(x))):
        ref = F.linear(x.double(), weights[name].double(),
                       model.a.bias.double() if name == "a" else None)
        assert y.dtype in (torch.bfloat16, torch.float32)
        # the sums in float32, the result rounded once to bfloat16 (8 bits)
        assert (y.double() - ref).abs().max() <= 2 ** -7 * ref.abs().max()


@pytest.mark.parametrize("name", ["qwen2_bias", "qwen3_qknorm_tied"])
def test_a_q8_model_matches_transformers_on_the_dequantized_weights(name, tmp_path):
    """Every projection quantized to q8_0 at load (the lm_head kept): the paged model's log
    probs match transformers running the same weights dequantized (q8_0 round-trips exactly:
    quantizing a dequantized block gives back its codes and scale)."""
    from paged_helpers import PagedRunner
    from test_model_parity import CONFIGS, check_mixed_batch, make_hf_model, save

    from pagedllm.checkpoint.loader import load_model

    hf_model = make_hf_model(CONFIGS[name]())
    with torch.no_grad():
        for module_name, module in hf_model.named_modules():
            if isinstance(module, torch.nn.Linear) and module_name != "lm_head":
                module.weight.copy_(quantize_linear(module.weight, "q8_0").dequantize())
    model, _ = load_model(save(hf_model, tmp_path), torch.float32, torch.device("cpu"))
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    for layer in linears:
        hold(layer, Quantized.of(quantize_linear(layer.weight, "q8_0")))
    assert all(layer.weight is None and layer.weight_format.qweight.format == "q8" for layer in linears)
    check_mixed_batch(model, hf_model, PagedRunner(model, block_size=4))

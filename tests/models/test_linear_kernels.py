"""The linears' kernels (layers/linear.py, csrc/skinny_gemm.cpp): the skinny C++ kernel against
float64 at every row count a tile can take and at prefill sizes, ragged output and input sizes,
with bias; batch invariance (a row's result does not depend on the rows beside it), on every
x86 level this CPU can run (the engine's native build, and the x86-64-v3 / -v4 builds, whose
tiles differ); that a packed layer holds its weight once and runs the kernel at every row
count, and an unpacked one ``F.linear``."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.kernels.cpu_extension import can_run, load_cpu_ops
from pagedllm.layers.linear import Linear, hold, linear, pack_weight
from pagedllm.layers.weight_format import PANEL, Panels

pytestmark = pytest.mark.skipif(load_cpu_ops() is None, reason="no C++ compiler: no CPU kernels")

ISAS = [pytest.param(isa, marks=pytest.mark.skipif(not can_run(isa), reason=f"this CPU cannot run {isa}"))
        for isa in ("native", "v3", "v4")]


def _ops(isa: str):
    ops = load_cpu_ops(isa)
    assert ops is not None, f"the {isa} build failed"
    return ops


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.double(), w.double(), None if b is None else b.double())


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("out_features,in_features", [(96, 64), (100, 37), (5, 3), (33, 200), (64, 1536),
                                                      (16, 1024), (8, 301), (48, 77), (49, 40)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_skinny_kernel_matches_float64_at_every_tile_size(isa, out_features, in_features, with_bias):
    """Wide layers as panels of 64 columns; up to 48 outputs (a router's experts) as one narrow
    panel of 16, 32 or 48, which the kernel reads unpadded."""
    ops = _ops(isa)
    gen = torch.Generator().manual_seed(out_features * 1000 + in_features)
    w = torch.randn(out_features, in_features, generator=gen)
    b = torch.randn(out_features, generator=gen) if with_bias else None
    packed = pack_weight(w, b)
    width = PANEL if out_features > 48 else -(-out_features // 16) * 16
    assert packed is not None and packed.shape == (-(-out_features // width), in_features, width)
    # Every tile (AVX2: 1 x 8 vectors up to 12 rows, 6 x 2 above; AVX-512: 12 x 2 up to 64 rows,
    # 6 x 4 above) at every remainder of rows.
    for rows in [1, 2, 3, 4, 5, 6, 7, 11, 12, 13, 24, 25, 32, 33, 37, 64, 65, 66, 70, 71, 125, 300]:
        x = torch.randn(rows, in_features, generator=gen)
        y = ops.packed_linear(x, packed, out_features, b)
        assert y.shape == (rows, out_features) and y.dtype == torch.float32
        ref = _reference(x, w, b)
        scale = (x.double().abs() @ w.double().abs().T).amax()
        assert (y.double() - ref).abs().max() <= 2e-6 * scale, rows


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("out_features", [200, 16, 40])
def test_a_rows_result_does_not_depend_on_its_batch(isa, out_features):
    """Every output is summed in the same order whatever the number of rows and the row's
    place in its tile: the same input row gives the same bits alone or in any batch (panels
    and narrow panels: a router's logits choose a token's experts)."""
    ops = _ops(isa)
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(out_features, 513, generator=gen)
    packed = pack_weight(w, None)
    x = torch.randn(300, 513, generator=gen)  # 300 rows: several chunks of the many-rows tile
    full = ops.skinny_gemm(x, packed, out_features)
    for rows in (1, 2, 3, 4, 5, 6, 7, 12, 13, 30, 64, 65, 66, 130):
        for start in (0, 5, 300 - rows):
            part = ops.skinny_gemm(x[start:start + rows], packed, out_features)
            assert torch.equal(part, full[start:start + rows]), (rows, start)


@pytest.mark.parametrize("isa", ISAS)
def test_grouped_kernel_gives_each_group_the_bits_of_its_own_call(isa):
    """grouped_packed_linear (a mixture-of-experts layer's experts in one call) splits its
    (expert, panel) items over the threads by cost; each expert's rows still get exactly what
    packed_linear gives them alone, whatever the other experts' row counts (none, one, every
    tile size, several chunks) and the thread count."""
    ops = _ops(isa)
    gen = torch.Generator().manual_seed(5)
    weights = [torch.randn(130, 200, generator=gen) for _ in range(6)]
    panels = torch.stack([pack_weight(w, None) for w in weights])
    threads = torch.get_num_threads()
    try:
        for counts in ([1, 0, 2, 0, 0, 1], [0, 0, 0, 0, 0, 3], [4, 5, 13, 65, 130, 0],
                       [0, 0, 0, 0, 0, 0]):
            x = torch.randn(sum(counts), 200, generator=gen)
            alone = torch.cat([ops.packed_linear(rows, panels[e], 130, None)
                               for e, rows in enumerate(x.split(counts))])
            for num_threads in (1, 2, 3):
                torch.set_num_threads(num_threads)
                assert torch.equal(ops.grouped_packed_linear(x, panels, counts, 130), alone), \
                    (counts, num_threads)
    finally:
        torch.set_num_threads(threads)
    with pytest.raises(RuntimeError, match="add up to 3, x has 4 rows"):
        ops.grouped_packed_linear(torch.randn(4, 200), panels, [1, 2, 0, 0, 0, 0], 130)
    with pytest.raises(RuntimeError, match="one row count per expert"):
        ops.grouped_packed_linear(torch.randn(4, 200), panels, [4], 130)


def test_every_level_computes_the_same_products():
    """The tiles differ between levels; every level this CPU can run agrees with the engine's
    build (each is held to float64 above; the same order of sums makes them agree to the bit
    where the compiler contracts the same FMAs, which this does not require)."""
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(130, 300, generator=gen)
    packed = pack_weight(w, None)
    x = torch.randn(70, 300, generator=gen)
    runnable = [isa for isa in ("native", "v3", "v4") if can_run(isa)]
    outputs = [_ops(isa).skinny_gemm(x, packed, 130) for isa in runnable]
    assert len(outputs) >= 2 or not can_run("v3")
    for out in outputs[1:]:
        torch.testing.assert_close(out, outputs[0], rtol=1e-6, atol=1e-5)


def test_non_contiguous_empty_and_3d_inputs():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(70, 48, generator=gen)
    packed = pack_weight(w, None)
    wide = torch.randn(9, 96, generator=gen)
    x = wide[:, ::2]  # a strided view
    op = torch.ops.pagedllm.packed_linear
    torch.testing.assert_close(op(x, packed, 70, None), F.linear(x, w), rtol=1e-5, atol=1e-5)
    assert op(torch.empty(0, 48), packed, 70, None).shape == (0, 70)
    x3 = torch.randn(2, 5, 48, generator=gen)
    torch.testing.assert_close(op(x3, packed, 70, None), F.linear(x3, w), rtol=1e-5, atol=1e-5)


def test_a_packed_layer_holds_one_copy_and_runs_the_skinny_kernel_at_every_row_count():
    """Which kernel ran shows in the bits: each result is exactly what the skinny kernel alone
    returns (decode and prefill sizes alike), and differs from MKL's."""
    gen = torch.Generator().manual_seed(2)
    layer = Linear(1000, 64)
    # K = 1000: the skinny kernel sums 64-wide blocks, MKL otherwise, so their bits differ.
    w, b = torch.randn(64, 1000, generator=gen), torch.randn(64, generator=gen)
    layer.weight.data, layer.bias.data = w.clone(), b.clone()
    plain = Linear(1000, 64)
    plain.weight.data, plain.bias.data = w.clone(), b.clone()
    panels = Panels.pack(layer.weight)
    assert panels is not None and panels.check(layer.bias)
    hold(layer, panels)
    assert layer.weight is None and isinstance(layer.weight_format, Panels)  # one copy: the panels
    assert [name for name, _ in layer.named_parameters()] == ["bias"]
    for rows in (1, 4, 5, 64, 65, 300):
        x = torch.randn(rows, 1000, generator=gen)
        skinny = torch.ops.pagedllm.skinny_gemm(x, layer.weight_format.packed, 64) + b
        mkl = F.linear(x, w, b)
        assert torch.equal(layer(x), skinny), rows
        assert not torch.equal(skinny, mkl)  # the two kernels round differently: the check can fail
        assert torch.equal(plain(x), mkl)    # not packed: F.linear
        assert torch.equal(linear(plain, x, b), mkl)


def test_rows_of_panels_are_the_embedding_lookup():
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(130, 24, generator=gen)
    packed = pack_weight(w, None)
    ids = torch.tensor([0, 63, 64, 129, 5, 5])
    assert torch.equal(Panels(packed, 130).rows(ids), w[ids])
    narrow = torch.randn(20, 24, generator=gen)  # one panel of 32
    ids = torch.tensor([0, 19, 7])
    assert torch.equal(Panels(pack_weight(narrow, None), 20).rows(ids), narrow[ids])


def test_pack_skips_what_the_kernel_cannot_take():
    layer = Linear(8, 8).to(torch.bfloat16)
    assert Panels.pack(layer.weight) is None
    assert layer.weight is not None and not isinstance(layer.weight_format, Panels)


def test_pagedllm_cpu_isa_names_the_engine_builds_level(monkeypatch):
    """PAGEDLLM_CPU_ISA=v3 builds the engine's kernels as AVX2 code (the AVX2 benchmarks on an
    AVX-512 CPU): its -march, its level and build tag, no bf16 activations; a bad name is a
    clear error."""
    from pagedllm.kernels import cpu_extension as ce

    if not ce.can_run("v3"):
        pytest.skip("needs a CPU that runs x86-64-v3 code")
    monkeypatch.delenv(ce.ENV_CPU_ISA, raising=False)
    native_tag = ce.build_tag()
    assert "-march=native" in ce._cflags("native")
    monkeypatch.setenv(ce.ENV_CPU_ISA, "v3")
    assert "-march=x86-64-v3" in ce._cflags("native") and "-march=native" not in ce._cflags("native")
    assert ce.native_isa() == "v3" and not ce.has_bf16_activations()
    assert "PAGEDLLM_CPU_ISA=v3" in ce.cpu_description()
    assert ce.build_tag() != native_tag
    monkeypatch.setenv(ce.ENV_CPU_ISA, "avx3")
    with pytest.raises(ValueError, match="PAGEDLLM_CPU_ISA='avx3' is unsupported; supported: native, v3, v4"):
        ce.native_isa()

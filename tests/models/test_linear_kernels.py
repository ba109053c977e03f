"""The linears' kernels (layers/linear.py): the skinny C++ kernel against float64, at every row
count a tile can take and at prefill sizes, ragged output and input sizes, with bias; that a
prepacked layer runs it at every row count and an unpacked one ``F.linear``; and batch invariance
(a row's result does not depend on the rows beside it)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.layers.cpu_extension import load_cpu_ops
from pagedllm.layers.linear import _PANEL, Linear, _prepack, linear, prepack_linear_weights

pytestmark = pytest.mark.skipif(load_cpu_ops() is None, reason="no C++ compiler: no CPU kernels")


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.double(), w.double(), None if b is None else b.double())


@pytest.mark.parametrize("out_features,in_features", [(96, 64), (100, 37), (5, 3), (33, 200), (64, 1536)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_skinny_kernel_matches_float64_at_every_tile_size(out_features, in_features, with_bias):
    gen = torch.Generator().manual_seed(out_features * 1000 + in_features)
    w = torch.randn(out_features, in_features, generator=gen)
    b = torch.randn(out_features, generator=gen) if with_bias else None
    packed = _prepack(w, b)
    assert packed is not None and packed.shape == (-(-out_features // _PANEL), in_features, _PANEL)
    # Both tiles (12 x 2 vectors up to 64 rows, 6 x 4 above) at every remainder of rows.
    for rows in [1, 2, 11, 12, 13, 24, 25, 32, 33, 37, 64, 65, 66, 70, 71, 125, 300]:
        x = torch.randn(rows, in_features, generator=gen)
        y = linear(x, w, b, packed)
        assert y.shape == (rows, out_features) and y.dtype == torch.float32
        ref = _reference(x, w, b)
        scale = (x.double().abs() @ w.double().abs().T).amax()
        assert (y.double() - ref).abs().max() <= 2e-6 * scale, rows


def test_non_contiguous_and_empty_inputs():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(70, 48, generator=gen)
    packed = _prepack(w, None)
    wide = torch.randn(9, 96, generator=gen)
    x = wide[:, ::2]  # a strided view
    torch.testing.assert_close(linear(x, w, None, packed), F.linear(x, w), rtol=1e-5, atol=1e-5)
    assert linear(torch.empty(0, 48), w, None, packed).shape == (0, 70)


def test_a_prepacked_layer_runs_the_skinny_kernel_at_every_row_count():
    """pagedllm::packed_linear picks the kernel in C++; which one ran shows in the bits: each
    result is exactly what the skinny kernel alone returns (decode and prefill sizes alike)."""
    gen = torch.Generator().manual_seed(2)
    # K = 1000: the skinny kernel sums 64-wide blocks, MKL otherwise, so their bits differ.
    w, b = torch.randn(64, 1000, generator=gen), torch.randn(64, generator=gen)
    packed = _prepack(w, b)
    for rows in (1, 64, 65, 300, 2048):
        x = torch.randn(rows, 1000, generator=gen)
        skinny = torch.ops.pagedllm.skinny_gemm(x, packed, 64) + b
        mkl = F.linear(x, w, b)
        assert torch.equal(linear(x, w, b, packed), skinny), rows
        assert not torch.equal(skinny, mkl)  # the two kernels round differently: the check can fail
    x = torch.randn(3, 1000, generator=gen)
    assert torch.equal(linear(x, w, b, None), F.linear(x, w, b))  # not prepacked: F.linear


def test_a_rows_result_does_not_depend_on_its_batch():
    """Every output is summed in the same order whatever the number of rows and the row's
    place in its tile: the same input row gives the same bits alone or in any batch."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(200, 512, generator=gen)
    packed = _prepack(w, None)
    x = torch.randn(300, 512, generator=gen)  # 300 rows: five chunks of the 6 x 4 tile
    # 64 rows or fewer: the 12 x 2 tile, whose sums must match the 6 x 4 tile's bit for bit
    full = linear(x, w, None, packed)
    for rows in (1, 7, 12, 13, 30, 64, 65, 66, 130):
        for start in (0, 5, 300 - rows):
            part = linear(x[start:start + rows], w, None, packed)
            assert torch.equal(part, full[start:start + rows]), (rows, start)


def test_prepack_gives_every_float32_linear_its_panels_and_skips_other_dtypes():
    model = torch.nn.Sequential(Linear(16, 40), Linear(40, 8, bias=False))
    assert prepack_linear_weights(model) == 2
    assert all(m.packed_weight is not None for m in model)
    x = torch.randn(4, 16)
    torch.testing.assert_close(model(x), F.linear(F.linear(x, model[0].weight, model[0].bias), model[1].weight),
                               rtol=1e-5, atol=1e-5)
    assert _prepack(torch.randn(8, 8, dtype=torch.bfloat16), None) is None

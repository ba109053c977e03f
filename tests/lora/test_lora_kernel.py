"""pagedllm::lora_shrink_expand (kernels/csrc/lora_sgmv.cpp) against a plain per-row reference:
rows of mixed slots and base rows, ranks below the held rank (zero padding), the projections of
fused qkv and gate_up layers in their own columns, float32 and bf16; and its AVX-512 build
compiles on a CPU that cannot run it."""
from __future__ import annotations

import pytest
import torch

from pagedllm.kernels.cpu_extension import CSRC, compile_sources, load_cpu_ops

ops = load_cpu_ops()
pytestmark = pytest.mark.skipif(ops is None, reason="no C++ kernels on this CPU")


def _weights(projections, in_features, slots, rank, ranks, dtype, gen):
    """The op's layout, with slot s's projection j trained at ranks[s][j] (0: untrained)."""
    out = max(o + n for o, n in projections)
    lora_a = torch.zeros(slots, len(projections) * rank, in_features)
    lora_b = torch.zeros(slots, rank, out)
    for s in range(slots):
        for j, (o, n) in enumerate(projections):
            r = ranks[s][j]
            lora_a[s, j * rank:j * rank + r] = torch.randn(r, in_features, generator=gen)
            lora_b[s, :r, o:o + n] = torch.randn(r, n, generator=gen) / 4
    return lora_a.to(dtype), lora_b.to(dtype)


def _reference(x, y, lora_a, lora_b, token_slots, projections, rank):
    want = y.double().clone()
    for t in range(x.shape[0]):
        s = int(token_slots[t])
        if s < 0:
            continue
        for j, (o, n) in enumerate(projections):
            shrunk = lora_a[s, j * rank:(j + 1) * rank].double() @ x[t].double()
            want[t, o:o + n] += shrunk @ lora_b[s, :, o:o + n].double()
    return want


@pytest.mark.parametrize("projections", [[(0, 64), (64, 32), (96, 32)], [(0, 200), (200, 200)], [(0, 77)]],
                         ids=["qkv", "gate_up", "down"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 37])
def test_matches_the_per_row_reference(projections, dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    slots, rank, in_features = 4, 8, 75  # 75: a tail past the last full vector
    ranks = [[8] * 3, [4, 0, 8], [0] * 3, [2, 8, 1]]  # slot 2 resident but unused by any row
    lora_a, lora_b = _weights(projections, in_features, slots, rank, [r[:len(projections)] for r in ranks],
                              dtype, gen)
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    y = torch.randn(rows, max(o + n for o, n in projections), generator=gen).to(dtype)
    token_slots = torch.tensor([[-1, 0, 3, 1, 0][t % 5] for t in range(rows)] + [2, 2])  # longer than x
    got = y.clone()
    ops.lora_shrink_expand(x, got, lora_a, lora_b, token_slots,
                           [o for o, _ in projections], [n for _, n in projections])
    want = _reference(x, y, lora_a, lora_b, token_slots, projections, rank)
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-2, atol=3e-2)
    torch.testing.assert_close(got.double(), want, **tol)
    assert torch.equal(got[token_slots[:rows] < 0], y[token_slots[:rows] < 0])  # base rows untouched


def test_a_row_does_not_depend_on_its_batch():
    gen = torch.Generator().manual_seed(0)
    projections = [(0, 96), (96, 96)]
    lora_a, lora_b = _weights(projections, 64, 3, 8, [[8, 8]] * 3, torch.float32, gen)
    x, y = torch.randn(9, 64, generator=gen), torch.randn(9, 192, generator=gen)
    slots = torch.tensor([0, 1, 2, 0, 0, 1, -1, 2, 0])
    batch = y.clone()
    ops.lora_shrink_expand(x, batch, lora_a, lora_b, slots, [0, 96], [96, 96])
    for t in range(9):
        alone = y[t:t + 1].clone()
        ops.lora_shrink_expand(x[t:t + 1], alone, lora_a, lora_b, slots[t:t + 1], [0, 96], [96, 96])
        assert torch.equal(alone[0], batch[t])


def test_bad_input_is_refused():
    lora_a, lora_b = torch.zeros(2, 8, 16), torch.zeros(2, 8, 32)
    x, y = torch.zeros(1, 16), torch.zeros(1, 32)
    with pytest.raises(RuntimeError, match="slot 2 is not -1 or below 2"):
        ops.lora_shrink_expand(x, y, lora_a, lora_b, torch.tensor([2]), [0], [32])
    with pytest.raises(RuntimeError, match="must lie in"):
        ops.lora_shrink_expand(x, y, lora_a, lora_b, torch.tensor([0]), [8], [32])


@pytest.mark.slow
def test_the_avx512_build_compiles(tmp_path):
    compile_sources("v4", tmp_path, [CSRC / "lora_sgmv.cpp"])
    assert (tmp_path / "lora_sgmv.o").stat().st_size > 0


def test_the_torch_fallback_matches_the_op():
    """A CPU without the kernels computes the same update with torch's ops (lora/graph_weights.py)."""
    from pagedllm.lora.graph_weights import _masked_shrink_expand

    gen = torch.Generator().manual_seed(3)
    projections = [(0, 64), (64, 32), (96, 32)]
    lora_a, lora_b = _weights(projections, 40, 3, 8, [[8, 4, 0], [2, 8, 8], [8, 8, 8]], torch.float32, gen)
    x, y = torch.randn(6, 40, generator=gen), torch.randn(6, 128, generator=gen)
    slots = torch.tensor([2, -1, 0, 0, 1, 2, 1])
    by_op, by_torch = y.clone(), y.clone()
    ops.lora_shrink_expand(x, by_op, lora_a, lora_b, slots, [0, 64, 96], [64, 32, 32])
    _masked_shrink_expand(x, by_torch, lora_a, lora_b, slots, [0, 64, 96], [64, 32, 32])
    torch.testing.assert_close(by_op, by_torch, rtol=1e-5, atol=1e-5)
    assert not torch.equal(by_op, y)

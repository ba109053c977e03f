"""The startup choice of a linear kernel per layer shape (weight_plan/linear_choice.py): measured,
one choice per shape, torch's matmul only when clearly faster, one log line; forced by
PAGEDLLM_CPU_KERNELS; torch's matmul on a CPU nobody tuned the kernel for."""
from __future__ import annotations

import logging
import math

import pytest
import torch

from pagedllm.kernels.cpu_extension import load_cpu_ops, native_isa
from pagedllm.layers import Linear, ParallelLMHead, VocabParallelEmbedding
from pagedllm.layers.weight_format import Panels
from pagedllm.weight_plan import linear_choice as linear_kernel
from pagedllm.weight_plan.plan import choose_linear_kernels

pytestmark = pytest.mark.skipif(native_isa() is None or load_cpu_ops() is None,
                                reason="no tuned kernel for this CPU")


class _Model(torch.nn.Module):
    """Two layers of one shape, one of another, and a head tied to the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = Linear(32, 48), Linear(32, 48), Linear(48, 16, bias=False)
        self.embed = VocabParallelEmbedding(100, 32)
        self.head = ParallelLMHead(32, 100)
        self.head.tie_to(self.embed)
        for p in self.parameters():
            p.data.normal_()


@pytest.fixture
def auto(monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CPU_KERNELS", "auto")
    monkeypatch.setattr(linear_kernel, "_MEASURED", {})


def test_each_shape_keeps_the_kernel_unless_torch_is_clearly_faster(auto, monkeypatch, caplog):
    speedups = {(48, 32): 0.5, (16, 48): 1 / linear_kernel.TORCH_MARGIN + 0.05, (100, 32): 2.0}
    calls = []

    def fake_measure(layer):
        calls.append(tuple(layer.weight.shape))
        return speedups[tuple(layer.weight.shape)]

    monkeypatch.setattr(linear_kernel, "_measure", fake_measure)
    model = _Model()
    x = torch.randn(3, 32)
    want_a, want_embed = model.a(x), model.embed(torch.tensor([0, 63, 64, 99]))
    with caplog.at_level(logging.INFO, logger="pagedllm.weight_plan.linear_choice"):
        choices = choose_linear_kernels(model)
    assert sorted(calls) == sorted(speedups)  # one layer of each shape measured, once
    assert {(c.out_features, c.in_features): c.packed for c in choices} == {
        (48, 32): False, (16, 48): True, (100, 32): True}
    # torch clearly faster (0.5x): both layers of the shape keep their matrix, nothing else
    assert model.a.weight is not None and not isinstance(model.a.weight_format, Panels)
    assert model.b.weight is not None and not isinstance(model.b.weight_format, Panels)
    # a near tie stays on the kernel, which holds only its panels
    assert model.c.weight is None and isinstance(model.c.weight_format, Panels)
    # the tied embedding reads its rows from the head's panels: one copy of the matrix
    assert model.head.weight is None and model.embed.weight is None
    assert model.embed.weight_format is model.head.weight_format
    assert torch.equal(model.embed(torch.tensor([0, 63, 64, 99])), want_embed)
    assert torch.equal(model.a(x), want_a)
    (line,) = [r.getMessage() for r in caplog.records if "linears on" in r.getMessage()]
    assert "2 of 3 layer shapes" in line and "48x32: 0.50x" in line and "100x32: 2.00x" in line

    # A second engine in the process makes the same choice without measuring again.
    calls.clear()
    choose_linear_kernels(_Model())
    assert calls == []


def test_the_measurement_is_real(auto):
    layer = Linear(256, 192)
    speedup = linear_kernel._measure(layer)
    assert math.isfinite(speedup) and speedup > 0
    # measuring changes nothing
    assert layer.weight is not None and not isinstance(layer.weight_format, Panels)


def test_forced_choices_and_a_bad_value(monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CPU_KERNELS", "torch")
    model = _Model()
    choices = choose_linear_kernels(model)
    assert not any(c.packed for c in choices)
    assert all(not isinstance(m.weight_format, Panels) for m in (model.a, model.c, model.head))
    monkeypatch.setenv("PAGEDLLM_CPU_KERNELS", "pagedllm")
    model = _Model()
    choose_linear_kernels(model)
    assert all(m.weight is None for m in (model.a, model.b, model.c, model.head))
    monkeypatch.setenv("PAGEDLLM_CPU_KERNELS", "fast")
    with pytest.raises(ValueError, match="PAGEDLLM_CPU_KERNELS"):
        choose_linear_kernels(_Model())


def test_a_cpu_nobody_tuned_for_runs_torch_everywhere(auto, monkeypatch):
    monkeypatch.setattr(linear_kernel, "native_isa", lambda: None)
    model = _Model()
    choices = choose_linear_kernels(model)
    assert choices and not any(c.packed for c in choices)
    assert all(m.weight is not None and not isinstance(m.weight_format, Panels)
               for m in (model.a, model.c, model.head))

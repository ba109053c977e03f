"""The warm compiled forward's call (runner/graph_call.py): where each tensor the graph reads
lives, and a compiled model that sees its weights change after compile as the eager one does.

The compiled test compiles the demo model (~15-60 s on 2 cores): marked slow."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from pagedllm.runner.graph_call import GraphCall, tensor_places

DEMO_MODEL = Path(__file__).resolve().parents[2].parent / "shared" / "models" / "stories260K" / "hf"
CPU = torch.device("cpu")


class _Format:
    """A weight format: a plain object holding a tensor (as the layers' formats do)."""

    def __init__(self, packed: torch.Tensor) -> None:
        self.packed = packed


def test_tensor_places_finds_every_holder():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2, bias=False))
    model[1].weight = model[0].weight  # tied: found once, in a module's parameters
    model[0].fmt = _Format(torch.zeros(3))
    model.register_buffer("table", torch.ones(4))
    model.extra = [torch.zeros(1), (torch.zeros(2),)]
    places = tensor_places(model)
    assert places[id(model[0].bias)] == (model[0]._parameters, "bias")
    holder, key = places[id(model[0].weight)]
    assert key == "weight" and holder in (model[0]._parameters, model[1]._parameters)
    assert places[id(model[0].fmt.packed)] == (vars(model[0].fmt), "packed")
    assert places[id(model.table)] == (model._buffers, "table")
    assert places[id(model.extra[0])] == (model.extra, 0)
    assert places[id(model.extra[1][0])] == (model.extra[1], 0)
    for holder, key in places.values():  # every place reads back its tensor
        assert isinstance(holder[key], torch.Tensor)


@pytest.mark.slow
def test_compiled_forward_sees_weights_changed_after_compile():
    """The warm forward calls the graph on tensors found once: a weight written in place and a
    weight replaced by another tensor are both seen by the next call, as eagerly."""
    from pagedllm.checkpoint.loader import load_model
    from pagedllm.runner.compile import CompiledForward

    model = load_model(str(DEMO_MODEL), torch.float32, CPU)[0]
    compiled = CompiledForward(model, CPU)
    compiled.warmup(4, CPU)
    assert isinstance(compiled._call, GraphCall)  # the graph called directly, not dynamo's bytecode
    ids, positions = torch.tensor([1, 365, 264]), torch.arange(3)

    def forward() -> torch.Tensor:
        with torch.inference_mode():
            got, want = compiled(ids, positions), model(ids, positions)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        return got

    before = forward()
    norm = model.model.norm
    with torch.no_grad():
        norm.weight.mul_(1.5)  # in place: the same tensor, new values
    in_place = forward()
    assert not torch.allclose(in_place, before)
    norm.weight = nn.Parameter(torch.linspace(0.5, 2.0, norm.weight.shape[0]))  # another tensor in its place
    replaced = forward()
    assert not torch.allclose(replaced, in_place)
    # A token count not seen before, then one seen before: the counts the graph is given.
    for n in (5, 1, 5):
        with torch.inference_mode():
            got = compiled(torch.arange(1, n + 1), torch.arange(n))
            torch.testing.assert_close(got, model(torch.arange(1, n + 1), torch.arange(n)), rtol=1e-4, atol=1e-4)

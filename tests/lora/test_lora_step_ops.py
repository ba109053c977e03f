"""A decode step's adapter cost in ops (counted, not timed): the step's mapping is built once
and reused while the batch's adapters stay the same, and each adapted layer adds one op (the
grouped shrink and expand) whatever the projections it trains and however many adapters the
step uses."""
from __future__ import annotations

import collections

import pytest
import torch
from lora_helpers import build_adapter, build_base
from torch.utils._python_dispatch import TorchDispatchMode

from pagedllm import LLM, LoRARequest
from pagedllm.lora.mapping import set_lora_mapping


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def manager(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_ops")
    base = build_base("qwen2", root / "base")
    build_adapter(base, root / "a", 8, 16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                             "up_proj", "down_proj"], seed=1)
    build_adapter(base, root / "b", 4, 8, ["q_proj", "v_proj"], seed=2)
    llm = LLM(str(base), device="cpu", dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16)
    manager = llm.llm_engine.executor.runner.lora_manager
    for i, name in enumerate("ab"):
        manager.add_lora(LoRARequest(name, i + 1, str(root / name)))
    yield manager
    del llm


def test_mapping_is_built_once_while_the_batch_is_the_same(manager):
    a, b = LoRARequest("a", 1), LoRARequest("b", 2)
    cpu = torch.device("cpu")
    first = manager.step_mapping([(a, 1), (None, 1)], cpu)
    assert manager.step_mapping([(a, 1), (None, 1)], cpu) is first
    other = manager.step_mapping([(a, 1), (b, 1)], cpu)
    assert other is not first and other.row_slots.tolist() == [manager.slot_of[1], manager.slot_of[2]]
    assert manager.step_mapping([(None, 2)], cpu) is None


@pytest.mark.parametrize("layer", ["model.layers.0.self_attn.qkv_proj", "model.layers.0.mlp.gate_up_proj",
                                   "model.layers.1.mlp.down_proj"])
def test_one_adapter_adds_one_op_per_layer(manager, layer):
    fmt = manager.layers[layer]
    x = torch.randn(1, manager.targets[layer.replace("qkv_proj", "q_proj").replace(
        "gate_up_proj", "gate_proj")].full_in)
    mapping = manager.step_mapping([(LoRARequest("a", 1), 1)], torch.device("cpu"))
    with set_lora_mapping(mapping):
        fmt.apply(x, None)  # the first step after the adapters changed lays out their slots
    base_ops, lora_ops = _CountOps(), _CountOps()
    with base_ops:
        base = fmt.apply(x, None)
    with lora_ops, set_lora_mapping(mapping):
        adapted = fmt.apply(x, None)
    added = lora_ops.counts - base_ops.counts
    assert dict(added) == {"pagedllm.lora_shrink_expand": 1}, added
    assert not torch.equal(base, adapted)  # the adapter did apply


@pytest.mark.parametrize("projections", [[(0, 64), (64, 32), (96, 32)], [(0, 96), (96, 96)], [(0, 64)]],
                         ids=["qkv", "gate_up", "down"])
def test_compiled_layer_ops_and_values(projections):
    """The compiled forward's adapter term of one layer (lora/graph_weights.py, run eagerly here to
    count what the graph holds): one op (pagedllm::lora_shrink_expand) whatever the projections,
    and each row gets its own slot's update only."""
    from pagedllm.lora.graph_weights import LoRAGraphInputs, SlotWeights
    from pagedllm.lora.peft_loader import LoRAProjection
    from pagedllm.lora.targets import LoRATarget

    torch.manual_seed(0)
    inputs = LoRAGraphInputs(8, torch.device("cpu"))
    graph = SlotWeights(inputs, projections, 48, 3, 8, torch.float32, torch.device("cpu"))
    out = sum(size for _, size in projections)
    updates = {}
    for slot, rank in ((0, 4), (2, 8)):
        held = [LoRAProjection(LoRATarget("layer", o, n, 0, n, 0, 48, 48), torch.randn(rank, 48), torch.randn(n, rank))
                for o, n in projections[slot % len(projections):]]  # slot 2 leaves the first projection alone
        graph.set_slot(slot, held)
        update = torch.zeros(48, out)
        for p in held:
            update[:, p.target.out_offset:p.target.out_offset + p.target.out_size] = p.lora_a.T @ p.lora_b.T
        updates[slot] = update
    inputs.write(((2, 2), (None, 1), (0, 1)))
    x, y = torch.randn(4, 48), torch.randn(4, out)
    counted, got = _CountOps(), y.clone()
    with counted:
        graph.apply(x, got)
    assert dict(counted.counts) == {"pagedllm.lora_shrink_expand": 1}, counted.counts
    want = y + torch.cat([x[:2] @ updates[2], torch.zeros(1, out), x[3:] @ updates[0]])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_one_layout_serves_every_row_count(manager, monkeypatch):
    """A layer holds its adapters once (one SlotWeights: an A and a B tensor), and both ways of
    applying them read it: the grouped op (few rows) and torch's matmuls per adapter (many rows)
    give each row its own adapter's update, the base rows none."""
    from pagedllm.lora.mapping import build_lora_mapping

    fmt = manager.layers["model.layers.0.self_attn.qkv_proj"]
    a, b = manager.slot_of[1], manager.slot_of[2]
    x = torch.randn(6, manager.targets["model.layers.0.self_attn.q_proj"].full_in)
    batch = [(a, 2), (None, 1), (b, 3)]
    base = fmt.apply(x, None)
    with set_lora_mapping(build_lora_mapping(batch, torch.device("cpu"))):
        grouped = fmt.apply(x, None)
    monkeypatch.setattr("pagedllm.lora.mapping.DENSE_MAX_ROWS", 0)
    mapping = build_lora_mapping(batch, torch.device("cpu"))
    assert mapping.row_slots is None and len(mapping.groups) == 2
    with set_lora_mapping(mapping):
        per_adapter = fmt.apply(x, None)
    torch.testing.assert_close(per_adapter, grouped, rtol=1e-5, atol=1e-5)
    assert torch.equal(grouped[2], base[2]) and not torch.equal(grouped[[0, 1, 3, 4, 5]], base[[0, 1, 3, 4, 5]])
    assert len(fmt.lora_tensors()) == 2

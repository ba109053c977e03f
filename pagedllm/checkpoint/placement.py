"""Where each checkpoint tensor goes in a model: the placement every weight source streams into.

Layers that shard or fuse (``checkpoint_slices``: the tensor-parallel linears, the vocabulary
embedding and head) say which checkpoint tensors fill which rows of their parameters; modules that
name their own tensors (``checkpoint_tensors``: one per MoE expert) do so, with a fused spelling
(``fused_checkpoint_tensors``). Asked of the meta model to plan, and of the materialised one to load.
"""
from __future__ import annotations

from torch import nn

from pagedllm.layers import WeightSlice

Placement = dict[str, list[tuple[WeightSlice, str]]]


def expected_tensors(model: nn.Module) -> Placement:
    """Checkpoint tensor name -> [(where it goes on this rank, parameter name for messages)]:
    usually one place; a fused checkpoint tensor (Phi-3's ``qkv_proj``) fills several parts.

    A fused ``qkv_proj`` expects ``q_proj.weight``, ``k_proj.weight``... each into its rows. Any
    other parameter takes its checkpoint tensor whole. A tied lm_head shares the embedding's
    Parameter, which named_parameters() lists once, so no ``lm_head.weight`` is expected.
    """
    modules = dict(model.named_modules())
    expected: Placement = {}
    for param_name, param in model.named_parameters():
        module_name, _, attr = param_name.rpartition(".")
        module = modules[module_name]
        if hasattr(module, "checkpoint_tensors"):  # names its own tensors (one per MoE expert)
            for name, piece in module.checkpoint_tensors(attr, param.data).items():
                expected.setdefault(f"{module_name}.{name}", []).append((piece, param_name))
            continue
        slices = (module.checkpoint_slices(attr, param.data) if hasattr(module, "checkpoint_slices")
                  else [WeightSlice(param.data)])
        parent, _, _ = module_name.rpartition(".")
        prefix = f"{parent}." if parent else ""
        for piece in slices:
            name = f"{prefix}{piece.shard_name}.{attr}" if piece.shard_name else param_name
            expected.setdefault(name, []).append((piece, param_name))
    return expected


def fused_tensors(model: nn.Module) -> dict[str, tuple[list[tuple[WeightSlice, str]], list[str]]]:
    """The other spelling of modules that name their own tensors: a fused checkpoint tensor
    (``experts.gate_up_proj``, named as the parameter) -> (its places on this rank, the
    per-expert names of ``expected_tensors`` it stands for)."""
    modules = dict(model.named_modules())
    fused: dict[str, tuple[list[tuple[WeightSlice, str]], list[str]]] = {}
    for param_name, param in model.named_parameters():
        module_name, _, attr = param_name.rpartition(".")
        module = modules[module_name]
        if hasattr(module, "fused_checkpoint_tensors"):
            pieces = module.fused_checkpoint_tensors(attr, param.data)
            replaced = [f"{module_name}.{name}"
                        for name in module.checkpoint_tensors(attr, param.data)]
            fused[param_name] = ([(piece, param_name) for piece in pieces], replaced)
    return fused


def zero_uncovered(model: nn.Module, expected: Placement) -> None:
    """Zero the parameters no checkpoint tensor covers whole: the last rank's vocabulary rows past
    the end (``to_empty`` left whatever the memory held there, NaN included)."""
    covered: dict[str, int] = {}
    for piece, param_name in (target for targets in expected.values() for target in targets):
        covered[param_name] = covered.get(param_name, 0) + piece.dest.numel()
    for param_name, param in model.named_parameters():
        if covered.get(param_name, 0) < param.numel():
            param.data.zero_()

"""Load a PEFT LoRA folder (``adapter_config.json`` + ``adapter_model.safetensors``) for one base
model, checked against it in full before anything is kept: a mismatch is one ValidationError line
naming the module and both shapes, and the caller holds nothing of a refused adapter.

The adapter's update of a projection is ``(x A^T) B^T * scaling`` with ``scaling = lora_alpha / r``
(``lora_alpha / sqrt(r)`` with ``use_rslora``); the scaling is folded into B once here.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pagedllm.errors import ValidationError
from pagedllm.lora.request import LoRARequest
from pagedllm.lora.targets import LoRATarget

# PEFT's saved names: base_model.model.<module>.lora_A.weight (older files: .lora_A.<adapter>.weight)
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<side>[AB])(?:\.[^.]+)?\.weight$")
# Options of adapter_config.json that change the update beyond (A, B, alpha, r): refused by name.
_UNSUPPORTED = {"use_dora": "DoRA adapters", "modules_to_save": "modules_to_save (a trained "
                "embedding or head)", "rank_pattern": "rank_pattern", "alpha_pattern": "alpha_pattern"}


@dataclass
class LoRAProjection:
    """One trained projection, this rank's part: ``lora_a`` [r, in], ``lora_b`` [out, r] (scaled)."""
    target: LoRATarget
    lora_a: torch.Tensor
    lora_b: torch.Tensor


@dataclass
class LoRAModel:
    """An adapter loaded for one base: its projections grouped by pagedllm layer."""
    lora_int_id: int
    lora_name: str
    rank: int
    scaling: float
    layers: dict[str, list[LoRAProjection]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for projections in self.layers.values()
                   for p in projections for t in (p.lora_a, p.lora_b))


def fail(request: LoRARequest, message: str) -> ValidationError:
    return ValidationError(f"LoRA adapter {request.lora_name!r} ({request.lora_path}): {message}",
                           "lora_request")


def read_adapter_config(request: LoRARequest, max_lora_rank: int) -> tuple[int, float]:
    """(rank, scaling) from the folder's adapter_config.json; ValidationError when the folder
    is no LoRA adapter pagedllm can apply."""
    path = Path(request.lora_path) / "adapter_config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise fail(request, f"cannot read adapter_config.json ({exc})") from None
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise fail(request, "adapter_config.json is no PEFT LoRA config (peft_type must be LORA)")
    for key, what in _UNSUPPORTED.items():
        if config.get(key):
            raise fail(request, f"{what} are not supported; give an adapter without {key}")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise fail(request, f"adapter_config.json needs r, an integer >= 1; got {rank!r}")
    if rank > max_lora_rank:
        raise fail(request, f"rank {rank} is above max_lora_rank {max_lora_rank}; raise "
                             "--max-lora-rank")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise fail(request, f"adapter_config.json needs lora_alpha, a number; got {alpha!r}")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, float(scaling)


def _read_tensors(request: LoRARequest) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(request.lora_path) / "adapter_model.safetensors"
    if not path.is_file():
        raise fail(request, "no adapter_model.safetensors (only safetensors adapters load)")
    try:
        return load_file(path)
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise fail(request, f"adapter_model.safetensors is not a readable safetensors file "
                             f"({str(exc).splitlines()[0]})") from None


def _pairs(request: LoRARequest, tensors: dict[str, torch.Tensor]
           ) -> dict[str, dict[str, torch.Tensor]]:
    """Checkpoint module -> {"A": lora_A, "B": lora_B}."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise fail(request, f"tensor {key} is no lora_A/lora_B weight")
        pairs.setdefault(match["module"], {})[match["side"]] = tensor
    for module, pair in pairs.items():
        if len(pair) != 2:
            raise fail(request, f"{module} has lora_{'A' if 'A' in pair else 'B'} without its pair")
    return pairs


def load_peft_adapter(request: LoRARequest, targets: dict[str, LoRATarget], max_lora_rank: int,
                      dtype: torch.dtype) -> LoRAModel:
    """The adapter at ``request.lora_path`` for the base whose projections are ``targets``."""
    rank, scaling = read_adapter_config(request, max_lora_rank)
    pairs = _pairs(request, _read_tensors(request))
    if not pairs:
        raise fail(request, "adapter_model.safetensors holds no lora_A/lora_B weights")
    return build_lora_model(request, rank, scaling, pairs, targets, dtype)


def build_lora_model(request: LoRARequest, rank: int, scaling: float,
                     pairs: dict[str, dict[str, torch.Tensor]], targets: dict[str, LoRATarget],
                     dtype: torch.dtype) -> LoRAModel:
    """The adapter from its checkpoint module -> {"A": [r, in], "B": [out, r]} pairs, each
    checked against the base's projection and cut to this rank's shard."""
    model = LoRAModel(request.lora_int_id, request.lora_name, rank, scaling)
    for module, pair in sorted(pairs.items()):
        target = targets.get(module)
        if target is None:
            raise fail(request, f"the base model has no linear layer {module} (an adapter for "
                                 "another base model?)")
        a, b = pair["A"], pair["B"]
        want_a, want_b = (rank, target.full_in), (target.full_out, rank)
        if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
            raise fail(request, f"{module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do "
                                 f"not fit the base's {target.full_out}x{target.full_in} weight "
                                 f"at rank {rank} (expected {want_a} and {want_b})")
        lora_a = a[:, target.in_start:target.in_start + target.in_size]
        lora_b = b[target.out_start:target.out_start + target.out_size].float() * scaling
        model.layers.setdefault(target.layer_name, []).append(LoRAProjection(
            target, lora_a.to(dtype).contiguous(), lora_b.to(dtype).contiguous()))
    return model

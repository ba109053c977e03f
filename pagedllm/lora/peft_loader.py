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
from pagedllm.lora.expert_loader import ExpertPair, ExpertTarget, read_expert_update, split_expert_pairs
from pagedllm.lora.request import LoRARequest
from pagedllm.lora.targets import LoRATarget, VocabTarget

# PEFT's saved names: base_model.model.<module>.lora_A.weight (older files: .lora_A.<adapter>.weight)
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<side>[AB])(?:\.[^.]+)?\.weight$")
# An MoE block's experts: a per-expert projection (Mixtral's block_sparse_moe.experts.N.w1,
# mlp.experts.N.*) or PEFT's target_parameters on the fused tensors (mlp.experts[.base_layer]).
_EXPERT = re.compile(r"\.experts(\.\d+\.|(\.base_layer)*$)")
# Options of adapter_config.json that change the update beyond (A, B, alpha, r): refused by name.
_UNSUPPORTED = {"use_dora": "DoRA adapters", "rank_pattern": "rank_pattern", "alpha_pattern": "alpha_pattern"}
# The modules_to_save applied: a whole trained copy of the vocabulary's embedding or head.
VOCAB_MODULES = ("embed_tokens", "lm_head")
_SAVED = re.compile(r"^(?:base_model\.model\.)?(?:.+\.)?(?P<module>embed_tokens|lm_head)"
                    r"(?:\.modules_to_save\.[^.]+)?\.weight$")


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
    vocab: dict[str, torch.Tensor] = field(default_factory=dict)  # embed_tokens / lm_head: this rank's rows
    # A MoE layer's experts: layer name -> projection -> its update (lora/expert_loader.py).
    experts: dict[str, dict[str, ExpertPair]] = field(default_factory=dict)

    def tensors(self) -> list[torch.Tensor]:
        return [t for projections in self.layers.values() for p in projections
                for t in (p.lora_a, p.lora_b)] + list(self.vocab.values()) + [
                    t for update in self.experts.values() for pair in update.values() for t in pair]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


def fail(request: LoRARequest, message: str) -> ValidationError:
    return ValidationError(f"LoRA adapter {request.lora_name!r} ({request.lora_path}): {message}",
                           "lora_request")


def read_adapter_config(request: LoRARequest, max_lora_rank: int) -> tuple[int, float, list[str]]:
    """(rank, scaling, modules_to_save) from the folder's adapter_config.json; ValidationError
    when the folder is no LoRA adapter pagedllm can apply."""
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
    saved = config.get("modules_to_save") or []
    other = [m for m in saved if m not in VOCAB_MODULES] if isinstance(saved, list) else [saved]
    if other:
        raise _fail_saved(request, other)
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise fail(request, f"adapter_config.json needs r, an integer >= 1; got {rank!r}")
    if rank > max_lora_rank:
        raise fail(request, f"rank {rank} is above max_lora_rank {max_lora_rank}; raise "
                             "--max-lora-rank")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise fail(request, f"adapter_config.json needs lora_alpha, a number; got {alpha!r}")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, float(scaling), saved


def _fail_saved(request: LoRARequest, modules: list) -> ValidationError:
    return fail(request, f"modules_to_save {modules} are not supported (only {', '.join(VOCAB_MODULES)}); "
                         "give an adapter without them")


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
                      dtype: torch.dtype, vocab_target: VocabTarget | None = None,
                      expert_targets: dict[str, ExpertTarget] | None = None) -> LoRAModel:
    """The adapter at ``request.lora_path`` for the base whose projections are ``targets`` (and
    whose vocabulary is ``vocab_target``, for a trained embedding or head; whose MoE experts are
    ``expert_targets``)."""
    rank, scaling, saved = read_adapter_config(request, max_lora_rank)
    tensors = _read_tensors(request)
    vocab = {m["module"]: tensors.pop(key) for key in list(tensors) if (m := _SAVED.match(key))}
    missing = sorted(set(saved) - set(vocab))
    if missing:
        raise fail(request, f"modules_to_save lists {missing} but adapter_model.safetensors holds no such weight")
    pairs = _pairs(request, tensors)
    if not pairs:
        raise fail(request, "adapter_model.safetensors holds no lora_A/lora_B weights")
    model = build_lora_model(request, rank, scaling, pairs, targets, dtype, expert_targets)
    for module, weight in sorted(vocab.items()):
        model.vocab[module] = _vocab_rows(request, module, weight, vocab_target, dtype)
    return model


def _vocab_rows(request: LoRARequest, module: str, weight: torch.Tensor, vocab_target: VocabTarget | None,
                dtype: torch.dtype) -> torch.Tensor:
    """This rank's rows of a trained embedding or head, checked against the base's vocabulary."""
    if vocab_target is None:
        raise fail(request, f"modules_to_save {module}: the base model has no vocabulary {module}")
    vocab, hidden = vocab_target.vocab_size, vocab_target.hidden_size
    if weight.dim() != 2 or weight.shape[1] != hidden:
        raise fail(request, f"{module}: weight {tuple(weight.shape)} does not fit the base's {vocab}x{hidden} "
                            "(an adapter for another base model?)")
    if weight.shape[0] != vocab:
        raise fail(request, f"{module}: {weight.shape[0]} vocabulary rows against the base's {vocab}; adapters "
                            "that change the vocabulary (added tokens) are not supported")
    return weight[vocab_target.start:vocab_target.end].to(dtype).contiguous()


def build_lora_model(request: LoRARequest, rank: int, scaling: float,
                     pairs: dict[str, dict[str, torch.Tensor]], targets: dict[str, LoRATarget],
                     dtype: torch.dtype, expert_targets: dict[str, ExpertTarget] | None = None) -> LoRAModel:
    """The adapter from its checkpoint module -> {"A": [r, in], "B": [out, r]} pairs, each
    checked against the base's projection (or MoE experts) and cut to this rank's shard."""
    model = LoRAModel(request.lora_int_id, request.lora_name, rank, scaling)
    pairs = dict(pairs)
    for layer, layer_pairs in split_expert_pairs(pairs, expert_targets or {}).items():
        model.experts[layer] = read_expert_update(fail, request, rank, scaling, layer_pairs,
                                                  expert_targets[layer], dtype)
    for module, pair in sorted(pairs.items()):
        target = targets.get(module)
        if target is None and _EXPERT.search(module):
            expert = re.sub(r"(\.base_layer)+$", "", module)
            raise fail(request, f"{expert}: the base model has no MoE experts there that take LoRA (an "
                                "adapter for another base model? GPT-OSS's transposed experts take none)")
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

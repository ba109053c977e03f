"""Load a local Hugging Face model folder: config.json plus safetensors weights.

The model is built on the meta device (no memory, no random init), materialised uninitialised
on the target device, then every parameter is filled from the checkpoint. A parameter that no
checkpoint tensor fills is an error, so a half-loaded model can never run.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from pagedllm.errors import ModelLoadError
from pagedllm.layers import MergedLinear
from pagedllm.models.registry import get_model_class

logger = logging.getLogger(__name__)

# Checkpoint tensors that carry no weights we need (old checkpoints saved the rope table).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_model(model_path: str, dtype: torch.dtype, device: torch.device) -> tuple[nn.Module, dict]:
    """Return ``(model in eval mode with weights loaded, the parsed config.json)``."""
    folder = Path(model_path)
    config = read_config(folder)
    model_cls = get_model_class(config)
    with torch.device("meta"):
        model = model_cls(config)
    model = model.to(dtype=dtype).to_empty(device=device)
    if hasattr(model, "tie_weights"):
        model.tie_weights()  # moving a module breaks parameter sharing; restore it
    load_weights(model, iter_safetensors(folder))
    model.requires_grad_(False)  # inference only: no autograd bookkeeping in forward
    return model.eval(), config


def read_config(folder: Path) -> dict:
    path = folder / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{folder} is not a model folder: no config.json")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path} is not valid JSON: {e}") from e


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of the folder: the index's shards, or model.safetensors."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ModelLoadError(f"{index} is not a valid safetensors index: {e}") from e
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{folder}: weight shards listed in {index.name} are missing: "
                                 f"{', '.join(missing)}")
        return files
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    others = sorted(folder.glob("*.safetensors"))
    if others:
        return others
    raise ModelLoadError(f"{folder}: no model.safetensors or model.safetensors.index.json "
                         "(only safetensors weights are supported)")


def iter_safetensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for every tensor of every weight file, read one at a time on the CPU."""
    for path in weight_files(folder):
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except (OSError, SafetensorError) as e:  # truncated file, corrupt header, ...
            raise ModelLoadError(f"cannot read weights from {path}: {e}") from e


def expected_tensors(model: nn.Module) -> dict[str, tuple[torch.Tensor, str]]:
    """Checkpoint tensor name -> (the tensor to copy it into, parameter name for messages).

    A fused ``MergedLinear`` (``qkv_proj``) expects one tensor per part (``q_proj.weight``, ...),
    each copied into its rows. A tied lm_head shares the embedding's Parameter, which
    named_parameters() lists once, so no ``lm_head.weight`` is expected.
    """
    modules = dict(model.named_modules())
    expected: dict[str, tuple[torch.Tensor, str]] = {}
    for param_name, param in model.named_parameters():
        module_name, _, attr = param_name.rpartition(".")
        module = modules[module_name]
        if isinstance(module, MergedLinear):
            parent, _, _ = module_name.rpartition(".")
            prefix = f"{parent}." if parent else ""
            for shard_id, shard_name in enumerate(module.shard_names):
                expected[f"{prefix}{shard_name}.{attr}"] = (module.shard(param.data, shard_id), param_name)
        else:
            expected[param_name] = (param.data, param_name)
    return expected


@torch.no_grad()
def load_weights(model: nn.Module, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Copy every checkpoint tensor into its place; raise ModelLoadError on missing tensors or
    shape mismatches. Unknown tensors are logged and skipped."""
    expected = expected_tensors(model)
    tied = getattr(getattr(model, "args", None), "tie_word_embeddings", False)
    unexpected: list[str] = []
    for name, tensor in weights:
        target = expected.pop(name, None)
        if target is None:
            if not (name.endswith(_IGNORED_SUFFIXES) or (tied and name == "lm_head.weight")):
                unexpected.append(name)
            continue
        dest, param_name = target
        if tuple(dest.shape) != tuple(tensor.shape):
            raise ModelLoadError(f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, "
                                 f"the model expects {tuple(dest.shape)} (for {param_name})")
        dest.copy_(tensor)  # casts to the model dtype and moves to its device
    if expected:
        names = sorted(expected)
        more = f" and {len(names) - 10} more" if len(names) > 10 else ""
        raise ModelLoadError(f"checkpoint is missing {len(names)} tensors: "
                             f"{', '.join(names[:10])}{more}")
    if unexpected:
        logger.warning("ignoring %d checkpoint tensors the model does not use: %s",
                       len(unexpected), ", ".join(unexpected[:10]))

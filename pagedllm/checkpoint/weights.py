"""The safetensors stream: this rank's part of every tensor of a folder's files copied into its
place, reading only that part from the file (``safe_open(...).get_slice``), never the whole model.
A parameter no tensor fills is an error, so a half-loaded model can never run."""
from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from pagedllm.checkpoint.placement import Placement, expected_tensors, fused_tensors, zero_uncovered
from pagedllm.checkpoint.renames import renamed
from pagedllm.errors import ModelLoadError
from pagedllm.layers import WeightSlice

logger = logging.getLogger(__name__)

# Checkpoint tensors that carry no weights we need (old checkpoints saved the rope table).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class SafetensorsWeights:
    """A plain folder's weights: nothing stays quantized (no plan), every tensor is streamed."""

    def __init__(self, files: list[Path]) -> None:
        self.files = files

    def plan(self, model: nn.Module, expected: Placement) -> dict:
        return {}

    def stream(self, model: nn.Module, expected: Placement, plan: dict) -> None:
        stream_safetensors(model, self.files, expected)


@torch.no_grad()
def load_weights(model: nn.Module, files: list[Path], ignored=()) -> None:
    """Fill ``model`` (materialised) from ``files``: the placement, the uncovered rows zeroed,
    the stream."""
    expected = expected_tensors(model)
    zero_uncovered(model, expected)
    stream_safetensors(model, files, expected, ignored)


@torch.no_grad()
def stream_safetensors(model: nn.Module, files: list[Path], expected: Placement, ignored=()) -> None:
    """Copy each tensor of ``files`` into its places in ``expected`` (consumed); raise
    ModelLoadError on missing tensors or shape mismatches. Unknown tensors are logged and skipped;
    ``ignored`` names are read elsewhere (an AWQ/GPTQ layer's packed tensors)."""
    fused = fused_tensors(model)
    renames = getattr(model, "checkpoint_renames", {})
    tied = getattr(getattr(model, "args", None), "tie_word_embeddings", False)
    # Parts of the checkpoint a model knowingly leaves out (a multimodal model's vision tower).
    skipped: tuple[str, ...] = getattr(model, "skipped_checkpoint_prefixes", ())
    unexpected: list[str] = []
    for path in files:
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for file_name in f.keys():
                    name = renamed(file_name, renames)
                    targets = expected.pop(name, None)
                    if targets is None and name in fused:  # the experts' fused spelling
                        targets, replaced = fused.pop(name)
                        for per_expert in replaced:
                            expected.pop(per_expert, None)
                    if targets is None:
                        if not (file_name in ignored or name.endswith(_IGNORED_SUFFIXES)
                                or name.startswith(skipped)
                                or (tied and name == "lm_head.weight")):
                            unexpected.append(name)
                        continue
                    for target in targets:
                        _copy_slice(f, file_name, *target)
        except (OSError, SafetensorError) as e:  # truncated file, corrupt header, ...
            raise ModelLoadError(f"cannot read weights from {path}: {e}") from e
    if expected:
        names = sorted(expected)
        more = f" and {len(names) - 10} more" if len(names) > 10 else ""
        raise ModelLoadError(f"checkpoint is missing {len(names)} tensors: "
                             f"{', '.join(names[:10])}{more}")
    if unexpected:
        logger.warning("ignoring %d checkpoint tensors the model does not use: %s",
                       len(unexpected), ", ".join(unexpected[:10]))


def _copy_slice(f, name: str, piece: WeightSlice, param_name: str) -> None:
    sliced = f.get_slice(name)
    shape = tuple(sliced.get_shape())
    if shape != piece.checkpoint_shape():
        raise ModelLoadError(f"checkpoint tensor {name} has shape {shape}, the model expects "
                             f"{piece.checkpoint_shape()} (for {param_name})")
    if piece.dim is None:
        piece.dest.copy_(f.get_tensor(name))  # casts to the model dtype and moves to its device
        return
    index = [slice(None)] * len(shape)
    index[piece.dim] = slice(piece.start, piece.start + piece.dest.shape[piece.dim])
    piece.dest.copy_(sliced[tuple(index)])  # reads only these rows (or columns) from the file

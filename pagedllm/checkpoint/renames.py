"""How a checkpoint's tensor names map onto a model's (the model's ``checkpoint_renames``): shared
by the safetensors stream (checkpoint/weights.py) and the AWQ/GPTQ one (quantized_checkpoint.py)."""
from __future__ import annotations


def renamed(name: str, renames: dict[str, str]) -> str:
    """A checkpoint name in the model's spelling (Mixtral's ``.block_sparse_moe.`` -> ``.mlp.``)."""
    for old, new in renames.items():
        name = name.replace(old, new)
    return name

"""How a checkpoint's tensor names map onto a model's: shared by the safetensors loader
(models/loader.py) and the quantized-checkpoint loader (models/quantized_checkpoint.py)."""
from __future__ import annotations


def renamed(name: str, renames: dict[str, str]) -> str:
    """A checkpoint name in the model's spelling (Mixtral's ``.block_sparse_moe.`` -> ``.mlp.``)."""
    for old, new in renames.items():
        name = name.replace(old, new)
    return name

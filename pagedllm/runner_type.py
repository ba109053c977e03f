"""Which runner a model gets: ``generate`` (the sampler ends each step) or ``pooling`` (a pooler
turns the hidden states into a vector). vLLM's ``runner`` argument; ``auto`` reads the checkpoint.
Standard library only: the engine decides before any weight is loaded."""
from __future__ import annotations

from pathlib import Path

from pagedllm.hf_config import is_gguf_path, read_config_json

# Architectures that end in a head other than a language model's.
_POOLING_SUFFIXES = ("Model", "ForSequenceClassification")


def is_pooling_checkpoint(model: str) -> bool:
    """A *Model or *ForSequenceClassification architecture, a sentence-transformers folder
    (modules.json), or a GGUF embedder (checkpoint/gguf/pooling.py)."""
    folder = Path(model)
    if is_gguf_path(folder) and folder.is_file():  # llama.cpp's file: its metadata says
        from pagedllm.checkpoint.gguf.pooling import is_pooling_gguf

        return is_pooling_gguf(folder)
    if (folder / "modules.json").is_file():
        return True
    try:
        config = read_config_json(folder)  # the one parse the loader and ModelInfo share
    except (OSError, ValueError):
        return False
    return any(str(a).endswith(_POOLING_SUFFIXES) for a in config.get("architectures") or ())


def resolve_runner_type(runner: str, model: str) -> str:
    """``generate`` or ``pooling``; ``auto`` from the checkpoint."""
    if runner != "auto":
        return runner
    return "pooling" if is_pooling_checkpoint(model) else "generate"


def serves_pooling(runner_type: str, pooler_config: dict | None) -> bool:
    """A pooling model, or a generator started with a ``pooler_config``: it pools too (as
    llama.cpp's server with ``--embeddings`` on a chat model), in the same steps as generation."""
    return runner_type == "pooling" or pooler_config is not None

"""A checkpoint's tokenizer as a transformers tokenizer: a folder's files, or the one a GGUF file
carries. transformers is imported only here, on first use (kept off the engine's import path)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from pagedllm.checkpoint.source import is_gguf_path, open_checkpoint
from pagedllm.errors import ModelLoadError


def load_hf_tokenizer(path: str | Path) -> Any:
    if is_gguf_path(path):  # the tokenizer llama.cpp's file carries
        from pagedllm.checkpoint.gguf.tokenizer import load_gguf_tokenizer

        return load_gguf_tokenizer(path)
    from transformers import AutoTokenizer

    config = _transformers_config(Path(path))
    if config is None:
        return AutoTokenizer.from_pretrained(str(path))
    return AutoTokenizer.from_pretrained(str(path), config=config)


def _transformers_config(folder: Path) -> Any | None:
    """The opened checkpoint's config as transformers' config class, so AutoTokenizer does not
    read config.json again; None (transformers reads it) where the folder has none or transformers
    does not know its model type."""
    if not (folder / "config.json").is_file():
        return None
    from transformers import CONFIG_MAPPING

    try:
        config = open_checkpoint(folder).config
        built = CONFIG_MAPPING[config["model_type"]].from_dict(config)
    except (ModelLoadError, KeyError, ValueError, TypeError):
        return None
    built._name_or_path = str(folder)  # as from_pretrained names it
    return built

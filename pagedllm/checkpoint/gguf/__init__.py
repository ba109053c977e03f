"""GGUF checkpoints (llama.cpp's single-file format): metadata -> config, the embedded
tokenizer, and typed tensors unpacked into pagedllm's quantized formats.

reader.py, config.py and tokenizer.py hold no torch code, so the engine can read a file's config
before any model is built; weights.py (torch) is the loader's GGUF stream.
"""
from __future__ import annotations

from pagedllm.checkpoint.gguf.config import read_gguf_config
from pagedllm.checkpoint.source import is_gguf_path

__all__ = ["is_gguf_path", "read_gguf_config"]

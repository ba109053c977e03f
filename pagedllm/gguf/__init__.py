"""GGUF checkpoints (llama.cpp's single-file format): metadata -> config, the embedded
tokenizer, and typed tensors unpacked into pagedllm's quantized formats.

This module stays torch-free (numpy and the ``gguf`` parser only) so the engine can read a
file's config before any model is built; model_loader.py (torch) is imported by models/loader.
"""
from __future__ import annotations

from pagedllm.gguf.config import read_gguf_config
from pagedllm.gguf.reader import is_gguf_path

__all__ = ["is_gguf_path", "read_gguf_config"]

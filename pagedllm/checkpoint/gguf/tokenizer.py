"""The tokenizer a GGUF file carries (``tokenizer.ggml.*``: model type, tokens, scores or merges,
token types, special ids, ``tokenizer.chat_template``), as a transformers fast tokenizer.

transformers converts these fields itself (``from_pretrained(folder, gguf_file=name)``, its
integrations/gguf); pagedllm reuses that conversion and only checks the file first, so a bad
file fails with pagedllm's error rather than deep inside the conversion. For a split checkpoint
the tokenizer is in the first shard's metadata.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from pagedllm.checkpoint.gguf.reader import open_gguf, shard_paths
from pagedllm.errors import ModelLoadError


def load_gguf_tokenizer(path: str | Path) -> Any:
    first = shard_paths(path)[0]
    ckpt = open_gguf(first, read_tensors=False)
    if "tokenizer.ggml.tokens" not in ckpt.metadata:
        raise ModelLoadError(f"{first.name} carries no tokenizer (no tokenizer.ggml.tokens); pass "
                             "--tokenizer with a Hugging Face tokenizer folder")
    if ckpt.get("tokenizer.ggml.model") == "bert":  # WordPiece: transformers cannot convert it
        from pagedllm.checkpoint.gguf.wordpiece import wordpiece_tokenizer

        return wordpiece_tokenizer(ckpt)
    if ckpt.get("tokenizer.ggml.model") == "t5" and ckpt.architecture == "bert":  # XLM-R's Unigram
        from pagedllm.checkpoint.gguf.unigram import unigram_tokenizer

        return unigram_tokenizer(ckpt)
    from transformers import AutoTokenizer  # heavy import, kept off the engine's import path

    tokenizer = AutoTokenizer.from_pretrained(str(first.parent), gguf_file=first.name)
    template = ckpt.get("tokenizer.chat_template")
    if template and not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = template
    return tokenizer

"""The decode call behind detokenization, straight into the Rust tokenizer where that is the same.

transformers' ``decode`` of a fast tokenizer is its Rust backend's ``decode`` (plus, for some
tokenizers, a ``clean_up_tokenization`` pass) wrapped in Python argument handling that costs
several times the decode itself, and the incremental detokenizer calls it twice a token. Where
the tokenizer's class keeps transformers' own ``decode`` and ``_decode`` and the clean-up does not
apply, the backend's ``decode`` is the same text by construction and is called directly; any
other tokenizer (slow ones, classes that override decoding, the clean-up) keeps its ``decode``.
Callers always pass ``skip_special_tokens``: the backend's default (True) is not transformers' (False).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

Decode = Callable[..., str]  # (ids, skip_special_tokens=...) -> text


def decode_function(tokenizer: Any) -> Decode:
    """The fastest call that gives ``tokenizer.decode(ids, skip_special_tokens=...)``'s text."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not getattr(tokenizer, "is_fast", False):
        return tokenizer.decode
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    cls = type(tokenizer)
    if cls.decode is not PreTrainedTokenizerBase.decode or getattr(cls, "_decode", None) is not \
            TokenizersBackend._decode:
        return tokenizer.decode
    if tokenizer.clean_up_tokenization_spaces and (
            type(backend.model).__name__ != "BPE"  # transformers skips the clean-up for BPE only
            or getattr(tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)):
        return tokenizer.decode
    return backend.decode

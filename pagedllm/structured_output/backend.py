"""The grammar library (llguidance) behind plain bytes: compile, match, fill bitmasks.

Why llguidance rather than xgrammar (vLLM's default): it needs no torch and no triton (xgrammar
pulls ~1 GB of triton and imports torch, 10 s on this machine, against 0.25 s), so the engine
core stays torch-free; it builds a grammar lazily, so a new schema costs milliseconds even on a
32k vocabulary, and its batched mask fill is as fast at 32 requests (benchmarks/
structured_output.py; the measurements are in the issue note).

A bitmask row is ``ceil(vocab / 32)`` little-endian int32 words, bit ``t`` set when token ``t``
may come next; the vocabulary is the tokenizer's (the runner refuses logits beyond it).
"""
from __future__ import annotations

import ctypes
import threading
from typing import Any

from pagedllm.structured_output.grammar import llguidance
from pagedllm.utils import cdiv

_PARALLEL_FILL_BYTES = 32 << 10  # 32 rows of a ~8k-token vocabulary


class GrammarBackend:
    def __init__(self, tokenizer_path: str, eos_token_ids: frozenset[int] = frozenset()) -> None:
        self.tokenizer_path = tokenizer_path
        self.eos_token_ids = eos_token_ids
        self._tokenizer: Any | None = None
        self._executor: Any | None = None
        self._lock = threading.Lock()  # the compile threads build the tokenizer once
        self.row_bytes = 0

    @property
    def tokenizer(self) -> Any:
        """llguidance's view of the model's tokenizer, built on first use (slow for a large
        vocabulary: in a compile thread, never on the step loop)."""
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf

                from pagedllm.checkpoint.tokenizer import load_hf_tokenizer

                hf = load_hf_tokenizer(self.tokenizer_path)
                eos = sorted(self.eos_token_ids) or None
                self._tokenizer = llguidance.hf.from_tokenizer(hf, eos_token=eos)
                self.row_bytes = cdiv(self._tokenizer.vocab_size, 32) * 4
            return self._tokenizer

    def compile(self, source: str) -> Any:
        """A matcher at the grammar's start: the compiled grammar that sequences copy."""
        llg = llguidance()
        matcher = llg.LLMatcher(self.tokenizer, source, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def fill_bitmasks(self, matchers: list[Any]) -> bytes:
        """One row per matcher, into one buffer: in parallel by the library's own threads (it
        drops the GIL) when the masks are large; for small ones the threads cost more than they
        save (docs/cpu_kernels.md#elsewhere-in-the-engine)."""
        rows = len(matchers)
        if rows * self.row_bytes < _PARALLEL_FILL_BYTES:
            return b"".join(self.fill_bitmask(m) for m in matchers)
        if self._executor is None:
            self._executor = llguidance().LLExecutor(num_threads=2)
        buf = bytearray(rows * self.row_bytes)
        ptr = ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))
        self._executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], ptr,
                                               self.row_bytes, rows)
        return bytes(buf)

    def fill_bitmask(self, matcher: Any) -> bytes:
        """One row, ``row_bytes`` long (the library's own may carry a spare word)."""
        row = matcher.compute_bitmask()
        return row[:self.row_bytes].ljust(self.row_bytes, b"\0")

"""The last step's sampling metadata, kept while the batch's sampled rows stay the same.

A decode batch samples the same requests in the same rows step after step, and a row's
metadata only changes from step to step when it needs per-step data: a seeded random draw (one
generator per output position), a min_tokens mask, or penalties (the output so far). While
every row is free of those, the metadata built for the first step serves the next ones as is,
with no per-row Python work; any change of the rows (a request added, finished, reordered, a
draft row) builds it again.
"""
from __future__ import annotations

from operator import is_

import torch

from pagedllm.runner.input_batch import CachedRequestState
from pagedllm.runner.sampler import SamplingMetadata

SamplingResult = tuple[SamplingMetadata, list[torch.Generator | None]]


class SamplingMetadataCache:
    """One entry per random stream (the sampler's, a draft model's): the rows' request states,
    compared by identity (a resumed request gets a new state), and what was built for them."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[list[CachedRequestState], SamplingResult]] = {}

    def lookup(self, states: list[CachedRequestState], stream: int) -> SamplingResult | None:
        entry = self._entries.get(stream)
        if entry is None:
            return None
        kept, result = entry
        if len(kept) == len(states) and all(map(is_, kept, states)):
            return result
        return None

    def keep(self, states: list[CachedRequestState], stream: int, result: SamplingResult | None) -> None:
        """``result``: the rows' metadata when none of them needs per-step data, else None (forget)."""
        if result is None:
            self._entries.pop(stream, None)
        else:
            self._entries[stream] = (states, result)

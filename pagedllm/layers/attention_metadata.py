"""What the attention layers need to know about one step of a flat batch, built once per step.

The flat batch concatenates the new tokens of B requests: request i contributes
``query_lens[i]`` tokens at positions ``num_computed_tokens[i] ..  seq_lens[i] - 1``.
Everything derived here (slots, gather tables, masks) is shared by all layers of the step,
and so is the backend that attends (see attention/backend.py, where the metadata's
types live): it says what it needs built.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

# The metadata's types live with the backend interface that reads them (backend.py); they are
# named here too, where the metadata is built.
from pagedllm.layers.attention.backend import AttentionBackend, AttentionMetadata, DecodeBatch, PrefillChunk
from pagedllm.layers.attention.selector import get_attn_backend
from pagedllm.utils import cdiv

__all__ = ["AttentionMetadata", "DecodeBatch", "PrefillChunk", "StagingBuffers", "build_attention_metadata"]

ToDevice = Callable[[torch.Tensor], torch.Tensor]


class StagingBuffers:
    """Host arrays a step's metadata is written into, kept from step to step (vLLM's persistent
    batch): filling a slice of a numpy array from a list and viewing it as a tensor
    (``torch.from_numpy``) allocates nothing and dispatches one no-op operator, where
    ``torch.tensor(list)`` dispatches several operators and allocates a tensor per field.

    The tensors of a step alias these arrays, so each step's metadata must be done with before
    the next is built (the runner builds one step at a time); the arrays grow on demand."""

    def __init__(self) -> None:
        self._arrays: dict[str, np.ndarray] = {}

    def fill(self, name: str, values: list[int] | list[list[int]],
             shape: tuple[int, ...]) -> torch.Tensor:
        """``values`` (ints, or rows of ints) as an int64 tensor of ``shape``, a view of the
        array ``name``."""
        size = 1
        for n in shape:
            size *= n
        array = self._arrays.get(name)
        if array is None or array.shape[0] < size:
            array = self._arrays[name] = np.empty(max(size, 2 * (0 if array is None else array.shape[0]), 64),
                                                  dtype=np.int64)
        view = array[:size].reshape(shape)
        if size:  # numpy cannot broadcast an empty list into a [0, n] shape
            view[...] = values
        return torch.from_numpy(view)


def build_attention_metadata(query_lens: list[int], num_computed_tokens: list[int],
                             block_tables: list[list[int]], block_size: int,
                             device: torch.device | str = "cpu",
                             backend: AttentionBackend | None = None,
                             has_null_blocks: bool = False,
                             buffers: StagingBuffers | None = None) -> AttentionMetadata:
    """Per-step metadata for requests ``i`` advancing by ``query_lens[i]`` tokens, for
    ``backend`` (default: the device's, see ``get_attn_backend``).

    Built in plain Python (runs per block, not per token) and turned into one tensor per field
    through host arrays (``buffers``, kept by the caller across steps; fresh ones when None):
    a decode step has a single token per request, and a dozen small torch ops would cost more.
    Raises ValueError when a block table is too short for its request (a runner bug).
    ``has_null_blocks``: the tables are a sliding-window group's, whose slots outside the window
    may hold the null block (-1); it becomes block 0, a valid id that nobody reads (masked).
    """
    num_reqs = len(query_lens)
    if not (len(num_computed_tokens) == len(block_tables) == num_reqs):
        raise ValueError("query_lens, num_computed_tokens and block_tables differ in length")
    seq_lens = [c + q for c, q in zip(num_computed_tokens, query_lens)]
    query_start_loc, positions, slot_mapping = _positions_and_slots(num_computed_tokens, seq_lens,
                                                                    block_tables, block_size)

    max_blocks = max(1, max((len(t) for t in block_tables), default=0))
    # Padded with block 0, which is never read: keys past a request's length are masked.
    padded = [t + [0] * (max_blocks - len(t)) if len(t) < max_blocks else t for t in block_tables]
    if buffers is None:
        buffers = StagingBuffers()
    tables = buffers.fill("block_tables", padded, (num_reqs, max_blocks))
    if has_null_blocks:
        tables.clamp_(min=0)
    on_host = torch.device(device).type == "cpu"

    def to_dev(t: torch.Tensor) -> torch.Tensor:
        return t if on_host else t.to(device, non_blocking=True)

    def longs(name: str, values: list[int]) -> torch.Tensor:
        return to_dev(buffers.fill(name, values, (len(values),)))

    if backend is None:
        backend = get_attn_backend("auto", torch.device(device).type)
    md = AttentionMetadata(
        slot_mapping=longs("slot_mapping", slot_mapping), query_start_loc=query_start_loc,
        seq_lens=seq_lens, num_computed_tokens=list(num_computed_tokens),
        block_tables=to_dev(tables), block_size=block_size,
        positions=longs("positions", positions),
        query_start_loc_tensor=longs("query_start_loc", query_start_loc),
        seq_lens_tensor=longs("seq_lens", seq_lens), backend=backend)
    if backend.needs_gather_plan:
        md.decode = _build_decode(query_lens, seq_lens, query_start_loc, tables, block_size, to_dev)
        md.prefills = _build_prefills(query_lens, num_computed_tokens, query_start_loc, seq_lens,
                                      tables, block_size, to_dev)
    md.backend_data = backend.prepare(md)
    return md


def _positions_and_slots(num_computed_tokens: list[int], seq_lens: list[int],
                         block_tables: list[list[int]], block_size: int) -> tuple[list[int], list[int], list[int]]:
    """(query_start_loc, positions, slot_mapping) of the step's rows: each request's new
    positions and the cache slot each one's K/V is written to."""
    query_start_loc = [0]
    positions: list[int] = []
    slot_mapping: list[int] = []
    for i, (start, seq_len, table) in enumerate(zip(num_computed_tokens, seq_lens, block_tables)):
        if len(table) * block_size < seq_len:
            raise ValueError(f"request {i}: {len(table)} blocks of {block_size} cannot hold "
                             f"{seq_len} tokens")
        query_start_loc.append(query_start_loc[-1] + seq_len - start)
        if seq_len - start == 1:  # a decode: one position, one slot
            positions.append(start)
            slot_mapping.append(table[start // block_size] * block_size + start % block_size)
            continue
        positions.extend(range(start, seq_len))
        pos = start
        while pos < seq_len:  # one run of consecutive slots per block touched
            block, offset = divmod(pos, block_size)
            end = min(seq_len, pos - offset + block_size)
            base = table[block] * block_size - block * block_size
            slot_mapping.extend(range(base + pos, base + end))
            pos = end
    return query_start_loc, positions, slot_mapping


def _build_decode(query_lens: list[int], seq_lens: list[int], query_start_loc: list[int],
                  tables: torch.Tensor, block_size: int, to_dev: ToDevice) -> DecodeBatch | None:
    decode_reqs = [i for i, q in enumerate(query_lens) if q == 1]
    if not decode_reqs:
        return None
    token_indices = [query_start_loc[i] for i in decode_reqs]  # increasing
    first, num = token_indices[0], len(token_indices)
    token_indices_t = to_dev(torch.tensor(token_indices, dtype=torch.long))
    rows = slice(first, first + num) if token_indices[-1] - first == num - 1 else token_indices_t
    dec_seq_lens = torch.tensor([seq_lens[i] for i in decode_reqs])  # [Bd]
    num_blocks = cdiv(int(dec_seq_lens.max()), block_size)
    key_pos = torch.arange(num_blocks * block_size)  # [L]
    mask = key_pos[None, :] < dec_seq_lens[:, None]  # [Bd, L]
    return DecodeBatch(token_indices=token_indices_t, rows=rows,
                       block_tables=to_dev(tables[decode_reqs, :num_blocks]),
                       mask=to_dev(mask[:, None, None, :]),  # [Bd, 1, 1, L]: broadcast over heads
                       seq_lens=to_dev(dec_seq_lens))


def _build_prefills(query_lens: list[int], num_computed_tokens: list[int],
                    query_start_loc: list[int], seq_lens: list[int], tables: torch.Tensor,
                    block_size: int, to_dev: ToDevice) -> list[PrefillChunk]:
    chunks = []
    for i, q_len in enumerate(query_lens):
        if q_len <= 1:  # decodes are batched; zero-token entries have nothing to attend
            continue
        computed, seq_len = num_computed_tokens[i], seq_lens[i]
        mask = None
        if computed > 0:
            # Query j sits at position computed + j and sees keys at positions <= its own.
            query_pos = torch.arange(computed, seq_len)  # [q]
            mask = to_dev(torch.arange(seq_len)[None, :] <= query_pos[:, None])  # [q, seq_len]
        num_blocks = cdiv(seq_len, block_size)
        chunks.append(PrefillChunk(query_start_loc[i], query_start_loc[i + 1], computed,
                                   to_dev(tables[i, :num_blocks]), mask))
    return chunks

"""What the attention layers need to know about one step of a flat batch, built once per step.

The flat batch concatenates the new tokens of B requests: request i contributes
``query_lens[i]`` tokens at positions ``num_computed_tokens[i] ..  seq_lens[i] - 1``.
Everything derived here (slots, gather tables, masks) is shared by all layers of the step.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

ToDevice = Callable[[torch.Tensor], torch.Tensor]


@dataclass(slots=True)
class DecodeBatch:
    """All requests with exactly one new token, attended with a single batched SDPA call."""

    token_indices: torch.Tensor  # [Bd] long: rows of the flat batch
    block_tables: torch.Tensor   # [Bd, nb] long: enough blocks for the longest of them
    mask: torch.Tensor           # [Bd, 1, 1, nb * block_size] bool: True = position < seq_len


@dataclass(slots=True)
class PrefillChunk:
    """One request with several new tokens (a whole prompt or a chunk of it)."""

    token_start: int             # its rows in the flat batch: [token_start, token_end)
    token_end: int
    num_computed_tokens: int     # cached prefix length (0: attend to the new tokens only)
    block_ids: torch.Tensor      # [nb] long: blocks holding positions [0, seq_len)
    mask: torch.Tensor | None    # [q, seq_len] bool, causal shifted by the prefix; None if no prefix


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor        # [T] long: cache slot (block_id * block_size + offset) per new token
    query_start_loc: list[int]        # [B + 1]: request i owns rows [query_start_loc[i], query_start_loc[i+1])
    seq_lens: list[int]               # [B]: context length after this step (computed + new)
    num_computed_tokens: list[int]    # [B]: tokens already in the cache before this step
    block_tables: torch.Tensor        # [B, max_blocks] long, padded with block 0 (never read: masked)
    block_size: int
    positions: torch.Tensor           # [T] long: position of each new token (what the model's rope needs)
    query_start_loc_tensor: torch.Tensor  # [B + 1] long, on the device
    seq_lens_tensor: torch.Tensor     # [B] long, on the device
    decode: DecodeBatch | None = None
    prefills: list[PrefillChunk] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc[-1]


def build_attention_metadata(query_lens: list[int], num_computed_tokens: list[int],
                             block_tables: list[list[int]], block_size: int,
                             device: torch.device | str = "cpu") -> AttentionMetadata:
    """Per-step metadata for requests ``i`` advancing by ``query_lens[i]`` tokens.

    Per-token quantities come from vectorised torch ops; Python loops run per request only.
    Raises ValueError when a block table is too short for its request (a runner bug).
    """
    num_reqs = len(query_lens)
    if not (len(num_computed_tokens) == len(block_tables) == num_reqs):
        raise ValueError("query_lens, num_computed_tokens and block_tables differ in length")
    seq_lens = [c + q for c, q in zip(num_computed_tokens, query_lens)]
    for i, (seq_len, table) in enumerate(zip(seq_lens, block_tables)):
        if len(table) * block_size < seq_len:
            raise ValueError(f"request {i}: {len(table)} blocks of {block_size} cannot hold "
                             f"{seq_len} tokens")
    query_start_loc = [0]
    for q in query_lens:
        query_start_loc.append(query_start_loc[-1] + q)

    max_blocks = max((len(t) for t in block_tables), default=0)
    # Built on the CPU (tiny tensors, many small ops), moved to the device once at the end.
    tables = torch.zeros(num_reqs, max(max_blocks, 1), dtype=torch.long)
    for i, table in enumerate(block_tables):
        tables[i, :len(table)] = torch.tensor(table, dtype=torch.long)
    q_lens = torch.tensor(query_lens, dtype=torch.long)
    computed = torch.tensor(num_computed_tokens, dtype=torch.long)
    starts = torch.tensor(query_start_loc, dtype=torch.long)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.long)

    # Slot of every new token: which request owns it, its position, then the block table.
    req_of_token = torch.repeat_interleave(torch.arange(num_reqs), q_lens)  # [T]
    positions = torch.arange(query_start_loc[-1]) - starts[req_of_token] + computed[req_of_token]
    block_of_token = tables[req_of_token, positions // block_size]  # [T]
    slot_mapping = block_of_token * block_size + positions % block_size

    def to_dev(t: torch.Tensor) -> torch.Tensor:
        return t.to(device, non_blocking=True)

    return AttentionMetadata(
        slot_mapping=to_dev(slot_mapping), query_start_loc=query_start_loc, seq_lens=seq_lens,
        num_computed_tokens=list(num_computed_tokens), block_tables=to_dev(tables),
        block_size=block_size, positions=to_dev(positions),
        query_start_loc_tensor=to_dev(starts), seq_lens_tensor=to_dev(seq_lens_t),
        decode=_build_decode(q_lens, seq_lens_t, starts, tables, block_size, to_dev),
        prefills=_build_prefills(query_lens, num_computed_tokens, query_start_loc, seq_lens,
                                 tables, block_size, to_dev),
    )


def _build_decode(q_lens: torch.Tensor, seq_lens: torch.Tensor, starts: torch.Tensor,
                  tables: torch.Tensor, block_size: int, to_dev: ToDevice) -> DecodeBatch | None:
    decode_reqs = (q_lens == 1).nonzero().squeeze(1)  # [Bd]
    if decode_reqs.numel() == 0:
        return None
    dec_seq_lens = seq_lens[decode_reqs]  # [Bd]
    num_blocks = -(-int(dec_seq_lens.max()) // block_size)
    key_pos = torch.arange(num_blocks * block_size)  # [L]
    mask = key_pos[None, :] < dec_seq_lens[:, None]  # [Bd, L]
    return DecodeBatch(token_indices=to_dev(starts[decode_reqs]),
                       block_tables=to_dev(tables[decode_reqs, :num_blocks]),
                       mask=to_dev(mask[:, None, None, :]))  # [Bd, 1, 1, L]: broadcast over heads


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
        num_blocks = -(-seq_len // block_size)
        chunks.append(PrefillChunk(query_start_loc[i], query_start_loc[i + 1], computed,
                                   to_dev(tables[i, :num_blocks]), mask))
    return chunks

"""Test helpers: a paged step runner over the KV cache, random weights, the transformers reference.

A uniquely named module (not conftest.py) so ``from paged_helpers import ...`` cannot collide
with other test folders' conftest modules."""
from __future__ import annotations

import random
from pathlib import Path

import torch
from torch import nn

from pagedllm.layers import (bind_kv_caches, build_attention_metadata, kv_cache_shape,
                             set_forward_context)

REPO_ROOT = Path(__file__).resolve().parents[2]
STORIES_DIR = REPO_ROOT / ".." / "shared" / "models" / "stories260K"


class PagedRunner:
    """Drives a model step by step like the engine would: owns the KV caches, hands out blocks
    from a shuffled free list (so block tables are non-contiguous), tracks computed tokens."""

    def __init__(self, model: nn.Module, num_blocks: int = 96, block_size: int = 4,
                 seed: int = 0) -> None:
        self.model, self.block_size = model, block_size
        dtype = next(model.parameters()).dtype
        shape = kv_cache_shape(num_blocks, block_size, model.num_kv_heads, model.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=dtype) for _ in range(model.num_layers)]
        bind_kv_caches(model, self.kv_caches)
        self.free_blocks = list(range(num_blocks))
        random.Random(seed).shuffle(self.free_blocks)
        self.block_tables: dict[str, list[int]] = {}
        self.num_computed: dict[str, int] = {}

    def share_prefix(self, req_id: str, src_id: str, num_blocks: int) -> None:
        """``req_id`` starts with ``src_id``'s first blocks as its cached prefix (a prefix-cache
        hit); the blocks may still be unwritten if both run in the same step."""
        self.block_tables[req_id] = self.block_tables[src_id][:num_blocks]
        self.num_computed[req_id] = num_blocks * self.block_size

    def step(self, batch: list[tuple[str, list[int]]]) -> dict[str, torch.Tensor]:
        """Run one flat step; ``batch`` = (request id, its new token ids). Returns each
        request's log-probs ``[len(new tokens), vocab]``."""
        for req_id, tokens in batch:
            table = self.block_tables.setdefault(req_id, [])
            needed = self.num_computed.setdefault(req_id, 0) + len(tokens)
            while len(table) * self.block_size < needed:
                table.append(self.free_blocks.pop())
        md = build_attention_metadata(
            [len(t) for _, t in batch], [self.num_computed[r] for r, _ in batch],
            [self.block_tables[r] for r, _ in batch], self.block_size, "cpu")
        input_ids = torch.tensor([tok for _, tokens in batch for tok in tokens])
        with torch.inference_mode(), set_forward_context(md):
            logits = self.model.compute_logits(self.model(input_ids, md.positions))
        out = {}
        for i, (req_id, tokens) in enumerate(batch):
            self.num_computed[req_id] += len(tokens)
            rows = logits[md.query_start_loc[i]:md.query_start_loc[i + 1]]
            out[req_id] = torch.log_softmax(rows, dim=-1)
        return out


def randomize_(model: nn.Module, seed: int = 0) -> None:
    """Weights large enough that the outputs are far from uniform (HF's init with std 0.02
    makes a near-constant model, which would hide mistakes under a 1e-4 tolerance); biases and
    norm weights random so they are checked too."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(torch.rand(param.shape, generator=gen) * 0.5 + 0.75)
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)


def hf_log_probs(hf_model: nn.Module, token_ids: list[int]) -> torch.Tensor:
    """transformers' full-sequence forward: ``[len, vocab]`` log-probs."""
    with torch.no_grad():
        logits = hf_model(input_ids=torch.tensor([token_ids])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)

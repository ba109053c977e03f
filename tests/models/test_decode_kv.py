"""The contiguous decode store (layers/decode_kv.py) gives the same attention as the paged gather
path, through joins, finishes (row compaction), growth, rollbacks, new block tables, and blocks
shared with a request prefilled in the same step."""
from __future__ import annotations

import random

import pytest
import torch

from pagedllm.layers import (Attention, bind_kv_caches, build_attention_metadata, kv_cache_shape,
                             set_forward_context)
from pagedllm.layers.decode_kv import DecodeKVStore

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 4, 2, 8, 4


class Harness:
    def __init__(self, max_tokens: int = 10_000, num_blocks: int = 64) -> None:
        self.layers = [Attention(HEADS, KV_HEADS, HEAD_DIM, scale=0.3, layer_idx=i) for i in range(2)]
        caches = [torch.zeros(kv_cache_shape(num_blocks, BLOCK, KV_HEADS, HEAD_DIM)) for _ in range(2)]
        module = torch.nn.ModuleList(self.layers)
        bind_kv_caches(module, caches)
        self.store = DecodeKVStore(2, KV_HEADS, HEAD_DIM, torch.float32, torch.device("cpu"), max_tokens)
        self.free = list(range(num_blocks))
        random.Random(0).shuffle(self.free)
        self.tables: dict[str, list[int]] = {}
        self.gen = torch.Generator().manual_seed(0)
        self.used_store = 0

    def step(self, batch: list[tuple[str, int, int]]) -> None:
        """(request, first position, number of tokens): run both paths, compare every layer."""
        for rid, start, n in batch:
            table = self.tables.setdefault(rid, [])
            while len(table) * BLOCK < start + n:
                table.append(self.free.pop())
        q_lens = [n for _, _, n in batch]
        computed = [start for _, start, _ in batch]
        tables = [self.tables[rid] for rid, _, _ in batch]
        decodes = [(rid, start, self.tables[rid]) for rid, start, n in batch if n == 1]
        plan = self.store.plan(decodes, BLOCK) if decodes else None
        self.used_store += plan is not None
        md_store = build_attention_metadata(q_lens, computed, tables, BLOCK, decode_kv=plan)
        md_gather = build_attention_metadata(q_lens, computed, tables, BLOCK)
        num_tokens = sum(q_lens)
        for layer in self.layers:
            q = torch.randn(num_tokens, HEADS, HEAD_DIM, generator=self.gen)
            k = torch.randn(num_tokens, KV_HEADS, HEAD_DIM, generator=self.gen)
            v = torch.randn(num_tokens, KV_HEADS, HEAD_DIM, generator=self.gen)
            # The store path first: it writes both caches; the gather path rewrites the same K/V.
            with torch.inference_mode(), set_forward_context(md_store):
                ours = layer(q, k, v)
            with torch.inference_mode(), set_forward_context(md_gather):
                ref = layer(q, k, v)
            torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


def test_store_matches_gather_through_a_request_lifecycle():
    h = Harness()
    h.step([("A", 0, 10), ("B", 0, 6)])
    h.step([("A", 10, 1), ("B", 6, 1)])           # first decodes: rows filled from the prompts
    h.step([("A", 11, 1), ("C", 0, 5), ("B", 7, 1)])  # mixed step, decodes not consecutive
    h.store.release("A")                          # A finishes: B moves from row 1 to row 0
    assert h.store.row_of == {"B": 0} and h.store.owners == ["B"]
    h.step([("C", 5, 1), ("B", 8, 1)])            # rows [1, 0]: a permuted batch
    h.step([("B", 9, 3)])                         # draft verification: prefill-shaped, paged only
    h.step([("B", 10, 1), ("C", 6, 1)])           # drafts rejected: B refills position 9 only
    h.step([("B", 10, 1)])                        # rolled back onto its last written position
    h.tables["B"] = h.tables["C"][:3] + h.tables["B"][3:]   # a new block table (beam search)
    h.store.invalidate("B")
    h.step([("B", 11, 1), ("C", 7, 1)])
    for pos in range(12, 40):                     # growth in length (capacity 256 is not hit,
        h.step([("B", pos, 1)])                   # but rows and positions keep moving)
    assert h.used_store == 6 + 28  # every step with a decode


def test_shared_prefix_written_in_the_same_step_is_read_after_the_write():
    h = Harness()
    h.tables["D"] = [h.free.pop() for _ in range(2)]
    h.tables["E"] = h.tables["D"][:2]             # E hit D's two blocks, which D writes now
    h.step([("D", 0, 8), ("E", 8, 1)])
    h.step([("D", 8, 1), ("E", 9, 1)])


def test_rows_grow_and_a_step_over_the_bound_falls_back_to_gather():
    h = Harness(max_tokens=12)
    h.step([(f"R{i}", 0, 3) for i in range(3)])
    h.step([("R0", 3, 1), ("R1", 3, 1)])          # 16 x 256 is too much, the exact 2 x 4 fits
    assert h.used_store == 1 and (h.store.row_capacity, h.store.len_capacity) == (2, 4)
    h.step([("R0", 4, 1), ("R1", 4, 1), ("R2", 3, 1)])  # 3 x 5 does not: gather path
    assert h.used_store == 1 and "R2" not in h.store.row_of
    h.store.release("R0")
    h.step([("R1", 5, 1), ("R2", 4, 1)])          # 2 x 6 fits; R1 refills what it missed
    assert h.used_store == 2


@pytest.mark.parametrize("seed", range(3))
def test_random_schedules(seed):
    rng = random.Random(seed)
    h = Harness(num_blocks=200)
    pos: dict[str, int] = {}
    for step in range(40):
        batch = []
        for rid in list(pos):
            if rng.random() < 0.1:                # finished
                del pos[rid]
                h.store.release(rid)
            elif rng.random() < 0.85:
                n = 1 if rng.random() < 0.8 else rng.randint(2, 4)
                batch.append((rid, pos[rid], n))
        if len(pos) < 6 and rng.random() < 0.5:
            rid = f"S{step}"
            pos[rid] = 0
            batch.append((rid, 0, rng.randint(1, 9)))
        rng.shuffle(batch)
        if not batch:
            continue
        h.step(batch)
        for rid, start, n in batch:
            # Sometimes roll back part of a multi-token step (rejected drafts).
            pos[rid] = start + (rng.randint(1, n) if n > 1 and rng.random() < 0.5 else n)


@pytest.mark.parametrize("seed", range(2))
def test_fresh_memory_is_never_read_before_it_is_zeroed(monkeypatch, seed):
    """The store allocates with torch.empty; poison that memory with NaN: a position attention
    reads (masked or not) before it was zeroed or written would turn the output into NaN, and the
    comparison with the gather path would fail."""
    real_empty = torch.empty

    def poisoned_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.dim() == 5 else t  # the store's tensors only

    monkeypatch.setattr(torch, "empty", poisoned_empty)
    rng = random.Random(seed)
    h = Harness(num_blocks=2000)
    pos = {f"P{i}": rng.randint(1, 40) for i in range(18)}  # more rows than one zeroing chunk
    h.step([(rid, 0, n) for rid, n in pos.items()])
    for step in range(40):
        if step % 9 == 8:  # a finish (row compaction) and a newcomer
            gone = rng.choice(sorted(pos))
            del pos[gone]
            h.store.release(gone)
            pos[f"N{step}"] = 0
        batch = [(rid, p, 1) if p else (rid, 0, rng.randint(1, 9)) for rid, p in pos.items()]
        # Jump some requests far ahead (their rows fill from the paged cache), so lengths cross
        # the 256-position zeroing chunk.
        h.step(batch)
        for rid, p, n in batch:
            pos[rid] = p + n + (rng.randint(0, 20) if step % 4 == 0 else 0)
            table = h.tables[rid]
            while len(table) * BLOCK < pos[rid] + 1:
                table.append(h.free.pop())
    assert h.used_store > 30 and h.store.clean_len >= 256 and h.store.clean_rows >= 18

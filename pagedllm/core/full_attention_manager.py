"""FullAttentionManager: the block tables of one KV cache group of full-attention layers.

Every layer of a group reads the same positions, so one block table per request serves them all
(a block id addresses the same slot in each of the group's layers' KV tensors). A full-attention
request keeps a block for every position it has computed. ``KVCacheManager`` coordinates one
manager per group over a single BlockPool; ``SlidingWindowManager`` (sliding_window_manager.py)
changes what a window group keeps and what its prefix hit needs.
"""
from __future__ import annotations

from pagedllm.core.block_pool import NULL_BLOCK, BlockHashKey, BlockPool, KVCacheBlock
from pagedllm.core.request import Request
from pagedllm.utils import cdiv

NO_BLOCKS: list[KVCacheBlock] = []  # shared "nothing"; callers never mutate it


class FullAttentionManager:
    sliding_window: int | None = None

    def __init__(self, block_pool: BlockPool, block_size: int, enable_caching: bool, group_id: int,
                 block_copies: list[tuple[int, int]], replaced_tables: set[str]) -> None:
        self.block_pool = block_pool
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.group_id = group_id
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request are already published in the prefix cache.
        self.num_cached_blocks: dict[str, int] = {}
        # The coordinator's: copy-on-write copies and changed tables of every group, one report.
        self._block_copies = block_copies
        self._replaced_tables = replaced_tables

    def cache_key(self, block_hash: int) -> BlockHashKey:
        """The first group publishes under the plain hash (a one-group cache is what it always
        was); the others add their id, since each group keeps its own KV of a prefix."""
        return block_hash if self.group_id == 0 else (block_hash, self.group_id)

    # -- prefix cache ------------------------------------------------------------------------
    def find_hits(self, block_hashes: list[int], max_blocks: int) -> list[KVCacheBlock]:
        """The longest run of cached blocks from the start, at most ``max_blocks``."""
        get, key = self.block_pool.get_cached_block, self.cache_key
        hits: list[KVCacheBlock] = []
        for block_hash in block_hashes[:max_blocks]:
            block = get(key(block_hash))
            if block is None:
                break
            hits.append(block)
        return hits

    # -- allocation --------------------------------------------------------------------------
    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Full attention reads every position again: nothing is ever skipped."""

    def fits_in_last_block(self, request_id: str, start: int, num_new_tokens: int,
                           read_start: int | None = None) -> bool:
        """The usual decode step, decided in O(1): tokens [start, start + n) land inside the
        request's own (unshared) last block without filling it: nothing to allocate, copy or
        publish. ``read_start``: where the step may really start (a window group's concern)."""
        blocks = self.req_to_blocks.get(request_id)
        if not blocks or blocks[-1].ref_cnt != 1:
            return False
        return 0 <= start - (len(blocks) - 1) * self.block_size < self.block_size - num_new_tokens

    def _cow_indices(self, table: list[KVCacheBlock], start: int, end: int) -> list[int]:
        """Blocks already in the table that tokens [start, end) write into and others share
        (prefix hits are full and computed: nothing is written into them)."""
        if start == end or not table:
            return NO_BLOCKS  # type: ignore[return-value]  # an empty list of either kind
        bs = self.block_size
        return [i for i in range(start // bs, min(len(table), cdiv(end, bs))) if table[i].ref_cnt > 1]

    def num_blocks_needed(self, request_id: str, start: int, end: int,
                          hits: list[KVCacheBlock]) -> int:
        """How many blocks this group takes from the free queue to hold tokens [start, end):
        new blocks, copies of shared ones written into, and hit blocks sitting in the queue."""
        table = self.req_to_blocks.get(request_id, NO_BLOCKS)
        num_new = max(cdiv(end, self.block_size) - len(table) - len(hits), 0)
        num_hits_free = sum(1 for b in hits if b.ref_cnt == 0 and b is not NULL_BLOCK) if hits else 0
        return num_new + len(self._cow_indices(table, start, end)) + num_hits_free

    def add_hits(self, request_id: str, hits: list[KVCacheBlock]) -> None:
        """Start the table of a request being admitted with its prefix hit. Every group takes
        its hits before any group allocates: a hit block sitting in the free queue must not be
        handed out as another group's new block."""
        assert request_id not in self.req_to_blocks, "prefix hits go into an empty table"
        self.block_pool.touch([b for b in hits if b is not NULL_BLOCK])
        self.req_to_blocks[request_id] = list(hits)

    def allocate(self, request: Request, start: int, end: int, num_hits: int) -> list[KVCacheBlock]:
        """Take what ``num_blocks_needed`` counted (the caller checked that the pool has it, and
        added the ``num_hits`` prefix hits first) and publish the blocks that are full; returns
        the newly allocated blocks."""
        rid = request.request_id
        table = self.req_to_blocks.get(rid)
        if table is None:
            table = self.req_to_blocks[rid] = []
        cow = self._cow_indices(table, start, end)
        if cow:
            self._copy_on_write(rid, table, cow)
        num_new = cdiv(end, self.block_size) - len(table)
        new_blocks = self.block_pool.get_new_blocks(num_new) if num_new > 0 else NO_BLOCKS
        if new_blocks:
            table.extend(new_blocks)
        if self.enable_caching:
            self._publish(request, table, num_hits, end)
        return new_blocks

    def _publish(self, request: Request, table: list[KVCacheBlock], num_hits: int, end: int) -> None:
        """Publish blocks as soon as they are allocated, so that identical prompts scheduled in
        the same step share them (the runner writes a layer's new K/V before that layer reads
        the cache). Drafts are not part of the sequence: never publish them."""
        rid = request.request_id
        num_cached = self.num_cached_blocks.get(rid, 0) + num_hits
        num_full = min(end, request.num_tokens) // self.block_size
        if num_full > num_cached:
            hashes, key, cache = request.block_hashes, self.cache_key, self.block_pool.cache_block
            for i in range(num_cached, num_full):
                if table[i] is not NULL_BLOCK:
                    cache(table[i], key(hashes[i]))
            num_cached = num_full
        self.num_cached_blocks[rid] = num_cached

    def _copy_on_write(self, rid: str, table: list[KVCacheBlock], indices: list[int]) -> None:
        for i, new in zip(indices, self.block_pool.get_new_blocks(len(indices))):
            old = table[i]
            self._block_copies.append((old.block_id, new.block_id))
            table[i] = new
            self.block_pool.free_blocks([old])  # drops our reference; the others keep it
        self._replaced_tables.add(rid)

    # -- sharing -----------------------------------------------------------------------------
    def can_fork(self, parent_id: str, num_computed: int) -> bool:
        """Whether the parent still holds every block a child computing from ``num_computed``
        reads (full attention: all of them, always)."""
        return True

    def fork(self, parent_id: str, child_id: str, num_computed: int) -> None:
        """Share the parent's blocks holding positions [0, num_computed) with the child."""
        shared = self.req_to_blocks.get(parent_id, NO_BLOCKS)[:cdiv(num_computed, self.block_size)]
        self.block_pool.touch([b for b in shared if b is not NULL_BLOCK])
        self.req_to_blocks[child_id] = list(shared)
        self.num_cached_blocks[child_id] = min(self.num_cached_blocks.get(parent_id, 0),
                                               num_computed // self.block_size)

    # -- release -----------------------------------------------------------------------------
    def free(self, request_id: str, num_valid_tokens: int | None = None) -> None:
        """Give back every block of the request, last block first (so its tail is evicted first);
        blocks past ``num_valid_tokens`` are unpublished (their KV will never be computed)."""
        blocks = self.req_to_blocks.pop(request_id, None)
        self.num_cached_blocks.pop(request_id, None)
        if not blocks:
            return
        if num_valid_tokens is not None:
            for block in blocks[num_valid_tokens // self.block_size:]:
                if block.ref_cnt == 1:
                    self.block_pool.uncache_block(block)
        self.block_pool.free_blocks([b for b in reversed(blocks) if b is not NULL_BLOCK])

"""BlockPool: the physical KV blocks, their reference counts, the LRU free queue and the
prefix-cache index (block hash -> block).

A block with ``ref_cnt == 0`` sits in the free queue but may still hold a hash: it is a cached
block that nobody uses. It is evicted lazily, only when ``get_new_blocks`` hands it out again.
"""
from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass

# What a block is published under: its hash chain (block_hash.py) in the first KV cache group,
# (hash, group id) in the others, since each group holds its own copy of a prefix's KV.
BlockHashKey = Hashable


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHashKey | None = None
        # Links of the intrusive doubly linked free queue (None when not in the queue).
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={self.block_hash})"


# The null block: what a sliding-window group's table holds at the positions that fell out of
# the window (and at a prefix hit's positions before the window). Never in a pool: it is never
# allocated, freed, ref-counted or published, and nothing reads it, since every attention
# backend masks the positions outside the window. Its id is -1; the runner maps it to a valid
# block id before indexing the KV tensors.
NULL_BLOCK = KVCacheBlock(-1)
NULL_BLOCK_ID = -1


class FreeKVCacheBlockQueue:
    """Free blocks in eviction order: the head is evicted first.

    An intrusive doubly linked list so that a cached block hit by a new request can be taken out
    of the middle in O(1) (a deque would need O(n)).
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)  # sentinels
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"{block} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """At the tail: evicted last."""
        self._insert_before(self._tail, block)

    def appendleft(self, block: KVCacheBlock) -> None:
        """At the head: handed out next."""
        assert self._head.next_free is not None
        self._insert_before(self._head.next_free, block)

    def _insert_before(self, nxt: KVCacheBlock, block: KVCacheBlock) -> None:
        prev = nxt.prev_free
        assert prev is not None and block.prev_free is None
        prev.next_free = block
        block.prev_free = prev
        block.next_free = nxt
        nxt.prev_free = block
        self.num_free_blocks += 1

    def __iter__(self):
        block = self._head.next_free
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free

    def block_ids(self) -> list[int]:
        return [b.block_id for b in self]


@dataclass(slots=True)
class BlockEvents:
    """What happened to blocks since the last report (for the step trace and stats)."""
    num_allocated: int = 0  # handed out from the free queue
    num_freed: int = 0  # last reference dropped: back to the free queue
    num_evicted: int = 0  # a cached block's hash forgotten when it was handed out again


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block: dict[BlockHashKey, KVCacheBlock] = {}
        self.events = BlockEvents()

    # -- queries -----------------------------------------------------------------------------
    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Share of blocks in use by some request (cached-but-free blocks count as free)."""
        return 1.0 - self.get_num_free_blocks() / self.num_blocks

    def get_cached_block(self, block_hash: BlockHashKey) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    # -- allocation --------------------------------------------------------------------------
    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take blocks from the head of the free queue: freed blocks without a hash, then the
        never-used ones, then cached blocks, least recently freed first (``free_blocks``)."""
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"cannot get {num_blocks} blocks; only {self.get_num_free_blocks()} free")
        return [self.get_new_block() for _ in range(num_blocks)]

    def get_new_block(self) -> KVCacheBlock | None:
        """One block from the head of the free queue, or None when none is free (decode hot path)."""
        queue = self.free_block_queue
        if not queue.num_free_blocks:
            return None
        block = queue.popleft()
        if block.block_hash is not None:
            self._evict(block)
            self.events.num_evicted += 1
        block.ref_cnt = 1
        self.events.num_allocated += 1
        return block

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Add a reference to each block (a prefix hit or a fork), pulling free ones out of the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each; blocks reaching zero join the free queue. A cached
        block (one with a hash) joins the tail, in the given order (callers pass a request's
        blocks last-first, so its tail is evicted first). A block without a hash joins the
        head, to be handed out first: it holds nothing a later request could reuse, so taking
        it before any cached block keeps cached prefixes longer; and its memory is the most
        recently written (warm in the CPU caches, already committed: layers/kv_cache.py)."""
        queue = self.free_block_queue
        for block in ordered_blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"double free of {block}"
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    queue.appendleft(block)
                else:
                    queue.append(block)
                self.events.num_freed += 1

    def take_events(self) -> BlockEvents:
        """The block events since the last call, and start counting afresh."""
        events, self.events = self.events, BlockEvents()
        return events

    # -- prefix cache ------------------------------------------------------------------------
    def cache_block(self, block: KVCacheBlock, block_hash: BlockHashKey) -> None:
        """Publish a full block under its hash (no-op when caching is off or the hash is taken:
        the first block stays canonical, the duplicate simply stays unpublished)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached_block_hash_to_block:
            return
        block.block_hash = block_hash
        self.cached_block_hash_to_block[block_hash] = block

    def uncache_block(self, block: KVCacheBlock) -> None:
        self._evict(block)

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.cached_block_hash_to_block.get(block.block_hash) is block:
                del self.cached_block_hash_to_block[block.block_hash]
            block.block_hash = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Refused (False) while some block is in use, since a running
        request could still publish into it and its KV is valid."""
        if self.get_num_free_blocks() != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        return True

    # -- invariants --------------------------------------------------------------------------
    def check_integrity(self) -> None:
        free = list(self.free_block_queue)
        free_ids = {b.block_id for b in free}
        assert len(free_ids) == len(free) == self.free_block_queue.num_free_blocks, "free queue corrupt"
        used = [b for b in self.blocks if b.ref_cnt > 0]
        assert all(b.ref_cnt >= 0 for b in self.blocks), "negative ref count"
        assert all(b.ref_cnt == 0 for b in free), "referenced block in the free queue"
        assert len(free) + len(used) == self.num_blocks, "free + used != total"
        for block_hash, block in self.cached_block_hash_to_block.items():
            assert block.block_hash == block_hash, f"hash index points at {block} not holding it"
        for block in self.blocks:
            if block.block_hash is not None:
                assert self.cached_block_hash_to_block.get(block.block_hash) is block, \
                    f"{block} holds a hash the index does not know"

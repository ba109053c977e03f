"""SlidingWindowManager: the block tables of one KV cache group of sliding-window layers.

A query at position p reads the keys at positions (p - window, p]. So a step computing tokens
from ``start`` on reads nothing before ``start - window + 1``: the blocks wholly before it are
given back to the pool and their table slots hold the shared ``NULL_BLOCK`` (the positions keep
their index; the backends mask them, nothing reads them). A request then holds at most about a
window plus a chunk of KV in this group, however long it grows.

Async scheduling: a block freed while step N+1 is scheduled may still be read by step N, which
is running. That is safe because the runner executes steps in order: the block can only be
handed out again, and rewritten, in step N+1 (or later), after step N's reads are done.

A prefix hit of this group needs only the last window before the hit point: the rightmost run of
``cdiv(window - 1, block_size)`` cached blocks (or a run from the very start).
"""
from __future__ import annotations

from pagedllm.core.block_pool import NULL_BLOCK, BlockPool, KVCacheBlock
from pagedllm.core.full_attention_manager import NO_BLOCKS, FullAttentionManager
from pagedllm.utils import cdiv


class SlidingWindowManager(FullAttentionManager):
    def __init__(self, block_pool: BlockPool, block_size: int, enable_caching: bool, group_id: int,
                 block_copies: list[tuple[int, int]], replaced_tables: set[str],
                 sliding_window: int) -> None:
        super().__init__(block_pool, block_size, enable_caching, group_id, block_copies,
                         replaced_tables)
        assert sliding_window >= 1
        self.sliding_window = sliding_window
        # Blocks before a hit point whose keys the first new token reads (positions
        # hit - window + 1 .. hit - 1).
        self.num_window_blocks = cdiv(sliding_window - 1, block_size)
        # Leading table slots already nulled, per request (so a decode step checks in O(1)).
        self.num_skipped_blocks: dict[str, int] = {}

    def _num_skipped(self, num_computed_tokens: int) -> int:
        """Leading blocks that a step starting at ``num_computed_tokens`` never reads."""
        return max((num_computed_tokens - self.sliding_window + 1) // self.block_size, 0)

    # -- prefix cache ------------------------------------------------------------------------
    def find_hits(self, block_hashes: list[int], max_blocks: int) -> list[KVCacheBlock]:
        """The longest hit of at most ``max_blocks`` blocks whose last window is cached: the
        rightmost run of ``num_window_blocks`` cached blocks, or a run from block 0; the slots
        before the run hold the null block."""
        get, key, need = self.block_pool.get_cached_block, self.cache_key, self.num_window_blocks
        if need == 0:  # a window of one token reads only itself
            return [NULL_BLOCK] * max_blocks
        run: list[KVCacheBlock] = []  # cached blocks ending at the candidate hit point, reversed
        for i in range(min(max_blocks, len(block_hashes)) - 1, -1, -1):
            block = get(key(block_hashes[i]))
            if block is None:
                run = []
                continue
            run.append(block)
            if len(run) == need:
                return [NULL_BLOCK] * i + run[::-1]
        return run[::-1]  # blocks 0 .. len(run) - 1 all cached (or no hit at all)

    # -- allocation --------------------------------------------------------------------------
    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Free the blocks that the step starting at ``num_computed_tokens`` (and every later
        one) never reads, replacing them with the null block."""
        num_skipped = self._num_skipped(num_computed_tokens)
        done = self.num_skipped_blocks.get(request_id, 0)
        if num_skipped <= done:
            return
        table = self.req_to_blocks.get(request_id)
        if not table:
            return
        num_skipped = min(num_skipped, len(table))
        # Last first, like free(): the older block goes to the queue's tail, evicted last.
        freed = [table[i] for i in range(num_skipped - 1, done - 1, -1) if table[i] is not NULL_BLOCK]
        for i in range(done, num_skipped):
            table[i] = NULL_BLOCK
        self.num_skipped_blocks[request_id] = num_skipped
        if freed:
            self.block_pool.free_blocks(freed)

    def fits_in_last_block(self, request_id: str, start: int, num_new_tokens: int,
                           read_start: int | None = None) -> bool:
        self.remove_skipped_blocks(request_id, start if read_start is None else read_start)
        return super().fits_in_last_block(request_id, start, num_new_tokens)

    def add_hits(self, request_id: str, hits: list[KVCacheBlock]) -> None:
        super().add_hits(request_id, hits)
        # The null slots of a prefix hit count as skipped.
        self.num_skipped_blocks[request_id] = next(
            (i for i, b in enumerate(hits) if b is not NULL_BLOCK), len(hits))

    # -- sharing -----------------------------------------------------------------------------
    def can_fork(self, parent_id: str, num_computed: int) -> bool:
        """The child's first step reads positions from ``num_computed - window + 1``: the parent
        must still hold those blocks (a parent that moved far on has freed them)."""
        table = self.req_to_blocks.get(parent_id, NO_BLOCKS)
        first = self._num_skipped(num_computed)
        return all(b is not NULL_BLOCK for b in table[first:cdiv(num_computed, self.block_size)])

    def fork(self, parent_id: str, child_id: str, num_computed: int) -> None:
        super().fork(parent_id, child_id, num_computed)
        table = self.req_to_blocks[child_id]
        self.num_skipped_blocks[child_id] = next(
            (i for i, b in enumerate(table) if b is not NULL_BLOCK), len(table))

    # -- release -----------------------------------------------------------------------------
    def free(self, request_id: str, num_valid_tokens: int | None = None) -> None:
        self.num_skipped_blocks.pop(request_id, None)
        super().free(request_id, num_valid_tokens)


def max_window_blocks(window: int, num_tokens: int, max_chunk: int, block_size: int) -> int:
    """The most blocks a request of ``num_tokens`` holds in a group of window ``window`` when a
    step computes at most ``max_chunk`` of its tokens: a step of n tokens from s holds blocks
    (s - window + 1) // bs .. (s + n - 1) // bs, at most cdiv(window - 2 + n, bs) + 1 of them."""
    return min(cdiv(num_tokens, block_size), cdiv(window - 2 + max_chunk, block_size) + 1)

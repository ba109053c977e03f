"""KVCacheManager: per-request block tables on top of the BlockPool, one table per KV cache group.

It answers the scheduler's questions: which prompt blocks are already cached
(``get_computed_blocks``), can this request get slots for N more tokens (``allocate_slots``,
all-or-nothing), and give everything back (``free``). Sharing lives here too: ``fork`` gives a
new sequence every block of the one it continues, and the first write into a shared block
copies it (copy-on-write), the copy reported to the runner through ``take_block_copies``.

KV cache groups (vLLM V1's hybrid allocator): the model's layers are grouped by attention type,
full attention or a sliding window of w tokens (the runner decides the groups, see
runner/kv_cache_groups.py, and hands over each group's window). Every group has its own block
table per request, all drawn from one BlockPool: a block id costs the same bytes in every group
because the runner lets group g's i-th layer use KV tensor i. A full-attention group
(full_attention_manager.py) keeps every position; a window group (sliding_window_manager.py)
gives back the blocks that fell out of the window. Everything per request is therefore a tuple
with one entry per group (``KVCacheBlocks``); with one group this is exactly the plain paged
cache, same blocks, same order.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pagedllm.core.block_hash import extend_block_hashes
from pagedllm.core.block_pool import NULL_BLOCK, BlockPool, KVCacheBlock
from pagedllm.core.full_attention_manager import NO_BLOCKS, FullAttentionManager
from pagedllm.core.request import Request
from pagedllm.core.sliding_window_manager import SlidingWindowManager, max_window_blocks
from pagedllm.utils import cdiv

# Per KV cache group, some blocks of one request (hits, new blocks).
KVCacheBlocks = tuple[list[KVCacheBlock], ...]
# The shared "nothing new in any group" result of allocate_slots; callers never mutate it.
NO_NEW_BLOCKS: KVCacheBlocks = ()

__all__ = ["KVCacheBlocks", "KVCacheManager", "NO_NEW_BLOCKS", "PrefixCacheStats",
           "max_blocks_per_request"]


@dataclass(slots=True)
class PrefixCacheStats:
    """Prefix-cache lookups since the last report: prompt tokens queried and found cached."""
    queries: int = 0
    hits: int = 0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 sliding_windows: Sequence[int | None] = (None,), max_chunk_tokens: int = 0) -> None:
        """``sliding_windows``: each KV cache group's window (None: full attention), in the
        runner's group order; ``max_chunk_tokens``: the most tokens one step computes for a
        request (bounds what a window group holds, for admission)."""
        if not sliding_windows:
            raise ValueError("a KV cache needs at least one group")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.max_chunk_tokens = max_chunk_tokens
        self.block_pool = BlockPool(num_blocks, block_size, enable_caching)
        self._block_copies: list[tuple[int, int]] = []
        self._replaced_tables: set[str] = set()
        self.managers: list[FullAttentionManager] = [
            FullAttentionManager(self.block_pool, block_size, enable_caching, g, self._block_copies,
                                 self._replaced_tables) if w is None else
            SlidingWindowManager(self.block_pool, block_size, enable_caching, g, self._block_copies,
                                 self._replaced_tables, w)
            for g, w in enumerate(sliding_windows)]
        self.num_groups = len(self.managers)
        self.sliding_windows = tuple(sliding_windows)
        self._full = [m for m in self.managers if m.sliding_window is None]
        self._windowed = [m for m in self.managers if m.sliding_window is not None]
        self._no_hits: KVCacheBlocks = tuple(NO_BLOCKS for _ in self.managers)
        self.prefix_cache_stats = PrefixCacheStats()

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    @property
    def req_to_blocks(self) -> dict[str, list[KVCacheBlock]]:
        """Group 0's block tables only: its keys are every request that holds blocks (each
        request has a table in every group or none), its values are the whole story only for a
        single-group cache. For every group's blocks use ``get_block_ids``."""
        return self.managers[0].req_to_blocks

    def get_block_ids(self, request_id: str) -> list[list[int]]:
        """The request's block table in each group (the null block as -1)."""
        return [[b.block_id for b in m.req_to_blocks.get(request_id, NO_BLOCKS)] for m in self.managers]

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        return tuple(m.req_to_blocks.get(request_id, NO_BLOCKS) for m in self.managers)

    def num_blocks_needed(self, num_tokens: int) -> int:
        """The most blocks (all groups together) one request of ``num_tokens`` tokens holds at
        once: what admission checks against the whole cache."""
        return max_blocks_per_request(self.sliding_windows, num_tokens, self.max_chunk_tokens,
                                      self.block_size)

    # -- prefix cache lookup -----------------------------------------------------------------
    def update_block_hashes(self, request: Request) -> None:
        if self.enable_caching:
            extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size,
                                request.cache_salt)

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """The longest prefix of the request's tokens that every group has cached: the leading
        run of full blocks for full attention, a run ending at the hit point that covers the
        window for a window group.

        Never covers the last token: its logits are needed to sample the next one. Requests that
        want prompt logprobs skip the cache, since every prompt position must be computed, and so
        do pooling requests (no sampling params), whose pooler reads every position.
        """
        sp = request.sampling_params
        if not self.enable_caching or sp is None or sp.prompt_logprobs is not None:
            return self._no_hits, 0
        self.update_block_hashes(request)
        hashes = request.block_hashes
        num_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[list[KVCacheBlock]] = [NO_BLOCKS] * self.num_groups
        # Full attention: a prefix property, so a shorter agreement just truncates its run.
        for m in self._full:
            hits[m.group_id] = m.find_hits(hashes, num_hit_blocks)
            num_hit_blocks = len(hits[m.group_id])
        # Window groups: each finds its rightmost hit within the current bound; repeat until
        # they all agree (the bound only shrinks).
        while self._windowed:
            agreed = num_hit_blocks
            for m in self._windowed:
                hits[m.group_id] = m.find_hits(hashes, num_hit_blocks)
                agreed = min(agreed, len(hits[m.group_id]))
            if all(len(hits[m.group_id]) == agreed for m in self._windowed):
                break
            num_hit_blocks = agreed
        num_hit_blocks = min(len(h) for h in hits)
        num_hit = num_hit_blocks * self.block_size
        self.prefix_cache_stats.queries += request.num_tokens
        self.prefix_cache_stats.hits += num_hit
        return tuple(h[:num_hit_blocks] for h in hits), num_hit

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """The lookups since the last call (for the step's SchedulerStats), and start afresh."""
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    # -- allocation --------------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: KVCacheBlocks | None = None) -> KVCacheBlocks | None:
        """Make room for ``num_new_tokens`` more tokens after the computed ones (after the prefix
        hit ``new_computed_blocks``, on admission) in every group. Returns the newly allocated
        blocks per group (``NO_NEW_BLOCKS`` when there are none), or None, allocating nothing,
        when the pool cannot supply them all."""
        rid = request.request_id
        start = request.num_computed_tokens + num_new_computed_tokens
        # A window group keeps what the runner may read: from before drafts that may roll back.
        read_start = start - request.num_drafts_in_flight
        managers = self.managers
        # The usual decode step (this runs for every running request every step): in every group
        # the new tokens land inside the request's own last block. A window group first gives
        # back what fell out of the window: always right, whatever happens to this step.
        if not new_computed_blocks:
            if self.num_groups == 1:
                if managers[0].fits_in_last_block(rid, start, num_new_tokens, read_start):
                    return NO_NEW_BLOCKS
            elif all([m.fits_in_last_block(rid, start, num_new_tokens, read_start) for m in managers]):
                return NO_NEW_BLOCKS  # (a list, not a generator: every group frees its skipped)
        end = start + num_new_tokens
        hits = new_computed_blocks or self._no_hits
        needed = 0
        for m, group_hits in zip(managers, hits):
            needed += m.num_blocks_needed(rid, start, end, group_hits)
        if needed > self.block_pool.get_num_free_blocks():
            return None
        if self.enable_caching and min(end, request.num_tokens) // self.block_size > len(
                request.block_hashes):
            self.update_block_hashes(request)  # the blocks this step fills get published
        if new_computed_blocks:
            for m, group_hits in zip(managers, hits):
                m.add_hits(rid, group_hits)
        num_hits = len(hits[0])  # the same in every group
        new_blocks = tuple([m.allocate(request, start, end, num_hits) for m in managers])
        return new_blocks if any(new_blocks) else NO_NEW_BLOCKS

    def take_block_copies(self) -> tuple[list[tuple[int, int]], set[str]]:
        """The (src, dst) copies made since the last call (block ids of the one pool, whatever
        the group), and the requests whose tables changed."""
        copies, replaced = self._block_copies[:], set(self._replaced_tables)
        self._block_copies.clear()
        self._replaced_tables.clear()
        return copies, replaced

    # -- sharing -----------------------------------------------------------------------------
    def fork(self, parent: Request, child: Request) -> int:
        """Share with ``child`` every block of ``parent`` that holds the child's computed tokens
        (the partial last one included) in every group, and return how many tokens that is (0:
        nothing shared, the child recomputes).

        The child's tokens continue a prefix of the parent's: a parallel sample starts from the
        prompt (it recomputes only the last prompt token, to sample its own first token), a beam
        from the parent's whole sequence plus one token. The last token is never counted, so
        the child always has something to compute. A window group whose parent has already
        freed what the child's first step reads shares nothing (and neither does any group).
        """
        pid = parent.request_id
        num_computed = min(parent.num_computed_tokens, child.num_tokens - 1,
                           *(len(m.req_to_blocks.get(pid, NO_BLOCKS)) * self.block_size
                             for m in self.managers))
        if num_computed <= 0 or not all(m.can_fork(pid, num_computed) for m in self.managers):
            return 0
        for m in self.managers:
            m.fork(pid, child.request_id, num_computed)
        child.block_hashes = parent.block_hashes[:min(len(parent.block_hashes),
                                                      child.num_tokens // self.block_size)]
        return num_computed

    # -- release -----------------------------------------------------------------------------
    def free(self, request: Request, num_valid_tokens: int | None = None) -> None:
        """Give back every block of the request in every group, last block first (so its tail is
        evicted first).

        ``num_valid_tokens``: blocks past this many tokens were published but their KV will never
        be computed (a victim preempted in the step that scheduled it); unpublish those.
        """
        rid = request.request_id
        self._replaced_tables.discard(rid)
        for m in self.managers:
            m.free(rid, num_valid_tokens)

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def check_integrity(self) -> None:
        self.block_pool.check_integrity()
        refs: dict[int, int] = {}
        for m in self.managers:
            for blocks in m.req_to_blocks.values():
                for b in blocks:
                    if b is NULL_BLOCK:
                        assert m.sliding_window is not None, "a null block in a full-attention table"
                        continue
                    refs[b.block_id] = refs.get(b.block_id, 0) + 1
        assert NULL_BLOCK.ref_cnt == 0 and NULL_BLOCK.block_hash is None, "the null block was used"
        for b in self.block_pool.blocks:
            assert b.ref_cnt == refs.get(b.block_id, 0), \
                f"block {b.block_id}: ref_cnt {b.ref_cnt} but {refs.get(b.block_id, 0)} tables hold it"
        tables = [set(m.req_to_blocks) for m in self.managers]
        assert all(t == tables[0] for t in tables), "a request has a table in some groups only"


def max_blocks_per_request(sliding_windows: Sequence[int | None], num_tokens: int,
                           max_chunk_tokens: int, block_size: int) -> int:
    """The most blocks (all groups together) a request of ``num_tokens`` tokens holds at once
    when a step computes at most ``max_chunk_tokens`` of them (0: no limit): what admission
    checks, and what sizing the cache for every running request at full length counts."""
    chunk = max_chunk_tokens or num_tokens
    return sum(cdiv(num_tokens, block_size) if w is None else
               max_window_blocks(w, num_tokens, chunk, block_size) for w in sliding_windows)

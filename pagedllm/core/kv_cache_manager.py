"""KVCacheManager: per-request block tables on top of the BlockPool.

It answers the scheduler's questions: which prompt blocks are already cached
(``get_computed_blocks``), can this request get slots for N more tokens (``allocate_slots``,
all-or-nothing), and give everything back (``free``). Sharing lives here too: ``fork`` gives a
new sequence every block of the one it continues, and the first write into a shared block
copies it (copy-on-write), the copy reported to the runner through ``take_block_copies``.
"""
from __future__ import annotations

from dataclasses import dataclass

from pagedllm.core.block_hash import extend_block_hashes
from pagedllm.core.block_pool import BlockPool, KVCacheBlock
from pagedllm.core.request import Request


NO_NEW_BLOCKS: list[KVCacheBlock] = []  # shared "nothing new" result; callers never mutate it


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(slots=True)
class PrefixCacheStats:
    """Prefix-cache lookups since the last report: prompt tokens queried and found cached."""
    queries: int = 0
    hits: int = 0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, block_size, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request are already published in the prefix cache.
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()
        self._block_copies: list[tuple[int, int]] = []
        self._replaced_tables: set[str] = set()

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    # -- prefix cache lookup -----------------------------------------------------------------
    def update_block_hashes(self, request: Request) -> None:
        if self.enable_caching:
            extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size,
                                request.cache_salt)

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest run of cached full blocks at the start of the request's tokens.

        Never covers the last token: its logits are needed to sample the next one. Requests that
        want prompt logprobs skip the cache, since every prompt position must be computed.
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        self.update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        num_hit = len(hits) * self.block_size
        self.prefix_cache_stats.queries += request.num_tokens
        self.prefix_cache_stats.hits += num_hit
        return hits, num_hit

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """The lookups since the last call (for the step's SchedulerStats), and start afresh."""
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    # -- allocation --------------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: list[KVCacheBlock] | None = None) -> list[KVCacheBlock] | None:
        """Make room for ``num_new_tokens`` more tokens after the computed ones (after the prefix
        hit ``new_computed_blocks``, on admission). Returns the newly allocated blocks, or None,
        changing nothing, when the pool cannot supply them."""
        bs = self.block_size
        rid = request.request_id
        blocks = self.req_to_blocks.get(rid)
        start = request.num_computed_tokens + num_new_computed_tokens
        # The usual decode step, decided from the last block in O(1) (this runs for every running
        # request every step): the new tokens land inside the request's own last block without
        # filling it, so there is nothing to allocate, copy or publish.
        if blocks and not new_computed_blocks and blocks[-1].ref_cnt == 1:
            if 0 <= start - (len(blocks) - 1) * bs < bs - num_new_tokens:
                return NO_NEW_BLOCKS
        end = start + num_new_tokens

        table = blocks if blocks is not None else []
        hits = new_computed_blocks or NO_NEW_BLOCKS  # only at admission, into an empty table
        num_required = cdiv(end, bs)
        num_new_blocks = max(num_required - len(table) - len(hits), 0)
        # Blocks already in the table that this step writes into: copy them first if shared
        # (prefix hits are full and computed: nothing is written into them).
        cow = [i for i in range(start // bs, min(len(table), num_required))
               if table[i].ref_cnt > 1] if num_new_tokens and table else NO_NEW_BLOCKS
        # Hit blocks that sit in the free queue (cached, unused) are taken from it too.
        num_hits_free = sum(1 for b in hits if b.ref_cnt == 0) if hits else 0
        if num_new_blocks + len(cow) + num_hits_free > self.block_pool.get_num_free_blocks():
            return None

        if hits:
            assert not table, "prefix hits go into an empty table (a request being admitted)"
            self.block_pool.touch(hits)
            table.extend(hits)
        if cow:
            self._copy_on_write(rid, table, cow)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks) if num_new_blocks else NO_NEW_BLOCKS
        if new_blocks:
            table.extend(new_blocks)
        if blocks is None:
            self.req_to_blocks[rid] = table
        if self.enable_caching:
            # Publish blocks as soon as they are allocated, so that identical prompts scheduled
            # in the same step share them (the runner writes a layer's new K/V before that layer
            # reads the cache). Drafts are not part of the sequence: never publish them.
            num_cached = self.num_cached_blocks.get(rid, 0) + len(hits)
            num_full = min(end, request.num_tokens) // bs
            if num_full > num_cached:
                self.update_block_hashes(request)
                for i in range(num_cached, num_full):
                    self.block_pool.cache_block(table[i], request.block_hashes[i])
                num_cached = num_full
            self.num_cached_blocks[rid] = num_cached
        return new_blocks

    def _copy_on_write(self, rid: str, table: list[KVCacheBlock], indices: list[int]) -> None:
        for i, new in zip(indices, self.block_pool.get_new_blocks(len(indices))):
            old = table[i]
            self._block_copies.append((old.block_id, new.block_id))
            table[i] = new
            self.block_pool.free_blocks([old])  # drops our reference; the others keep it
        self._replaced_tables.add(rid)

    def take_block_copies(self) -> tuple[list[tuple[int, int]], set[str]]:
        """The (src, dst) copies made since the last call, and the requests whose tables changed."""
        copies, replaced = self._block_copies, self._replaced_tables
        self._block_copies, self._replaced_tables = [], set()
        return copies, replaced

    # -- sharing -----------------------------------------------------------------------------
    def fork(self, parent: Request, child: Request) -> int:
        """Share with ``child`` every block of ``parent`` that holds the child's computed tokens
        (the partial last one included) and return how many tokens that is.

        The child's tokens continue a prefix of the parent's: a parallel sample starts from the
        prompt (it recomputes only the last prompt token, to sample its own first token), a beam
        from the parent's whole sequence plus one token. The last token is never counted, so
        the child always has something to compute.
        """
        parent_blocks = self.req_to_blocks.get(parent.request_id, [])
        num_computed = min(parent.num_computed_tokens, child.num_tokens - 1,
                           len(parent_blocks) * self.block_size)
        shared = parent_blocks[:cdiv(num_computed, self.block_size)]
        self.block_pool.touch(shared)
        self.req_to_blocks[child.request_id] = list(shared)
        num_full = num_computed // self.block_size
        self.num_cached_blocks[child.request_id] = min(
            self.num_cached_blocks.get(parent.request_id, 0), num_full)
        child.block_hashes = parent.block_hashes[:min(len(parent.block_hashes),
                                                      child.num_tokens // self.block_size)]
        return num_computed

    # -- release -----------------------------------------------------------------------------
    def free(self, request: Request, num_valid_tokens: int | None = None) -> None:
        """Give back every block of the request, last block first (so its tail is evicted first).

        ``num_valid_tokens``: blocks past this many tokens were published but their KV will never
        be computed (a victim preempted in the step that scheduled it); unpublish those.
        """
        rid = request.request_id
        blocks = self.req_to_blocks.pop(rid, None)
        self.num_cached_blocks.pop(rid, None)
        self._replaced_tables.discard(rid)
        if not blocks:
            return
        if num_valid_tokens is not None:
            for block in blocks[num_valid_tokens // self.block_size:]:
                if block.ref_cnt == 1:
                    self.block_pool.uncache_block(block)
        self.block_pool.free_blocks(reversed(blocks))

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def check_integrity(self) -> None:
        self.block_pool.check_integrity()
        refs: dict[int, int] = {}
        for blocks in self.req_to_blocks.values():
            for b in blocks:
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
        for b in self.block_pool.blocks:
            assert b.ref_cnt == refs.get(b.block_id, 0), \
                f"block {b.block_id}: ref_cnt {b.ref_cnt} but {refs.get(b.block_id, 0)} tables hold it"

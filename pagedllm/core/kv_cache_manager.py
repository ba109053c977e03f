"""KVCacheManager: per-request block tables on top of the BlockPool.

It answers three questions for the scheduler: which prompt blocks are already cached
(``get_computed_blocks``), can this request get slots for N more tokens (``allocate_slots``,
all-or-nothing), and give everything back (``free``). ``fork`` shares a request's blocks with a
child; the first write into a shared block copies it (copy-on-write) and the copy is reported to
the runner through ``take_block_copies``.
"""
from __future__ import annotations

from pagedllm.core.block_hash import extend_block_hashes
from pagedllm.core.block_pool import BlockPool, KVCacheBlock
from pagedllm.core.request import Request


NO_NEW_BLOCKS: list[KVCacheBlock] = []  # shared "nothing new" result; callers never mutate it


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, block_size, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request are already published in the prefix cache.
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_queries = 0  # prompt tokens looked up
        self.prefix_cache_hits = 0  # of which found cached
        self._block_copies: list[tuple[int, int]] = []
        self._replaced_tables: set[str] = set()

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

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
        return hits, len(hits) * self.block_size

    def record_prefix_cache_query(self, num_queried: int, num_hit: int) -> None:
        self.prefix_cache_queries += num_queried
        self.prefix_cache_hits += num_hit

    # -- allocation --------------------------------------------------------------------------
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_lookahead_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Make room for ``num_new_tokens`` more tokens after the computed ones (plus the prefix
        hit ``new_computed_blocks`` on admission). Returns the newly allocated blocks, or None
        (changing nothing) when the pool cannot supply them.

        The plain decode step takes the shortcut ``append_slot`` instead.
        """
        request.kv_in_place_until = 0
        rid = request.request_id
        bs = self.block_size
        blocks = self.req_to_blocks.get(rid)
        if blocks is None:
            blocks = []
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        end = num_computed + num_new_tokens
        num_required = (end + num_lookahead_tokens + bs - 1) // bs
        num_hits = len(new_computed_blocks) if new_computed_blocks else 0
        num_new_blocks = num_required - len(blocks) - num_hits
        if num_new_blocks < 0:
            num_new_blocks = 0
        # Blocks already in the table that this step writes into: copy them if shared.
        cow_indices = None
        first = num_computed // bs
        if first < len(blocks) and num_new_tokens > 0:
            last = min(len(blocks), (end + bs - 1) // bs)
            if last - first == 1:  # the usual case: a decode writes into one block
                if blocks[first].ref_cnt > 1:
                    cow_indices = [first]
            else:
                cow_indices = [i for i in range(first, last) if blocks[i].ref_cnt > 1] or None
        needed = num_new_blocks + (len(cow_indices) if cow_indices else 0)
        if num_hits:
            # Hit blocks that sit in the free queue are taken from it too: count them.
            needed += sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if needed > self.block_pool.free_block_queue.num_free_blocks:
            return None

        if num_hits:
            self.block_pool.touch(new_computed_blocks)
            blocks.extend(new_computed_blocks)
        self.req_to_blocks[rid] = blocks
        if cow_indices:
            self._copy_on_write(rid, blocks, cow_indices)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks) if num_new_blocks else []
        if new_blocks:
            blocks.extend(new_blocks)
        if self.enable_caching:
            num_cached = self.num_cached_blocks.get(rid, 0) + num_hits
            num_full = (end if end < request.num_tokens else request.num_tokens) // bs
            if num_full > num_cached:
                self._cache_full_blocks(request, blocks, num_cached, num_full)
                num_cached = num_full
            self.num_cached_blocks[rid] = num_cached
        return new_blocks

    def append_slot(self, request: Request) -> list[KVCacheBlock] | None:
        """Room for one more token: ``allocate_slots(request, 1)`` for a request already running.

        This is the plain decode step, which every running request takes every step, so it
        handles the three common cases with a few integer operations: the token lands inside the
        last block (nothing to do), fills it (publish it to the prefix cache), or starts a new
        one (take one free block). Anything rarer (a shared block to copy, blocks already
        allocated ahead) goes through ``allocate_slots``. It also sets the request's
        ``kv_in_place_until``, so that the scheduler can skip even this call until the block fills.
        """
        pos = request.num_computed_tokens
        bs = self.block_size
        blocks = self.req_to_blocks.get(request.request_id)
        index = pos // bs
        if blocks is None or bs == 1:
            return self.allocate_slots(request, 1)
        if pos != index * bs:  # inside the last block
            if blocks[index].ref_cnt != 1:
                return self.allocate_slots(request, 1)  # shared: copy on write
            if pos - index * bs == bs - 1:
                # This token fills the block: publish it, if it is a real token (not a draft).
                rid = request.request_id
                if self.enable_caching and pos < len(request.all_token_ids) \
                        and self.num_cached_blocks.get(rid, 0) == index:
                    self._cache_full_blocks(request, blocks, index, index + 1)
                    self.num_cached_blocks[rid] = index + 1
            else:
                request.kv_in_place_until = index * bs + bs - 1
            return NO_NEW_BLOCKS
        if index != len(blocks):
            return self.allocate_slots(request, 1)
        block = self.block_pool.get_new_block()
        if block is None:
            return None
        blocks.append(block)
        request.kv_in_place_until = pos + bs - 1
        return [block]

    def _copy_on_write(self, rid: str, blocks: list[KVCacheBlock], indices: list[int]) -> None:
        fresh = self.block_pool.get_new_blocks(len(indices))
        for i, new in zip(indices, fresh):
            old = blocks[i]
            self._block_copies.append((old.block_id, new.block_id))
            blocks[i] = new
            self.block_pool.free_blocks([old])  # drops our reference; the others keep it
        self._replaced_tables.add(rid)

    def _cache_full_blocks(self, request: Request, blocks: list[KVCacheBlock],
                           start: int, stop: int) -> None:
        """Publish blocks [start, stop) as soon as they are allocated, so that identical prompts
        scheduled in the same step share them (the runner writes a layer's new K/V before that
        layer reads the cache). Their tokens are known even if their KV is computed this step."""
        self.update_block_hashes(request)
        hashes = request.block_hashes
        for i in range(start, stop):
            self.block_pool.cache_block(blocks[i], hashes[i])

    def take_block_copies(self) -> tuple[list[tuple[int, int]], set[str]]:
        """The (src, dst) copies made since the last call, and the requests whose tables changed."""
        copies, replaced = self._block_copies, self._replaced_tables
        self._block_copies, self._replaced_tables = [], set()
        return copies, replaced

    # -- sharing -----------------------------------------------------------------------------
    def fork(self, parent: Request, child: Request) -> None:
        """Share every block of ``parent`` with ``child`` (the partial last one included)."""
        blocks = self.req_to_blocks.get(parent.request_id, [])
        self.block_pool.touch(blocks)
        parent.kv_in_place_until = child.kv_in_place_until = 0  # the last block is shared now
        self.req_to_blocks[child.request_id] = list(blocks)
        self.num_cached_blocks[child.request_id] = self.num_cached_blocks.get(parent.request_id, 0)
        child.block_hashes = list(parent.block_hashes)

    def share_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """A new reference to every block of a request (for a beam taking over its sequence),
        with the number of leading blocks already published."""
        request_id = request.request_id
        request.kv_in_place_until = 0  # its last block is shared now
        blocks = list(self.req_to_blocks.get(request_id, ()))
        self.block_pool.touch(blocks)
        return blocks, self.num_cached_blocks.get(request_id, 0)

    def set_blocks(self, request: Request, blocks: list[KVCacheBlock], num_cached_blocks: int) -> None:
        """Install blocks obtained from ``share_blocks`` as the table of a request that has none."""
        if self.req_to_blocks.get(request.request_id):
            raise ValueError(f"{request.request_id} still holds blocks")
        self.req_to_blocks[request.request_id] = blocks
        self.num_cached_blocks[request.request_id] = num_cached_blocks
        request.kv_in_place_until = 0

    # -- release -----------------------------------------------------------------------------
    def free(self, request: Request, num_valid_tokens: int | None = None) -> None:
        """Give back every block of the request, last block first (so its tail is evicted first).

        ``num_valid_tokens``: blocks past this many tokens were published but their KV will never
        be computed (a victim preempted in the step that scheduled it); unpublish those.
        """
        rid = request.request_id
        request.kv_in_place_until = 0
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

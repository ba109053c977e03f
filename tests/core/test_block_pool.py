"""BlockPool: free queue order, ref counts, lazy eviction, prefix-cache index, integrity checks."""
from __future__ import annotations

import time

import pytest

from pagedllm.core.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def test_initial_state():
    pool = BlockPool(10, 4)
    assert pool.free_block_queue.block_ids() == list(range(10))
    assert pool.get_num_free_blocks() == 10
    assert pool.get_usage() == 0.0
    assert pool.cached_block_hash_to_block == {}
    pool.check_integrity()


def test_bad_sizes_rejected():
    with pytest.raises(ValueError):
        BlockPool(0, 4)
    with pytest.raises(ValueError):
        BlockPool(4, 0)


def test_free_queue_popleft_append_and_middle_removal():
    blocks = [KVCacheBlock(i) for i in range(6)]
    q = FreeKVCacheBlockQueue(blocks)
    assert q.block_ids() == [0, 1, 2, 3, 4, 5]
    q.remove(blocks[3])  # middle
    assert q.block_ids() == [0, 1, 2, 4, 5]
    assert q.num_free_blocks == 5
    assert blocks[3].prev_free is None and blocks[3].next_free is None
    q.remove(blocks[0])  # head
    q.remove(blocks[5])  # tail
    assert q.block_ids() == [1, 2, 4]
    assert q.popleft() is blocks[1]
    q.append(blocks[3])
    q.append(blocks[0])
    assert q.block_ids() == [2, 4, 3, 0]
    assert q.num_free_blocks == 4
    with pytest.raises(ValueError):
        q.remove(blocks[1])  # not in the queue
    for _ in range(4):
        q.popleft()
    with pytest.raises(IndexError):
        q.popleft()
    assert q.num_free_blocks == 0 and q.block_ids() == []


def test_free_queue_middle_removal_is_constant_time():
    # Removing the middle half of a large queue must not walk the list (a deque would be O(n)).
    n = 200_000
    blocks = [KVCacheBlock(i) for i in range(n)]
    q = FreeKVCacheBlockQueue(blocks)
    start = time.perf_counter()
    for b in blocks[n // 4: 3 * n // 4]:
        q.remove(b)
    elapsed = time.perf_counter() - start
    assert q.num_free_blocks == n // 2
    assert elapsed < 2.0  # O(n^2) would take minutes
    assert q.block_ids()[n // 4 - 1: n // 4 + 1] == [n // 4 - 1, 3 * n // 4]


def test_get_new_blocks_takes_from_head():
    pool = BlockPool(10, 4)
    got = pool.get_new_blocks(3)
    assert ids(got) == [0, 1, 2]
    assert [b.ref_cnt for b in got] == [1, 1, 1]
    assert pool.free_block_queue.block_ids() == [3, 4, 5, 6, 7, 8, 9]
    assert pool.get_usage() == pytest.approx(0.3)
    with pytest.raises(ValueError):
        pool.get_new_blocks(8)
    assert pool.get_num_free_blocks() == 7  # a failed request takes nothing
    pool.check_integrity()


def test_lru_order_request_blocks_freed_last_first():
    pool = BlockPool(10, 4)
    a = pool.get_new_blocks(3)  # 0 1 2
    b = pool.get_new_blocks(2)  # 3 4
    for block in a + b:  # cached: they join the tail, in LRU order
        pool.cache_block(block, ("h", block.block_id))
    pool.free_blocks(reversed(a))
    assert pool.free_block_queue.block_ids() == [5, 6, 7, 8, 9, 2, 1, 0]
    pool.free_blocks(reversed(b))
    assert pool.free_block_queue.block_ids() == [5, 6, 7, 8, 9, 2, 1, 0, 4, 3]
    # Reuse takes never-used blocks first, then a's tail before its head.
    assert ids(pool.get_new_blocks(7)) == [5, 6, 7, 8, 9, 2, 1]
    assert pool.free_block_queue.block_ids() == [0, 4, 3]
    pool.check_integrity()


def test_uncached_blocks_are_handed_out_first():
    """A freed block without a hash holds nothing reusable: it goes to the head, ahead of the
    cached blocks (which then live longer) and of the never-used ones (whose memory the OS has
    not committed yet), in the request's order."""
    pool = BlockPool(10, 4)
    a = pool.get_new_blocks(3)  # 0 1 2
    b = pool.get_new_blocks(2)  # 3 4
    pool.cache_block(b[0], "b0")
    pool.free_blocks(reversed(b))  # 4 has no hash, 3 has
    assert pool.free_block_queue.block_ids() == [4, 5, 6, 7, 8, 9, 3]
    pool.free_blocks(reversed(a))
    assert pool.free_block_queue.block_ids() == [0, 1, 2, 4, 5, 6, 7, 8, 9, 3]
    assert ids(pool.get_new_blocks(4)) == [0, 1, 2, 4]
    assert pool.get_cached_block("b0") is b[0]  # the cached block outlived them all
    pool.check_integrity()


def test_shared_block_joins_queue_only_at_zero():
    pool = BlockPool(4, 4)
    (blk,) = pool.get_new_blocks(1)
    pool.touch([blk])
    assert blk.ref_cnt == 2
    pool.free_blocks([blk])
    assert blk.ref_cnt == 1
    assert pool.free_block_queue.block_ids() == [1, 2, 3]
    pool.free_blocks([blk])
    assert pool.free_block_queue.block_ids() == [0, 1, 2, 3]  # no hash: handed out next
    with pytest.raises(AssertionError):
        pool.free_blocks([blk])  # double free


def test_lazy_eviction_keeps_hash_until_reuse():
    pool = BlockPool(4, 4)
    b0, b1 = pool.get_new_blocks(2)
    pool.cache_block(b0, 111)
    pool.cache_block(b1, 222)
    pool.free_blocks([b1, b0])
    assert pool.free_block_queue.block_ids() == [2, 3, 1, 0]
    # Freed but still cached: a lookup finds them.
    assert pool.get_cached_block(111) is b0
    assert pool.get_cached_block(222) is b1
    assert b0.block_hash == 111
    pool.check_integrity()
    # Handing out blocks 2 and 3 evicts nothing.
    pool.get_new_blocks(2)
    assert set(pool.cached_block_hash_to_block) == {111, 222}
    # Block 1 is next: handing it out evicts its hash (and only its hash).
    (got,) = pool.get_new_blocks(1)
    assert got is b1
    assert b1.block_hash is None
    assert pool.get_cached_block(222) is None
    assert pool.get_cached_block(111) is b0
    assert pool.free_block_queue.block_ids() == [0]
    pool.check_integrity()


def test_touch_free_cached_block_pulls_it_from_queue():
    pool = BlockPool(6, 4)
    blocks = pool.get_new_blocks(3)  # 0 1 2
    pool.cache_block(blocks[1], 7)
    pool.free_blocks(reversed(blocks))
    assert pool.free_block_queue.block_ids() == [0, 2, 3, 4, 5, 1]  # uncached ones first
    hit = pool.get_cached_block(7)
    assert hit is blocks[1]
    pool.touch([hit])
    assert hit.ref_cnt == 1
    assert pool.free_block_queue.block_ids() == [0, 2, 3, 4, 5]
    assert pool.get_num_free_blocks() == 5
    assert hit.block_hash == 7  # a hit keeps the block published
    # Touching a block in use just adds a reference.
    pool.touch([hit])
    assert hit.ref_cnt == 2
    assert pool.get_num_free_blocks() == 5
    pool.check_integrity()


def test_cache_block_first_publisher_stays_canonical():
    pool = BlockPool(4, 4)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, 5)
    pool.cache_block(b, 5)  # same content computed twice: b stays unpublished
    assert pool.get_cached_block(5) is a
    assert b.block_hash is None
    pool.cache_block(a, 6)  # already published: no-op
    assert a.block_hash == 5 and pool.get_cached_block(6) is None
    pool.uncache_block(a)
    assert a.block_hash is None and pool.get_cached_block(5) is None
    pool.check_integrity()


def test_caching_disabled_publishes_nothing():
    pool = BlockPool(4, 4, enable_caching=False)
    (a,) = pool.get_new_blocks(1)
    pool.cache_block(a, 5)
    assert a.block_hash is None
    assert pool.cached_block_hash_to_block == {}


def test_reset_prefix_cache_refused_while_in_use():
    pool = BlockPool(4, 4)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, 1)
    pool.cache_block(b, 2)
    pool.free_blocks([b])
    assert pool.reset_prefix_cache() is False
    assert set(pool.cached_block_hash_to_block) == {1, 2}
    assert a.block_hash == 1 and b.block_hash == 2
    pool.free_blocks([a])
    assert pool.reset_prefix_cache() is True
    assert pool.cached_block_hash_to_block == {}
    assert all(blk.block_hash is None for blk in pool.blocks)
    assert pool.free_block_queue.block_ids() == [2, 3, 1, 0]  # order untouched
    pool.check_integrity()


class TestCheckIntegrityCatchesCorruption:
    def _pool(self):
        pool = BlockPool(6, 4)
        used = pool.get_new_blocks(2)
        pool.cache_block(used[0], 99)
        pool.check_integrity()
        return pool, used

    def test_referenced_block_in_free_queue(self):
        pool, _ = self._pool()
        pool.blocks[4].ref_cnt = 1  # in the free queue yet referenced
        with pytest.raises(AssertionError):
            pool.check_integrity()

    def test_used_block_lost(self):
        pool, used = self._pool()
        used[1].ref_cnt = 0  # neither used nor in the free queue: leaked
        with pytest.raises(AssertionError):
            pool.check_integrity()

    def test_negative_ref_count(self):
        pool, used = self._pool()
        used[1].ref_cnt = -1
        with pytest.raises(AssertionError):
            pool.check_integrity()

    def test_free_count_out_of_sync(self):
        pool, _ = self._pool()
        pool.free_block_queue.num_free_blocks += 1
        with pytest.raises(AssertionError):
            pool.check_integrity()

    def test_hash_index_points_at_wrong_block(self):
        pool, used = self._pool()
        pool.cached_block_hash_to_block[99] = used[1]
        with pytest.raises(AssertionError):
            pool.check_integrity()

    def test_block_holds_unindexed_hash(self):
        pool, used = self._pool()
        used[1].block_hash = 1234
        with pytest.raises(AssertionError):
            pool.check_integrity()

"""KVCacheManager: chained hashes, prefix hits, all-or-nothing allocation, copy-on-write, free."""
from __future__ import annotations

from core_helpers import free_ids, make_request, make_runner, make_scheduler, step_with_stats

from pagedllm.core.block_hash import extend_block_hashes, hash_block_tokens
from pagedllm.core.kv_cache_manager import KVCacheManager

BS = 4


def kvm(num_blocks: int = 10, caching: bool = True) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, caching)


def one(blocks):
    """A one-group manager's per-group result as the group's list (None stays None)."""
    return blocks if blocks is None else (list(blocks[0]) if blocks else [])


def ids(mgr: KVCacheManager, rid: str) -> list[int]:
    return mgr.get_block_ids(rid)[0]


def computed(mgr: KVCacheManager, req):
    hits, num_hit = mgr.get_computed_blocks(req)
    return one(hits), num_hit


def admit(mgr: KVCacheManager, req, num_tokens: int | None = None):
    """Do what the scheduler does on admission; marks the scheduled tokens computed."""
    hits, num_hit = mgr.get_computed_blocks(req)
    n = req.num_tokens - num_hit if num_tokens is None else num_tokens
    new = mgr.allocate_slots(req, n, num_hit, hits)
    if new is not None:
        req.num_computed_tokens = num_hit + n
    return one(hits), num_hit, one(new)


def refs(mgr: KVCacheManager) -> list[int]:
    return [b.ref_cnt for b in mgr.block_pool.blocks]


def snapshot(mgr: KVCacheManager):
    pool = mgr.block_pool
    return (refs(mgr), pool.free_block_queue.block_ids(), dict(pool.cached_block_hash_to_block),
            [b.block_hash for b in pool.blocks],
            {r: [b.block_id for b in bl] for r, bl in mgr.req_to_blocks.items()},
            dict(mgr.managers[0].num_cached_blocks))


# -- hashes ------------------------------------------------------------------------------------
def test_hashes_chain_parent():
    tail = [4, 5, 6, 7]
    h_a = hash_block_tokens(hash_block_tokens(None, [0, 1, 2, 3]), tail)
    h_b = hash_block_tokens(hash_block_tokens(None, [9, 9, 9, 9]), tail)
    assert h_a != h_b
    assert hash_block_tokens(None, tail) != h_a
    assert hash_block_tokens(None, tail) == hash_block_tokens(None, tuple(tail))
    assert hash_block_tokens(None, tail, "salt") != hash_block_tokens(None, tail)
    assert hash_block_tokens(None, tail, "a") != hash_block_tokens(None, tail, "b")


def test_extend_block_hashes_only_full_blocks_and_incremental():
    tokens = list(range(10))
    hashes: list[int] = []
    extend_block_hashes(hashes, tokens, BS)
    assert len(hashes) == 2
    first = list(hashes)
    extend_block_hashes(hashes, tokens + [10, 11], BS)
    assert hashes[:2] == first and len(hashes) == 3
    assert hashes[2] == hash_block_tokens(hashes[1], [8, 9, 10, 11])


def test_same_block_after_different_prefix_is_no_hit():
    mgr = kvm()
    a = make_request("a", [0, 1, 2, 3, 4, 5, 6, 7, 8])
    admit(mgr, a)
    c = make_request("c", [50, 51, 52, 53, 4, 5, 6, 7, 8])  # block 1 equal, block 0 not
    hits, num_hit = computed(mgr, c)
    assert (hits, num_hit) == ([], 0)
    assert c.block_hashes[1] != a.block_hashes[1]


def test_cache_salt_separates_requests():
    mgr = kvm()
    prompt = list(range(9))
    a = make_request("a", prompt)
    admit(mgr, a)
    salted = make_request("s", prompt, cache_salt="tenant-1")
    assert computed(mgr, salted) == ([], 0)
    assert salted.block_hashes[0] != a.block_hashes[0]
    admit(mgr, salted)
    same_salt = make_request("t", prompt, cache_salt="tenant-1")
    hits, num_hit = computed(mgr, same_salt)
    assert [b.block_id for b in hits] == ids(mgr, "s")[:2] and num_hit == 8


# -- prefix hits -------------------------------------------------------------------------------
def test_shared_prefix_exact_block_ids():
    mgr = kvm()
    a = make_request("a", list(range(10)))
    _, num_hit, new = admit(mgr, a)
    assert num_hit == 0 and [b.block_id for b in new] == [0, 1, 2]
    # Full blocks published at allocation; the partial third is not.
    assert [b.block_hash is not None for b in mgr.block_pool.blocks[:3]] == [True, True, False]
    assert mgr.managers[0].num_cached_blocks["a"] == 2

    b = make_request("b", list(range(8)) + [100, 101, 102])
    hits, num_hit, new = admit(mgr, b)
    assert [h.block_id for h in hits] == [0, 1] and num_hit == 8
    assert [x.block_id for x in new] == [3]
    assert ids(mgr, "b") == [0, 1, 3]
    assert refs(mgr)[:4] == [2, 2, 1, 1]
    assert free_ids(mgr.block_pool) == [4, 5, 6, 7, 8, 9]
    mgr.check_integrity()


def test_full_prompt_hit_never_covers_last_token():
    mgr = kvm()
    a = make_request("a", list(range(8)))
    admit(mgr, a)
    assert mgr.managers[0].num_cached_blocks["a"] == 2  # both blocks published
    b = make_request("b", list(range(8)))
    hits, num_hit = computed(mgr, b)
    assert [h.block_id for h in hits] == [0] and num_hit == 4
    # 9 tokens: both full blocks may hit, token 8 is left to compute.
    c = make_request("c", list(range(8)) + [3])
    hits, num_hit = computed(mgr, c)
    assert [h.block_id for h in hits] == [0, 1] and num_hit == 8


def test_hit_on_freed_cached_blocks_counts_in_requirement():
    mgr = kvm()
    a = make_request("a", list(range(10)))
    admit(mgr, a)  # blocks 0 1 2
    mgr.free(a)
    # The partial block 2 (no hash) is handed out first; the cached ones, tail first, last.
    assert free_ids(mgr.block_pool) == [2, 3, 4, 5, 6, 7, 8, 9, 1, 0]
    filler = make_request("f", list(range(500, 528)))
    admit(mgr, filler)  # takes 7 blocks: 2..8
    assert ids(mgr, "f") == [2, 3, 4, 5, 6, 7, 8]
    assert free_ids(mgr.block_pool) == [9, 1, 0]

    # 16 tokens: hits blocks 0 and 1 (free but cached) and needs 2 new ones: 4 > 3 free.
    big = make_request("big", list(range(8)) + list(range(200, 208)))
    hits, num_hit = computed(mgr, big)
    assert [h.block_id for h in hits] == [0, 1]
    before = snapshot(mgr)
    assert mgr.allocate_slots(big, 16 - num_hit, num_hit, (hits,)) is None
    assert snapshot(mgr) == before
    assert "big" not in mgr.req_to_blocks

    # 12 tokens: 2 hits + 1 new = 3 free blocks: fits exactly; the new block is 9.
    ok = make_request("ok", list(range(8)) + [300, 301, 302, 303])
    hits, num_hit, new = admit(mgr, ok)
    assert num_hit == 8 and [b.block_id for b in new] == [9]
    assert ids(mgr, "ok") == [0, 1, 9]
    assert free_ids(mgr.block_pool) == []
    mgr.check_integrity()


def test_failed_allocation_of_running_request_changes_nothing():
    mgr = kvm(num_blocks=4)
    a = make_request("a", list(range(6)))
    admit(mgr, a)  # blocks 0 1
    b = make_request("b", list(range(100, 106)))
    admit(mgr, b)  # blocks 2 3
    assert free_ids(mgr.block_pool) == []
    a.append_output_token_ids([7, 8, 9])  # 9 tokens: needs a third block
    before = snapshot(mgr)
    assert one(mgr.allocate_slots(a, 3)) is None
    assert snapshot(mgr) == before
    assert mgr.take_block_copies() == ([], set())
    mgr.check_integrity()


def test_blocks_published_at_allocation_before_compute():
    mgr = kvm()
    a = make_request("a", list(range(12)))
    hits, num_hit = computed(mgr, a)
    mgr.allocate_slots(a, 12, num_hit, (hits,))  # not computed yet
    b = make_request("b", list(range(12)) + [1])
    hits, num_hit = computed(mgr, b)
    assert [h.block_id for h in hits] == [0, 1, 2] and num_hit == 12


def test_chunked_allocation_publishes_only_full_blocks():
    mgr = kvm()
    a = make_request("a", list(range(12)))
    _, _, new = admit(mgr, a, num_tokens=5)  # tokens 0..4
    assert [b.block_id for b in new] == [0, 1]
    assert mgr.managers[0].num_cached_blocks["a"] == 1
    assert mgr.block_pool.blocks[1].block_hash is None
    new = one(mgr.allocate_slots(a, 7))  # tokens 5..11
    a.num_computed_tokens = 12
    assert [b.block_id for b in new] == [2]
    assert mgr.managers[0].num_cached_blocks["a"] == 3
    assert all(mgr.block_pool.blocks[i].block_hash == a.block_hashes[i] for i in range(3))
    mgr.check_integrity()


def test_prompt_logprobs_skip_the_cache():
    mgr = kvm()
    admit(mgr, make_request("a", list(range(12))))
    lp = make_request("lp", list(range(12)) + [5], prompt_logprobs=1)
    assert computed(mgr, lp) == ([], 0)
    plain = make_request("p", list(range(12)) + [5])
    assert computed(mgr, plain)[1] == 12


def test_caching_disabled_never_hits():
    mgr = kvm(caching=False)
    admit(mgr, make_request("a", list(range(12))))
    assert mgr.block_pool.cached_block_hash_to_block == {}
    assert computed(mgr, make_request("b", list(range(12)) + [1])) == ([], 0)


# -- copy-on-write -----------------------------------------------------------------------------
def _forked(num_blocks: int = 10):
    mgr = kvm(num_blocks)
    parent = make_request("p", [0, 1, 2, 3, 4, 5])
    admit(mgr, parent)  # blocks 0 (full, published) and 1 (partial: tokens 4 5)
    child = make_request("c", [0, 1, 2, 3, 4, 5])
    mgr.fork(parent, child)
    child.num_computed_tokens = parent.num_computed_tokens
    return mgr, parent, child


def test_fork_shares_every_block_including_partial():
    mgr, parent, child = _forked()
    assert ids(mgr, "p") == [0, 1]
    assert ids(mgr, "c") == [0, 1]
    assert refs(mgr)[:3] == [2, 2, 0]
    assert child.block_hashes == parent.block_hashes
    assert free_ids(mgr.block_pool) == [2, 3, 4, 5, 6, 7, 8, 9]
    mgr.check_integrity()


def test_first_write_into_shared_partial_block_copies_it():
    mgr, parent, child = _forked()
    child.append_output_token_ids(77)
    new = one(mgr.allocate_slots(child, 1))  # writes position 6 (block index 1, shared)
    assert new == []
    assert mgr.take_block_copies() == ([(1, 2)], {"c"})
    assert mgr.take_block_copies() == ([], set())  # reported once
    assert ids(mgr, "c") == [0, 2]
    assert ids(mgr, "p") == [0, 1]
    assert refs(mgr)[:3] == [2, 1, 1]
    assert free_ids(mgr.block_pool) == [3, 4, 5, 6, 7, 8, 9]
    child.num_computed_tokens = 7
    # The parent's block is now its own: it writes in place, no copy.
    parent.append_output_token_ids(88)
    assert one(mgr.allocate_slots(parent, 1)) == []
    parent.num_computed_tokens = 7
    assert mgr.take_block_copies() == ([], set())
    assert ids(mgr, "p") == [0, 1]
    mgr.check_integrity()


def test_copy_on_write_counted_in_requirement():
    mgr, parent, child = _forked(num_blocks=2)
    child.append_output_token_ids(77)
    before = snapshot(mgr)
    assert one(mgr.allocate_slots(child, 1)) is None  # the copy needs a free block
    assert snapshot(mgr) == before
    assert mgr.take_block_copies() == ([], set())


def test_free_parent_then_child():
    mgr, parent, child = _forked()
    child.append_output_token_ids(77)
    one(mgr.allocate_slots(child, 1))
    mgr.free(parent)
    assert refs(mgr)[:3] == [1, 0, 1]
    assert free_ids(mgr.block_pool) == [1, 3, 4, 5, 6, 7, 8, 9]  # partial: no hash, at the head
    mgr.free(child)
    assert free_ids(mgr.block_pool) == [2, 1, 3, 4, 5, 6, 7, 8, 9, 0]
    assert refs(mgr) == [0] * 10
    mgr.check_integrity()


def test_free_child_then_parent():
    mgr, parent, child = _forked()
    child.append_output_token_ids(77)
    one(mgr.allocate_slots(child, 1))
    mgr.free(child)
    assert free_ids(mgr.block_pool) == [2, 3, 4, 5, 6, 7, 8, 9]
    mgr.free(parent)
    assert free_ids(mgr.block_pool) == [1, 2, 3, 4, 5, 6, 7, 8, 9, 0]
    assert refs(mgr) == [0] * 10
    mgr.check_integrity()


def test_free_forked_pair_without_writes():
    for first, second in (("p", "c"), ("c", "p")):
        mgr, parent, child = _forked()
        reqs = {"p": parent, "c": child}
        mgr.free(reqs[first])
        assert refs(mgr)[:2] == [1, 1]
        mgr.free(reqs[second])
        assert refs(mgr) == [0] * 10
        assert free_ids(mgr.block_pool) == [1, 2, 3, 4, 5, 6, 7, 8, 9, 0]
        mgr.check_integrity()


def test_child_write_filling_shared_block_publishes_its_own_hash():
    mgr, parent, child = _forked()
    child.append_output_token_ids([70, 71])
    one(mgr.allocate_slots(child, 2))  # positions 6, 7: copy of block 1 becomes full
    child.num_computed_tokens = 8
    assert mgr.take_block_copies()[0] == [(1, 2)]
    assert mgr.block_pool.blocks[2].block_hash == child.block_hashes[1]
    assert mgr.block_pool.blocks[1].block_hash is None  # the parent's partial block
    assert len(parent.block_hashes) == 1
    mgr.check_integrity()


# -- free ----------------------------------------------------------------------------------------
def test_free_unpublishes_blocks_past_valid_tokens():
    mgr = kvm()
    a = make_request("a", list(range(12)))
    admit(mgr, a)  # blocks 0 1 2, all published
    assert len(mgr.block_pool.cached_block_hash_to_block) == 3
    mgr.free(a, num_valid_tokens=5)
    pool = mgr.block_pool
    assert pool.cached_block_hash_to_block == {a.block_hashes[0]: pool.blocks[0]}
    assert [b.block_hash for b in mgr.block_pool.blocks[:3]] == [a.block_hashes[0], None, None]
    assert free_ids(mgr.block_pool) == [1, 2, 3, 4, 5, 6, 7, 8, 9, 0]  # unpublished: first
    mgr.check_integrity()


def test_free_keeps_published_blocks_shared_with_others():
    mgr = kvm()
    a = make_request("a", list(range(12)))
    admit(mgr, a)
    b = make_request("b", list(range(12)) + [9])
    admit(mgr, b)  # shares 0 1 2
    mgr.free(b, num_valid_tokens=0)
    # a still holds 0 1 2 (their KV is a's): they stay published.
    assert set(mgr.block_pool.cached_block_hash_to_block) == set(a.block_hashes)
    mgr.check_integrity()


def test_free_unknown_request_is_noop():
    mgr = kvm()
    mgr.free(make_request("x", [1, 2, 3]))
    assert free_ids(mgr.block_pool) == list(range(10))


def test_reset_prefix_cache_through_manager():
    mgr = kvm()
    a = make_request("a", list(range(8)))
    admit(mgr, a)
    assert mgr.reset_prefix_cache() is False
    mgr.free(a)
    assert mgr.reset_prefix_cache() is True
    assert computed(mgr, make_request("b", list(range(9)))) == ([], 0)


def test_check_integrity_catches_table_ref_mismatch():
    mgr = kvm()
    a = make_request("a", list(range(8)))
    admit(mgr, a)
    mgr.check_integrity()
    mgr.block_pool.blocks[0].ref_cnt += 1
    try:
        mgr.check_integrity()
    except AssertionError:
        pass
    else:
        raise AssertionError("check_integrity missed a ref count no table accounts for")


# -- via the scheduler ---------------------------------------------------------------------------
def test_identical_prompts_in_one_step_share_blocks():
    sched = make_scheduler(num_blocks=10)
    runner = make_runner(sched)
    prompt = list(range(10))
    sched.add_request(make_request("a", prompt, 2))
    sched.add_request(make_request("b", prompt, 2))
    so, outs = step_with_stats(sched, runner)
    assert so.num_scheduled_tokens == {"a": 10, "b": 2}
    kv = sched.kv_cache_manager
    assert ids(kv, "a") == [0, 1, 2]
    assert ids(kv, "b") == [0, 1, 3]
    assert [r.num_computed_tokens for r in so.scheduled_new_reqs] == [0, 8]
    stats = outs.scheduler_stats
    assert stats.prefix_cache_queries == 20 and stats.prefix_cache_hits == 8


def test_prefix_cache_stats_in_tokens():
    sched = make_scheduler(num_blocks=10)
    runner = make_runner(sched)
    sched.add_request(make_request("a", list(range(10)), 1))
    _, outs = step_with_stats(sched, runner)
    stats = outs.scheduler_stats
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (10, 0)
    sched.add_request(make_request("b", list(range(8)) + [40, 41, 42], 1))
    so, outs = step_with_stats(sched, runner)
    assert so.num_scheduled_tokens == {"b": 3}
    stats = outs.scheduler_stats  # per step: this step's lookups only
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (11, 8)
    req_b = so.scheduled_new_reqs[0]
    # a's partial block 2 (no hash) was handed out first
    assert req_b.num_computed_tokens == 8 and req_b.block_ids == [[0, 1, 2]]


# -- the decode step: decided from the last block in O(1) ----------------------------------------
def decode(mgr: KVCacheManager, req, token: int):
    """One decode step as the scheduler does it: room for the last token, then a new token."""
    new = one(mgr.allocate_slots(req, 1))
    if new is not None:
        req.num_computed_tokens += 1
        req.append_output_token_ids(token)
    return new


def test_decode_in_place_fill_and_new_block():
    mgr = kvm()
    req = make_request("a", [1, 2, 3, 4, 5])  # one full block + 1 token
    admit(mgr, req, 5)
    req.append_output_token_ids(6)
    assert ids(mgr, "a") == [0, 1]
    assert decode(mgr, req, 7) == []  # token 6 at position 5: inside block 1
    hashes_before = len(req.block_hashes)
    assert decode(mgr, req, 8) == []  # token 7 at position 6
    assert decode(mgr, req, 9) == []  # token 8 at position 7 fills block 1: published now
    assert len(req.block_hashes) == hashes_before + 1
    assert mgr.block_pool.get_cached_block(req.block_hashes[1]).block_id == 1
    assert req.block_hashes[1] == hash_block_tokens(req.block_hashes[0], [5, 6, 7, 8])
    assert mgr.managers[0].num_cached_blocks["a"] == 2
    new = decode(mgr, req, 10)  # token 9 at position 8 needs block 2, from the free queue's head
    assert [b.block_id for b in new] == [2] and ids(mgr, "a") == [0, 1, 2]
    # The general path agrees: a second request with the same tokens hits both full blocks.
    twin = make_request("b", req.all_token_ids[:9])
    assert computed(mgr, twin)[1] == 8


def test_decode_returns_none_when_no_block_is_free():
    mgr = kvm(num_blocks=2)
    req = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8])
    admit(mgr, req, 8)
    req.append_output_token_ids(9)
    before = snapshot(mgr)
    assert one(mgr.allocate_slots(req, 1)) is None
    assert snapshot(mgr) == before


def test_decode_copies_a_shared_last_block():
    mgr = kvm()
    parent = make_request("p", [1, 2, 3, 4, 5])
    admit(mgr, parent, 5)
    parent.append_output_token_ids(6)
    decode(mgr, parent, 7)  # in place: the decode path would skip all bookkeeping ...
    child = make_request("c", [1, 2, 3, 4, 5], output_token_ids=[6, 7, 99])
    assert mgr.fork(parent, child) == parent.num_computed_tokens == 6
    child.num_computed_tokens = 6
    new = one(mgr.allocate_slots(parent, 1))  # ... but the last block is shared now: copied first
    assert new == [] and mgr.take_block_copies()[0] == [(1, 2)]
    assert ids(mgr, "p") == [0, 2] and ids(mgr, "c") == [0, 1]
    mgr.free(parent)
    mgr.free(child)
    mgr.check_integrity()


def test_fork_of_a_parallel_sample_recomputes_only_the_last_prompt_token():
    mgr = kvm()
    leader = make_request("l", [1, 2, 3, 4, 5, 6])
    admit(mgr, leader, 6)
    leader.append_output_token_ids(50)  # its first token: the prompt is computed
    sample = make_request("s", [1, 2, 3, 4, 5, 6])
    assert mgr.fork(leader, sample) == 5  # every token but the last prompt token
    assert ids(mgr, "s") == [0, 1] and refs(mgr)[:2] == [2, 2]
    sample.num_computed_tokens = 5
    assert one(mgr.allocate_slots(sample, 1)) == []  # position 5 lands in the shared block: copied
    assert mgr.take_block_copies()[0] == [(1, 2)]
    assert ids(mgr, "s") == [0, 2]
    mgr.check_integrity()

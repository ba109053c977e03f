"""KV cache groups (issue 31, part 2): a full-attention group and sliding-window groups drawing on
one BlockPool. Exact block ids with block_size 4 and a window of 8: out-of-window blocks go back
to the pool and their slots hold the null block (-1), a window group's prefix hit needs only the
window before the hit point, the groups agree on one hit length, fork / copy-on-write and
preemption work per group, nothing leaks, and a long request holds about a window in its window
layers. The FakeRunner reads every position a window sees through that group's table."""
from __future__ import annotations

import pytest
from core_helpers import (
    assert_all_free,
    expected_tokens,
    make_request,
    make_runner,
    make_scheduler,
    run_to_completion,
    step,
)

from pagedllm.core.block_pool import NULL_BLOCK, NULL_BLOCK_ID
from pagedllm.core.kv_cache_manager import NO_NEW_BLOCKS, KVCacheManager, max_blocks_per_request
from pagedllm.errors import ValidationError
from pagedllm.runner.kv_cache_groups import KVCacheGroup, KVCacheTensor, group_layers, layer_placement, plan_kv_tensors
from pagedllm.utils import cdiv

BS = 4
W = 8
N = NULL_BLOCK_ID


def hybrid(num_blocks: int = 20, windows=(None, W), chunk: int = 8) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, True, windows, chunk)


def ids_of(blocks) -> list[list[int]]:
    return [[b.block_id for b in g] for g in blocks]


def run(mgr: KVCacheManager, req, n: int, hits=None, num_hit: int = 0):
    new = mgr.allocate_slots(req, n, num_hit, hits)
    assert new is not None
    req.num_computed_tokens += num_hit + n
    mgr.check_integrity()
    return new


def prefilled(mgr: KVCacheManager, rid: str, prompt: list[int], chunk: int = 8):
    req = make_request(rid, prompt)
    hits, num_hit = mgr.get_computed_blocks(req)
    run(mgr, req, min(chunk, req.num_tokens - num_hit), hits, num_hit)
    while req.num_computed_tokens < req.num_tokens:
        run(mgr, req, min(chunk, req.num_tokens - req.num_computed_tokens))
    return req


# -- groups from layers -------------------------------------------------------------------------
def test_group_layers_rule():
    # No window, or a window covering max_model_len: one group, tensor i for layer i.
    assert group_layers([None] * 3, 64) == [KVCacheGroup(None, (0, 1, 2))]
    assert group_layers([64, 64], 64) == [KVCacheGroup(None, (0, 1))]
    assert group_layers([8, 8], 64) == [KVCacheGroup(8, (0, 1))]
    # Gemma 2: alternating, two groups of equal size sharing two tensors.
    g2 = group_layers([8, None, 8, None], 64)
    assert g2 == [KVCacheGroup(None, (1, 3)), KVCacheGroup(8, (0, 2))]
    t2 = plan_kv_tensors(g2, [64] * 4)
    assert t2 == [KVCacheTensor(64, (1, 0)), KVCacheTensor(64, (3, 2))]
    assert layer_placement(g2, t2) == [(1, 0), (0, 0), (1, 1), (0, 1)]
    # Gemma 3: 5 local to 1 global: the local layers cut into groups of the global count.
    g3 = group_layers([8, 8, 8, 8, 8, None] * 2, 64)
    assert [g.sliding_window for g in g3] == [None] + [8] * 5
    assert len(plan_kv_tensors(g3, [64] * 12)) == 2 and g3[0].layer_indices == (5, 11)
    windows = [g.sliding_window for g in g3]
    assert max_blocks_per_request(windows[1:2], 64, 8, BS) == cdiv(W - 2 + 8, BS) + 1 == 5
    assert max_blocks_per_request(windows, 64, 8, BS) == 64 // BS + 5 * 5


def test_kv_tensors_from_per_layer_sizes():
    """Layers that differ in KV bytes per token: one group gives every layer its own tensor;
    across groups a tensor is shared only by layers of the same size, one of each group."""
    one = group_layers([None] * 3, 64)
    tensors = plan_kv_tensors(one, [64, 32, 64])
    assert tensors == [KVCacheTensor(64, (0,)), KVCacheTensor(32, (1,)), KVCacheTensor(64, (2,))]
    assert layer_placement(one, tensors) == [(0, 0), (0, 1), (0, 2)]
    assert sum(t.page_size_bytes(BS) for t in tensors) == BS * (64 + 32 + 64)
    # full (0, 2) and window (1, 3): sizes 64/32 in each group pair up; a block id costs 96 / token
    g = group_layers([None, W, None, W], 64)
    tensors = plan_kv_tensors(g, [64, 64, 32, 32])
    assert tensors == [KVCacheTensor(64, (0, 1)), KVCacheTensor(32, (2, 3))]
    assert layer_placement(g, tensors) == [(0, 0), (1, 0), (0, 1), (1, 1)]
    # sizes that do not pair up cannot share: 64 and 32 in the full group, 32 and 32 in the window's
    tensors = plan_kv_tensors(g, [64, 32, 32, 32])
    assert tensors == [KVCacheTensor(64, (0,)), KVCacheTensor(32, (2, 1)), KVCacheTensor(32, (3,))]
    assert layer_placement(g, tensors) == [(0, 0), (1, 1), (0, 1), (1, 2)]


# -- freeing and null slots ---------------------------------------------------------------------
def test_out_of_window_blocks_are_freed_and_slots_hold_the_null_block():
    mgr = hybrid()
    req = make_request("a", list(range(24)))
    assert ids_of(run(mgr, req, 8)) == [[0, 1], [2, 3]]
    assert ids_of(run(mgr, req, 8)) == [[4, 5], [6, 7]]  # start 8 reads from position 1
    # Start 16 reads keys from position 9 (block 2): window blocks 0 and 1 go back, last
    # first, to the free queue's tail; the new blocks come from its head.
    assert ids_of(run(mgr, req, 8)) == [[8, 9], [10, 11]]
    assert mgr.get_block_ids("a") == [[0, 1, 4, 5, 8, 9], [N, N, 6, 7, 10, 11]]
    assert mgr.get_blocks("a")[1][0] is NULL_BLOCK
    assert mgr.block_pool.free_block_queue.block_ids()[-2:] == [3, 2]
    assert [mgr.block_pool.blocks[i].ref_cnt for i in (2, 3)] == [0, 0]
    # Decoding frees one more window block every 4 tokens, in the O(1) path.
    req.append_output_token_ids(24)
    assert ids_of(run(mgr, req, 1)) == [[12], [13]]  # start 24 reads from 17: from block 4
    assert mgr.get_block_ids("a")[1] == [N, N, N, N, 10, 11, 13]
    assert [mgr.block_pool.blocks[i].ref_cnt for i in (6, 7)] == [0, 0]
    req.append_output_token_ids(25)
    assert mgr.allocate_slots(req, 1) is NO_NEW_BLOCKS  # the O(1) path frees nothing new here
    req.num_computed_tokens += 1
    mgr.check_integrity()
    mgr.free(req)
    mgr.check_integrity()
    assert mgr.block_pool.get_num_free_blocks() == 20 and mgr.usage == 0.0


def test_a_window_of_one_block_keeps_the_last_blocks_only():
    mgr = hybrid(windows=(W,))  # Mistral: every layer windowed, one group
    prefilled(mgr, "a", list(range(40)))
    table = mgr.get_block_ids("a")[0]
    assert table[:6] == [N] * 6 and N not in table[6:]  # the last step started at 32: reads 25..
    assert mgr.block_pool.get_num_free_blocks() == 20 - 4


# -- prefix hits --------------------------------------------------------------------------------
def test_window_prefix_hit_needs_only_the_last_window():
    mgr = hybrid()
    a = prefilled(mgr, "a", list(range(24)))
    assert mgr.get_block_ids("a") == [[0, 1, 4, 5, 8, 9], [N, N, 6, 7, 10, 11]]
    mgr.free(a)
    b = make_request("b", list(range(24)) + [99])
    hits, num_hit = mgr.get_computed_blocks(b)
    # Full attention hits all six blocks; the window group only its last cdiv(7, 4) = 2 before
    # the hit point, even though blocks 2 and 3 (freed early) are still cached too.
    assert num_hit == 24 and ids_of(hits) == [[0, 1, 4, 5, 8, 9], [N, N, N, N, 10, 11]]
    run(mgr, b, 1, hits, num_hit)
    assert mgr.get_block_ids("b")[1] == [N, N, N, N, 10, 11, 13]
    mgr.free(b)
    mgr.check_integrity()


def test_groups_agree_on_the_hit_length():
    mgr = hybrid()
    a = prefilled(mgr, "a", list(range(24)))
    mgr.free(a)
    # The window group lost block 4's copy (id 10): its rightmost covered hit point is block 4
    # (blocks 2, 3 = ids 6, 7), and full attention is cut back to the same 16 tokens.
    mgr.block_pool.uncache_block(mgr.block_pool.blocks[10])
    b = make_request("b", list(range(24)) + [99])
    hits, num_hit = mgr.get_computed_blocks(b)
    assert num_hit == 16 and ids_of(hits) == [[0, 1, 4, 5], [N, N, 6, 7]]
    run(mgr, b, 9, hits, num_hit)  # reads keys 9..15 from the hit, writes 16..24
    assert mgr.get_block_ids("b")[1][:4] == [N, N, 6, 7]
    # A full-attention group that lost a block bounds the window group the same way.
    mgr.free(b)
    mgr.block_pool.uncache_block(mgr.block_pool.blocks[4])  # full group's block 2
    c = make_request("c", list(range(24)) + [98])
    hits, num_hit = mgr.get_computed_blocks(c)
    assert num_hit == 8 and ids_of(hits) == [[0, 1], [2, 3]]
    mgr.check_integrity()


def test_identical_prompts_share_window_blocks_in_one_step():
    sched = make_scheduler(num_blocks=20, sliding_windows=(None, W), max_num_batched_tokens=64)
    runner = make_runner(sched)
    reqs = [make_request(r, list(range(20)), 6) for r in "ab"]
    for r in reqs:
        sched.add_request(r)
    so, _ = step(sched, runner)
    # b hits a's blocks in both groups as soon as a published them (its last window only).
    new_a, new_b = so.scheduled_new_reqs
    assert new_a.block_ids == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    assert new_b.num_computed_tokens == 16
    assert new_b.block_ids == [[0, 1, 2, 3, 10], [N, N, 7, 8, 11]]
    run_to_completion(sched, runner)
    for r in reqs:
        assert r.output_token_ids == expected_tokens(r)
    assert_all_free(sched)


# -- sharing ------------------------------------------------------------------------------------
def test_fork_shares_window_blocks_and_copies_on_write_per_group():
    mgr = hybrid()
    parent = prefilled(mgr, "p", list(range(10)))
    parent.append_output_token_ids(50)
    child = make_request("c", list(range(10)))
    assert mgr.fork(parent, child) == 9
    assert mgr.get_block_ids("c") == mgr.get_block_ids("p") == [[0, 1, 4], [2, 3, 5]]
    child.num_computed_tokens = 9
    assert mgr.allocate_slots(child, 1) is NO_NEW_BLOCKS  # position 9: the shared last blocks
    copies, replaced = mgr.take_block_copies()
    assert copies == [(4, 6), (5, 7)] and replaced == {"c"}
    assert mgr.get_block_ids("c") == [[0, 1, 6], [2, 3, 7]]
    mgr.check_integrity()
    for r in (parent, child):
        mgr.free(r)
    assert mgr.block_pool.get_num_free_blocks() == 20
    mgr.check_integrity()


def test_fork_from_a_parent_past_the_window_shares_nothing():
    mgr = hybrid()
    parent = prefilled(mgr, "p", list(range(10)))
    for t in range(20):  # decode 20 tokens: the window group frees blocks 0..3
        parent.append_output_token_ids(100 + t)
        run(mgr, parent, 1)
    assert mgr.get_block_ids("p")[1][:3] == [N, N, N]
    child = make_request("c", list(range(10)))  # a sample: recomputes from position 9
    assert mgr.fork(parent, child) == 0
    assert mgr.get_block_ids("c") == [[], []]
    mgr.check_integrity()


# -- scheduler: preemption, admission, integrity ------------------------------------------------
@pytest.mark.parametrize("windows", [(W,), (None, W), (None, 5, W)])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_preemption_and_chunking_with_windows(windows, async_scheduling):
    sched = make_scheduler(num_blocks=8 * len(windows), sliding_windows=windows,
                           max_num_batched_tokens=6, max_model_len=64, max_num_seqs=4,
                           async_scheduling=async_scheduling)
    runner = make_runner(sched)
    reqs = [make_request(f"r{i}", [i + 1] * 3 + list(range(10 + i)), 16, ignore_eos=True)
            for i in range(4)]
    for r in reqs:
        sched.add_request(r)
    num_preempted, in_flight = 0, None
    while sched.has_unfinished_requests() or in_flight:
        so = sched.schedule()
        ro = runner.execute_model(so)
        if async_scheduling:  # step N's output lands after step N+1 is scheduled
            (so, ro), in_flight = (in_flight or (None, None)), (so, ro) if not so.is_empty else None
            if so is None:
                continue
        num_preempted += sched.update_from_output(so, ro).scheduler_stats.num_preempted_reqs
        sched.check_integrity()
    assert num_preempted > 0
    for r in reqs:
        assert r.output_token_ids == expected_tokens(r)
    assert_all_free(sched)


def test_admission_counts_each_group():
    # 60 tokens: 15 blocks in a full group, but a window group holds at most
    # cdiv(8 - 2 + 8, 4) + 1 = 5: a window-only model fits a cache of 5 blocks.
    sched = make_scheduler(num_blocks=5, sliding_windows=(W,), max_num_batched_tokens=8,
                           max_model_len=64)
    runner = make_runner(sched)
    req = make_request("long", list(range(40)), 20, ignore_eos=True)
    sched.add_request(req)
    run_to_completion(sched, runner)
    assert req.output_token_ids == expected_tokens(req)
    assert_all_free(sched)
    # A hybrid model needs the full group's blocks too: rejected up front, saying why.
    sched = make_scheduler(num_blocks=16, sliding_windows=(None, W), max_num_batched_tokens=8,
                           max_model_len=64)
    with pytest.raises(ValidationError, match="needs 20 KV blocks"):
        sched.add_request(make_request("long", list(range(40)), 20))
    # max_tokens=None resolves to what the cache holds with both groups.
    unset = make_request("unset", list(range(10)), None)
    sched.add_request(unset)
    assert sched.kv_cache_manager.num_blocks_needed(10 + unset.max_tokens - 1) <= 16
    assert sched.kv_cache_manager.num_blocks_needed(10 + unset.max_tokens) > 16


# -- memory -------------------------------------------------------------------------------------
@pytest.mark.parametrize("chunk", [3, 8])
def test_long_request_holds_about_a_window_in_its_window_layers(chunk):
    """A request of 8x the window holds at most window + chunk + one block (rounded up to
    blocks) in its window group, and the pool's bytes in use say the same."""
    windows = (None, W)
    sched = make_scheduler(num_blocks=40, sliding_windows=windows, max_num_batched_tokens=chunk,
                           max_model_len=128)
    runner = make_runner(sched)
    kv = sched.kv_cache_manager
    bytes_per_block = 2 * 2 * BS * 2 * 16 * 4  # K+V, 2 tensors, 2 KV heads, head_dim 16, fp32
    req = make_request("long", list(range(8 * W)), 8, ignore_eos=True)
    sched.add_request(req)
    limit = cdiv(W + chunk, BS) + 1
    most = 0
    while sched.has_unfinished_requests():
        step(sched, runner)
        if "long" not in sched.requests:
            break
        full, window = kv.get_block_ids("long")
        held = [b for b in window if b != N]
        assert len(held) <= limit, (req.num_computed_tokens, window)
        assert len(full) == cdiv(req.num_computed_tokens, BS)  # full attention keeps everything
        used = kv.num_blocks - kv.block_pool.get_num_free_blocks()
        assert used * bytes_per_block == (len(full) + len(held)) * bytes_per_block
        most = max(most, len(held))
    assert most * BS <= W + chunk + BS + BS - 1 and most >= cdiv(W, BS)
    assert_all_free(sched)

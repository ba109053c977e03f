"""Random workloads against the scheduler + KV cache manager, checked by the FakeRunner.

Arrivals (shared prefixes, salts, priorities, min_tokens, stop ids, n > 1 groups that fork through
ParallelSampling, as the engine runs them), aborts of whole groups in every state (leader
waiting with its samples not forked yet, forked, preempted, between the runner and
update_from_output) and steps, under both policies, with and without n-gram speculative
decoding, with one full-attention KV cache group, a sliding window only, or hybrids of full and
window groups, with a cache small enough to force preemption. FakeRunner(verify_kv=True) reads every
context back through its block table, so a wrong block id, a bad prefix hit or a stale published
block raises KVMismatchError. After every step every request the scheduler holds is in exactly
one queue; at the end every request that was not aborted produced exactly what it produces
alone, and every block is free.
"""
from __future__ import annotations

import random

from core_helpers import make_request, make_scheduler
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedllm.core.ngram_proposer import NgramProposer
from pagedllm.core.request import RequestStatus
from pagedllm.engine.parallel_sampling import ParallelSampling
from pagedllm.errors import ValidationError
from pagedllm.runner.fake import FakeRunner, fake_generate

VOCAB = 48  # small, so EOS and stop token ids do come up
EOS = frozenset({5})
BS = 4
NUM_BLOCKS = 12  # 48 tokens: a few long requests force preemption
MAX_MODEL_LEN = 32  # every admissible request fits the whole cache (8 blocks at most)
_rng = random.Random(1234)
BASES = [[_rng.randrange(VOCAB) for _ in range(12)] for _ in range(3)]


@st.composite
def request_spec(draw):
    """(prompt, max_tokens, min_tokens, priority, cache_salt, stop_token_ids, ignore_eos, n)."""
    base = BASES[draw(st.integers(0, len(BASES) - 1))]
    prefix_len = draw(st.sampled_from([0, 3, 4, 8, 9, 12, 12]))
    suffix = draw(st.lists(st.integers(0, VOCAB - 1), max_size=8))
    prompt = (base[:prefix_len] + suffix) or [1]
    max_tokens = draw(st.integers(1, MAX_MODEL_LEN - len(prompt)))
    min_tokens = draw(st.integers(0, min(3, max_tokens)))
    priority = draw(st.integers(0, 2))
    salt = draw(st.sampled_from([None, None, None, "s"]))
    stop_ids = draw(st.sets(st.integers(0, VOCAB - 1), max_size=2))
    ignore_eos = draw(st.booleans())
    n = draw(st.sampled_from([1, 1, 1, 2, 3]))  # parallel samples: children fork from the first
    return prompt, max_tokens, min_tokens, priority, salt, stop_ids, ignore_eos, n


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        policy=st.sampled_from(["fcfs", "priority"]),
        budget=st.sampled_from([3, 8, 32]),
        threshold=st.sampled_from([0, 3, 8]),
        max_num_seqs=st.integers(1, 4),
        max_skip_ahead=st.sampled_from([0, 1, 16]),
        caching=st.sampled_from([True, True, False]),
        spec_k=st.sampled_from([0, 0, 2]),
        async_scheduling=st.booleans(),
        # KV cache groups: full attention, a window only (Mistral), hybrids (Gemma 2, two windows).
        windows=st.sampled_from([(None,), (None,), (6,), (None, 6), (None, 3, 9)]),
    )
    def setup(self, policy, budget, threshold, max_num_seqs, max_skip_ahead, caching, spec_k,
              async_scheduling, windows):
        # Every group may need all 8 blocks of the longest request: a cache as tight per group.
        self.num_blocks = NUM_BLOCKS * len(windows)
        self.sched = make_scheduler(
            num_blocks=self.num_blocks, block_size=BS, max_model_len=MAX_MODEL_LEN,
            enable_caching=caching, scheduling_policy=policy, max_num_batched_tokens=budget,
            long_prefill_token_threshold=threshold, max_num_seqs=max_num_seqs,
            max_skip_ahead=max_skip_ahead, async_scheduling=async_scheduling,
            sliding_windows=windows)
        # Async scheduling: step N+1 is scheduled and executed before step N's output is applied
        # (the delayed output), as the engine pipelines them; a step with drafts is scheduled
        # past as if all were accepted (drafts proposed from the tokens known, one step behind).
        self.in_flight = None
        # n-gram speculative decoding: drafts verified greedily by the FakeRunner.
        self.proposer = NgramProposer(spec_k, 1, 3) if spec_k else None
        self.parallel = ParallelSampling(self.sched)
        self.groups: dict[str, list[str]] = {}  # group id -> its request ids
        self.num_accepted = 0
        self.any_prefix_hit = False
        self.budget, self.max_num_seqs, self.threshold = budget, max_num_seqs, threshold
        self.runner = FakeRunner(vocab_size=VOCAB, verify_kv=True, sliding_windows=windows)
        self.runner.initialize_kv_cache(self.num_blocks, BS)
        self.reqs = {}
        self.outputs: dict[str, list[int]] = {}
        self.finish_reasons: dict[str, str] = {}
        self.aborted: set[str] = set()
        self.num_preempted = 0

    # -- rules -----------------------------------------------------------------------------------
    @rule(specs=st.lists(request_spec(), min_size=1, max_size=3))
    def add(self, specs):
        for prompt, max_tokens, min_tokens, priority, salt, stop_ids, ignore_eos, n in specs:
            base = f"r{len(self.reqs)}"
            group = [make_request(f"{base}_{i}" if n > 1 else base, prompt, max_tokens, eos=EOS,
                                  priority=priority, cache_salt=salt, min_tokens=min_tokens,
                                  stop_token_ids=sorted(stop_ids), ignore_eos=ignore_eos,
                                  arrival_time=float(len(self.reqs)))
                     for i in range(n)]
            # Admissible by construction: must not raise. Samples beyond the free sequence slots
            # wait and recompute when they fork.
            self.parallel.add(group[0], group[1:])
            self.groups[base] = [r.request_id for r in group]
            for req in group:
                self.reqs[req.request_id] = req
                self.outputs[req.request_id] = []

    @rule(extra=st.integers(0, 4), max_tokens=st.integers(1, 4))
    def add_too_long(self, extra, max_tokens):
        before = (dict(self.sched.requests), len(self.sched.waiting))
        req = make_request(f"bad{len(self.reqs)}", [1] * (MAX_MODEL_LEN - max_tokens + 1 + extra),
                           max_tokens)
        try:
            self.sched.add_request(req)
        except ValidationError:
            pass
        else:
            raise AssertionError("a request longer than max_model_len was admitted")
        assert (dict(self.sched.requests), len(self.sched.waiting)) == before

    @precondition(lambda self: any(r in self.sched.requests for r in self.reqs))
    @rule(data=st.data())
    def abort(self, data):
        live = sorted(r for r in self.reqs if r in self.sched.requests)
        rid = data.draw(st.sampled_from(live), "abort_id")
        assert self.sched.finish_requests(rid) == [self.reqs[rid]]
        assert self.sched.finish_requests(rid) == []
        self.aborted.add(rid)
        self.parallel.abort([rid])  # a leader takes the samples that have not forked with it
        self._mark_dropped()
        self.sched.check_integrity()

    @precondition(lambda self: any(not self.reqs[r].is_finished() for ids in self.groups.values()
                                   for r in ids))
    @rule(data=st.data())
    def abort_group(self, data):
        """The engine's abort of an n > 1 request, whatever state each sample is in."""
        live = sorted(g for g, ids in self.groups.items() if any(not self.reqs[r].is_finished() for r in ids))
        ids = self.groups[data.draw(st.sampled_from(live), "abort_group")]
        self._abort_group(ids)
        self.sched.check_integrity()

    def _abort_group(self, ids):
        self.parallel.abort(ids)
        for req in self.sched.finish_requests(ids):
            self.aborted.add(req.request_id)
        self._mark_dropped()

    def _mark_dropped(self):
        """Samples that were only waiting to fork end with their aborted group."""
        pending = {c.request_id for cs in self.parallel.pending.values() for c in cs}
        for rid, req in self.reqs.items():
            if not req.is_finished() and rid not in self.sched.requests and rid not in pending:
                req.status = RequestStatus.FINISHED_ABORTED
                self.aborted.add(rid)

    @rule(abort_mid_step=st.booleans(), data=st.data())
    def step(self, abort_mid_step, data):
        self._step(data if abort_mid_step else None)

    # -- helpers ---------------------------------------------------------------------------------
    def _step(self, data=None):
        sched = self.sched
        so = sched.schedule()
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
        assert so.total_num_scheduled_tokens <= self.budget
        assert len(so.num_scheduled_tokens) <= self.max_num_seqs
        if self.threshold:
            assert all(n <= self.threshold for n in so.num_scheduled_tokens.values())
        assert all(n > 0 for n in so.num_scheduled_tokens.values())
        assert not (so.preempted_req_ids & set(so.num_scheduled_tokens))
        self.num_preempted += len(so.preempted_req_ids)
        for rid in so.num_scheduled_tokens:
            assert sched.requests[rid].status == RequestStatus.RUNNING
        ro = self.runner.execute_model(so)  # raises KVMismatchError on a bad block table
        if self.sched.async_scheduling:
            (so, ro), self.in_flight = (self.in_flight or (None, None)), (so, ro)
            if so is None:
                return  # the first step: its output is applied after the next one is scheduled
        if data is not None and so.num_scheduled_tokens:
            rid = data.draw(st.sampled_from(sorted(so.num_scheduled_tokens)), "abort_mid_step")
            group = next(ids for ids in self.groups.values() if rid in ids)
            self._abort_group(group if data.draw(st.booleans(), "whole_group") else [rid])
        outs = sched.update_from_output(so, ro)
        self.parallel.step(outs)
        stats = outs.scheduler_stats
        self.num_accepted += stats.num_accepted_tokens
        self.any_prefix_hit |= stats.prefix_cache_hits > 0
        for o in outs:
            assert o.request_id not in self.finish_reasons, "output after finishing"
            self.outputs[o.request_id].extend(o.new_token_ids)
            if o.finish_reason is not None:
                self.finish_reasons[o.request_id] = o.finish_reason
            elif self.proposer is not None and o.new_token_ids:
                req = sched.requests[o.request_id]
                sched.set_draft_tokens(o.request_id, self.proposer.propose(req.all_token_ids))
        sched.check_integrity()
        # Nothing is lost: every request not finished is in the scheduler or waiting to fork.
        pending = {c.request_id for cs in self.parallel.pending.values() for c in cs}
        for rid, req in self.reqs.items():
            if not req.is_finished():
                assert (rid in sched.requests) != (rid in pending), rid

    @invariant()
    def integrity(self):
        if hasattr(self, "sched"):
            self.sched.check_integrity()

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        for _ in range(3000):
            if not self.sched.has_unfinished_requests():
                assert not self.parallel.pending, "samples left waiting to fork"
                if self.in_flight is not None:  # drain the step still in flight
                    so, ro = self.in_flight
                    self.in_flight = None
                    assert not self.sched.update_from_output(so, ro).req_ids
                break
            self._step()
        else:
            raise AssertionError(f"requests never finished: {list(self.sched.requests)}")
        event(f"preempted: {self.num_preempted > 0}")
        event(f"aborted: {bool(self.aborted)}")
        event(f"async scheduling: {self.sched.async_scheduling}")
        event(f"prefix hits: {self.any_prefix_hit}")
        event(f"forked: {any('_' in r for r in self.reqs)}")
        event(f"drafts accepted: {self.num_accepted > 0}")
        event(f"KV cache groups: {self.sched.kv_cache_manager.sliding_windows}")
        for rid, req in self.reqs.items():
            sp = req.sampling_params
            expected = fake_generate(req.prompt_token_ids, req.max_tokens, VOCAB, EOS,
                                     sp.ignore_eos, sp.min_tokens, sp.all_stop_token_ids)
            if rid in self.aborted:
                assert req.status == RequestStatus.FINISHED_ABORTED
                assert expected[:len(self.outputs[rid])] == self.outputs[rid]
                continue
            assert req.is_finished()
            assert self.outputs[rid] == expected == req.output_token_ids, rid
            want = "length" if len(expected) == req.max_tokens and not (
                len(expected) >= sp.min_tokens and (
                    (expected[-1] in EOS and not sp.ignore_eos)
                    or expected[-1] in sp.all_stop_token_ids)) else "stop"
            assert self.finish_reasons[rid] == want, rid
        kv = self.sched.kv_cache_manager
        kv.check_integrity()
        assert kv.block_pool.get_num_free_blocks() == self.num_blocks
        assert all(m.req_to_blocks == {} for m in kv.managers)
        assert self.sched.requests == {} and not self.sched.running and not self.sched.waiting


SchedulerMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestSchedulerStateful = SchedulerMachine.TestCase


def test_random_workload_preempts():
    """The stateful test's cache really is small enough to preempt (checked on a fixed load)."""
    sched = make_scheduler(num_blocks=NUM_BLOCKS, max_model_len=MAX_MODEL_LEN, max_num_seqs=4)
    runner = FakeRunner(vocab_size=VOCAB, verify_kv=True)
    runner.initialize_kv_cache(NUM_BLOCKS, BS)
    reqs = [make_request(f"p{i}", BASES[i % 3][:8], 20, eos=EOS, ignore_eos=True) for i in range(4)]
    for r in reqs:
        sched.add_request(r)
    num_preempted = 0
    while sched.has_unfinished_requests():
        so = sched.schedule()
        num_preempted += sched.update_from_output(so, runner.execute_model(so)).scheduler_stats.num_preempted_reqs
        sched.check_integrity()
    assert num_preempted > 0
    for r in reqs:
        assert r.output_token_ids == fake_generate(r.prompt_token_ids, 20, VOCAB, EOS, True)

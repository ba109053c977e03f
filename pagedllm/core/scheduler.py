"""Scheduler: one rule, no phases (vLLM V1 style).

Every request has ``num_computed_tokens`` and ``num_tokens``; each step hands out a token budget so
the first catches up with the second. Prefill chunks and decodes share one batch. Running
requests go first (low inter-token latency), then waiting ones. A running request that cannot
get a block preempts a victim (recompute); a waiting request never preempts anyone.
"""
from __future__ import annotations

from collections.abc import Iterable

from pagedllm.config import SchedulerConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.ngram_proposer import NgramProposer
from pagedllm.core.outputs import (CachedRequestData, EngineCoreOutputs, NewRequestData,
                                   RunnerOutput, SchedulerOutput)
from pagedllm.core.admission import validate_request
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.request_queue import create_request_queue
from pagedllm.core.sequence_sharing import SequenceSharingMixin
from pagedllm.errors import ValidationError
from pagedllm.sampling_params import SamplingParams


_NO_IDS: list[int] = []  # shared "no new blocks" entry; the runner only reads it


def _prompt_tokens_in(req: Request, start: int, end: int) -> int:
    """How many of positions [start, end) are prompt tokens (for the prompt-tokens counter)."""
    return max(min(req._num_prompt_tokens, end) - start, 0)


class Scheduler(SequenceSharingMixin):
    def __init__(self, scheduler_config: SchedulerConfig, num_blocks: int, block_size: int,
                 max_model_len: int, enable_caching: bool = True,
                 proposer: NgramProposer | None = None) -> None:
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.long_prefill_token_threshold = scheduler_config.long_prefill_token_threshold
        self.policy = scheduler_config.scheduling_policy
        self.max_skip_ahead = scheduler_config.max_skip_ahead
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.kv_cache_manager = KVCacheManager(num_blocks, block_size, enable_caching)

        self.requests: dict[str, Request] = {}
        self.waiting = create_request_queue(self.policy)
        self.running: list[Request] = []
        # Finished or aborted since the last schedule(): the runner must drop their state.
        self.finished_req_ids: set[str] = set()
        # Running requests the runner has not seen yet (children forked after their leader's
        # prefill): they go out as new requests the next time they are scheduled.
        self._unsent: set[str] = set()
        # Running leaders whose children have not forked yet: their sequence slots are reserved.
        self._running_leaders: set[Request] = set()
        self.proposer = proposer  # speculative decoding (None: off)
        self._stop_id_sets: dict[frozenset[int], frozenset[int]] = {}
        # Prefix-cache hits of first admissions, reported with the next step's outputs.
        self._new_num_cached: dict[str, int] = {}

        # Counters for metrics (monotonic).
        self.num_preemptions = 0
        self.num_prompt_tokens_computed = 0  # prompt tokens run through the model, recompute included
        self.num_generation_tokens = 0
        self.num_drafts = 0  # speculative decoding: draft runs verified, draft tokens, accepted
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    # ------------------------------------------------------------------------------------------
    # Admission
    # ------------------------------------------------------------------------------------------
    @property
    def max_cache_tokens(self) -> int:
        return self.kv_cache_manager.num_blocks * self.block_size

    def add_request(self, request: Request, forks: list[Request] | None = None) -> None:
        """Queue a request, or reject it now (ValidationError) if it could never run.

        ``forks``: parallel samples of the same prompt. Only ``request`` (the leader) is queued;
        the forks wait until its prefill completes, then share all its blocks (no recompute).
        """
        forks = forks or []
        for r in [request, *forks]:
            if r.request_id in self.requests:
                raise ValidationError(f"request id {r.request_id!r} is already in use", "request_id")
            validate_request(r, self.max_model_len, self.kv_cache_manager.num_blocks, self.block_size)
            r.set_limits(self.max_model_len, self._stop_id_sets)
        if 1 + len(forks) > self.max_num_seqs:
            raise ValidationError(
                f"n={1 + len(forks)} parallel samples exceed max_num_seqs={self.max_num_seqs}; "
                f"lower n or raise max_num_seqs", "n")
        ids = [r.request_id for r in [request, *forks]]
        if len(set(ids)) != len(ids):
            raise ValidationError("duplicate request ids in one group", "request_id")
        request.status = RequestStatus.WAITING
        request.pending_forks = list(forks)
        self.requests[request.request_id] = request
        for child in forks:
            child.status = RequestStatus.WAITING
            child.fork_leader = request
            self.requests[child.request_id] = child
        self.waiting.add_request(request)

    # ------------------------------------------------------------------------------------------
    # schedule()
    # ------------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        kv = self.kv_cache_manager
        budget = self.max_num_batched_tokens
        threshold = self.long_prefill_token_threshold
        num_scheduled: dict[str, int] = {}
        # Running requests go out as diffs, recorded as they are scheduled (one pass: this loop
        # runs for every running request every step).
        cached = CachedRequestData()
        req_ids, new_block_ids = cached.req_ids, cached.new_block_ids
        computed, new_token_ids = cached.num_computed_tokens, cached.new_token_ids
        scheduled_new: list[Request] = []
        preempted: set[str] = set()
        unsent = self._unsent  # forked children: they go out whole, as new requests
        # Drafts to verify and forks to sample: read before num_computed_tokens advances.
        spec_tokens: dict[str, list[int]] = {}
        pending_forks: dict[str, list[tuple[str, SamplingParams]]] = {}
        drafting = self.proposer is not None
        sharing = drafting or bool(self._running_leaders)
        num_prompt_computed = 0

        # 1. Running requests first. This loop runs for every running request every step, so
        # it is kept to a few integer operations and list appends per request: a plain for loop
        # over the running list, left only when the KV cache runs out (preemption, below).
        running = self.running
        append_slot = kv.append_slot
        add_req_id, add_block_ids = req_ids.append, new_block_ids.append
        add_computed, add_token_ids = computed.append, new_token_ids.append
        i = 0
        while True:
            stalled = None
            for i, req in enumerate(running[i:] if i else running, i):
                start = req.num_computed_tokens
                all_ids = req.all_token_ids
                n = len(all_ids) - start
                if drafting:
                    n += len(req.spec_token_ids)
                if threshold and n > threshold:
                    n = threshold
                if n > budget:
                    n = budget
                if n <= 0:
                    continue
                if n == 1 and start < req.kv_in_place_until:
                    block_ids = _NO_IDS  # lands inside its own last block: nothing to allocate
                else:
                    new_blocks = append_slot(req) if n == 1 else kv.allocate_slots(req, n)
                    if new_blocks is None:
                        stalled = req
                        break
                    block_ids = [b.block_id for b in new_blocks] if new_blocks else _NO_IDS
                rid = req.request_id
                num_scheduled[rid] = n
                budget -= n
                if sharing:
                    self._note_drafts_and_forks(req, start + n, spec_tokens, pending_forks)
                if unsent and rid in unsent:
                    scheduled_new.append(req)  # advanced with the new requests below
                else:
                    add_req_id(rid)
                    add_block_ids(block_ids)
                    add_computed(start)
                    add_token_ids(all_ids[req.num_sent_tokens:])
                    req.num_sent_tokens = len(all_ids)
                    # Advance now: the next schedule() sees these tokens as computed (the runner
                    # computes them before then), and preemption frees exactly what was computed.
                    req.num_computed_tokens = start + n
                    if start < req._num_prompt_tokens:  # a prefill chunk
                        num_prompt_computed += _prompt_tokens_in(req, start, start + n)
                if budget <= 0:
                    break
            if stalled is None:
                break
            # Out of blocks: preempt a victim (it gives back what it was given this step), then
            # resume at the stalled request, which retries with the freed blocks; if it was the
            # victim itself, running[i] is now the request after it.
            victim = running[-1] if self.policy == "fcfs" else max(running)
            victim_index = running.index(victim)
            if victim.request_id in num_scheduled:
                budget += num_scheduled.pop(victim.request_id)
                num_prompt_computed -= self._unschedule(victim, cached, scheduled_new,
                                                        spec_tokens, pending_forks)
            self._preempt(victim)
            preempted.add(victim.request_id)
            if victim_index < i:
                i -= 1

        # 2. Then waiting requests, unless this step already had to preempt (memory is tight).
        if not preempted:
            self._schedule_waiting(budget, num_scheduled, scheduled_new)
            if not num_scheduled and self.running and self.waiting:
                # Every running request is idle (beam slots waiting for their group's decision)
                # and hold the memory a waiting one needs: make room, or nothing ever moves.
                victim = self.running[-1] if self.policy == "fcfs" else max(self.running)
                self._preempt(victim)
                preempted.add(victim.request_id)
                self._schedule_waiting(budget, num_scheduled, scheduled_new)

        if unsent:
            unsent.difference_update(r.request_id for r in scheduled_new)
        return self._build_output(num_scheduled, cached, scheduled_new, preempted, spec_tokens,
                                  pending_forks, num_prompt_computed)

    def _note_drafts_and_forks(self, req: Request, end: int, spec_tokens: dict[str, list[int]],
                               pending_forks: dict[str, list[tuple[str, SamplingParams]]]) -> None:
        """Draft tokens computed this step (up to ``end``), and a leader whose prompt completes
        this step, so its children must get first tokens sampled from the same logits."""
        num_tokens = len(req.all_token_ids)
        if req.spec_token_ids and end > num_tokens:
            spec_tokens[req.request_id] = req.spec_token_ids[:end - num_tokens]
        if req.pending_forks and end == num_tokens:
            pending_forks[req.request_id] = [(c.request_id, c.sampling_params) for c in req.pending_forks]

    def _unschedule(self, req: Request, cached: CachedRequestData, scheduled_new: list[Request],
                    spec_tokens: dict, pending_forks: dict) -> int:
        """Take back a running request scheduled earlier in this step (it is about to be
        preempted). Returns the prompt tokens it had been counted for."""
        rid = req.request_id
        spec_tokens.pop(rid, None)
        pending_forks.pop(rid, None)
        if req in scheduled_new:  # an unsent child: not advanced yet
            scheduled_new.remove(req)
            return 0
        j = cached.req_ids.index(rid)
        start = cached.num_computed_tokens[j]
        for column in (cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, cached.new_token_ids):
            del column[j]
        end, req.num_computed_tokens = req.num_computed_tokens, start
        return _prompt_tokens_in(req, start, end)

    def _num_new_tokens(self, num_wanted: int, budget: int) -> int:
        n = num_wanted
        if self.long_prefill_token_threshold and n > self.long_prefill_token_threshold:
            n = self.long_prefill_token_threshold
        return min(n, budget)

    def _schedule_waiting(self, budget: int, num_scheduled: dict[str, int],
                          scheduled_new: list[Request]) -> int:
        """Admit waiting requests in queue order while budget, sequence slots and blocks last.

        Bounded skip-ahead: when the head does not fit in the KV cache, later requests may be
        admitted past it, but each admission past a waiting request counts against it; once any
        skipped request has been passed ``max_skip_ahead`` times, admission stops until it fits.
        Its wait is thus bounded by ``max_skip_ahead`` admissions plus the time the running
        requests need to finish (they never wait for it, and waiting requests preempt nobody,
        so blocks only free up), and it fits once they are gone: admission checked that it fits
        the whole cache.
        """
        kv = self.kv_cache_manager
        skipped: list[Request] = []
        reserved = sum(len(r.pending_forks) for r in self._running_leaders)
        while self.waiting and budget > 0 and len(self.running) + reserved < self.max_num_seqs:
            req = self.waiting.pop_request()
            if len(self.running) + reserved + 1 + len(req.pending_forks) > self.max_num_seqs:
                skipped.append(req)  # its children will need sequence slots too
                break
            hit_blocks, num_hit = kv.get_computed_blocks(req)
            n = self._num_new_tokens(req.num_tokens - num_hit, budget)
            new_blocks = kv.allocate_slots(req, n, num_hit, hit_blocks)
            if new_blocks is None:
                skipped.append(req)
                if len(skipped) > self.max_skip_ahead or any(
                        s.num_skipped_past >= self.max_skip_ahead for s in skipped):
                    break
                continue
            for s in skipped:
                s.num_skipped_past += 1
            stop_skipping = any(s.num_skipped_past >= self.max_skip_ahead for s in skipped)
            kv.record_prefix_cache_query(req.num_tokens, num_hit)
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
                self._new_num_cached[req.request_id] = num_hit
            req.num_computed_tokens = num_hit
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            if req.pending_forks:
                self._running_leaders.add(req)
                reserved += len(req.pending_forks)
            scheduled_new.append(req)
            num_scheduled[req.request_id] = n
            budget -= n
            if stop_skipping:
                break  # a skipped request has been passed often enough: it goes next
        if skipped:
            self.waiting.prepend_requests(skipped)
        return budget

    def _preempt(self, req: Request) -> None:
        """Recompute preemption: free every block and go back to the head of the queue.

        Blocks it published are kept in the prefix cache only as far as their KV was computed
        (a victim can be preempted in the very step that scheduled it), so its resume may hit them.
        """
        self.running.remove(req)
        self.kv_cache_manager.free(req, num_valid_tokens=req.num_computed_tokens)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.num_sent_tokens = 0  # the runner drops it; it is resent whole on resume
        self._running_leaders.discard(req)
        self._unsent.discard(req.request_id)
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend_request(req)

    def _build_output(self, num_scheduled: dict[str, int], cached: CachedRequestData,
                      scheduled_new: list[Request], preempted: set[str],
                      spec_tokens: dict[str, list[int]],
                      pending_forks: dict[str, list[tuple[str, SamplingParams]]],
                      num_prompt_computed: int) -> SchedulerOutput:
        kv = self.kv_cache_manager
        new_reqs = []
        for req in scheduled_new:
            n = num_scheduled[req.request_id]
            start = req.num_computed_tokens
            if self.proposer is not None or req.pending_forks:
                self._note_drafts_and_forks(req, start + n, spec_tokens, pending_forks)
            new_reqs.append(NewRequestData(
                req_id=req.request_id,
                prompt_token_ids=req.prompt_token_ids,
                output_token_ids=req.output_token_ids,
                sampling_params=req.sampling_params,
                block_ids=kv.get_block_ids(req.request_id),
                num_computed_tokens=start,
                eos_token_ids=req.eos_token_ids,
            ))
            req.num_sent_tokens = len(req.all_token_ids)
            req.num_computed_tokens = start + n
            num_prompt_computed += _prompt_tokens_in(req, start, start + n)
        self.num_prompt_tokens_computed += num_prompt_computed
        block_copies, replaced = kv.take_block_copies()
        replaced_tables = {}
        if replaced:  # copy-on-write changed these tables; new requests are sent whole anyway
            new_ids = {r.request_id for r in scheduled_new}
            replaced_tables = {rid: kv.get_block_ids(rid) for rid in replaced
                               if rid in num_scheduled and rid not in new_ids}
        out = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            block_copies=block_copies,
            replaced_block_tables=replaced_tables,
            scheduled_spec_decode_tokens=spec_tokens,
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids=preempted,
            pending_forks=pending_forks,
        )
        self.finished_req_ids = set()
        return out

    # ------------------------------------------------------------------------------------------
    # update_from_output()
    # ------------------------------------------------------------------------------------------
    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: RunnerOutput) -> EngineCoreOutputs:
        """Append the sampled tokens, apply the stop checks, free finished requests."""
        outputs = EngineCoreOutputs(num_cached_tokens=self._new_num_cached)
        self._new_num_cached = {}
        out_ids, out_tokens, finished = outputs.req_ids, outputs.new_token_ids, outputs.finished
        # The plain step (one token per request, nothing else to report) is handled inline;
        # anything else goes through _apply_output.
        plain = (runner_output.logprobs is None and not runner_output.prompt_logprobs
                 and not runner_output.fork_token_ids and self.proposer is None
                 and not scheduler_output.scheduled_spec_decode_tokens)
        requests = self.requests
        running_status = RequestStatus.RUNNING
        num_generated = 0
        any_stopped = False
        for rid, new_ids in zip(runner_output.req_ids, runner_output.sampled_token_ids):
            req = requests.get(rid)
            if req is None or req.status is not running_status:
                continue  # aborted (or finished) after it was scheduled
            if plain and len(new_ids) == 1 and not req.is_beam:
                tok = new_ids[0]
                all_ids = req.all_token_ids
                all_ids.append(tok)
                num_generated += 1
                out_ids.append(rid)
                out_tokens.append(new_ids)
                if (tok in req.maybe_stop_ids or len(all_ids) >= req.max_num_tokens) and self._check_stop(req):
                    finished[rid] = (req.get_finished_reason(), req.stop_reason)
                    self._free_request(req)
                    any_stopped = True
            elif self._apply_output(req, new_ids, scheduler_output, runner_output, outputs):
                any_stopped = True
        self.num_generation_tokens += num_generated
        if any_stopped:
            self.running = [r for r in self.running if r.status == running_status]
        return outputs

    def _apply_output(self, req: Request, new_ids: list[int], scheduler_output: SchedulerOutput,
                      runner_output: RunnerOutput, outputs: EngineCoreOutputs) -> bool:
        """The general case of update_from_output for one request: partial prefills, forks,
        beams, drafts, several tokens, logprobs. Returns whether the request stopped."""
        rid = req.request_id
        all_logprobs = runner_output.logprobs
        new_logprobs = all_logprobs[runner_output.req_id_to_index[rid]] if all_logprobs else None
        if req.pending_forks and rid in runner_output.fork_token_ids:
            self._fork_children(req, runner_output, outputs)
        if req.is_beam:
            if new_ids:  # caught up: report the distribution, append nothing
                outputs.add(rid, [], new_logprobs)
            return False
        drafts = scheduler_output.scheduled_spec_decode_tokens.get(rid)
        if drafts:
            # Rejected drafts were computed but are not part of the sequence: roll back so
            # their slots are rewritten next step.
            num_accepted = len(new_ids) - 1
            req.num_computed_tokens -= len(drafts) - num_accepted
            req.kv_in_place_until = 0
            self.num_drafts += 1
            self.num_draft_tokens += len(drafts)
            self.num_accepted_tokens += num_accepted
        stopped = False
        kept = 0
        for tok in new_ids:
            req.all_token_ids.append(tok)
            kept += 1
            if self._check_stop(req):
                stopped = True
                break
        if kept < len(new_ids):  # tokens sampled past a stop condition are dropped
            new_ids = new_ids[:kept]
            new_logprobs = new_logprobs[:kept] if new_logprobs else new_logprobs
        self.num_generation_tokens += kept
        prompt_lp = runner_output.prompt_logprobs.get(rid)
        if new_ids or prompt_lp is not None:
            outputs.add(rid, new_ids, new_logprobs, prompt_lp)
        if stopped:
            outputs.finished[rid] = (req.get_finished_reason(), req.stop_reason)
            self._free_request(req)
        elif self.proposer is not None and new_ids:
            self._propose(req)
        return stopped

    def _check_stop(self, req: Request) -> bool:
        """Stop checks for the token just appended: min_tokens, EOS, stop ids, then length."""
        sp = req.sampling_params
        num_output = len(req.all_token_ids) - req._num_prompt_tokens
        if num_output >= sp.min_tokens:
            last = req.all_token_ids[-1]
            if not sp.ignore_eos and last in req.eos_token_ids:
                req.status = RequestStatus.FINISHED_STOPPED
                return True
            if last in sp._all_stop_token_ids:
                req.status = RequestStatus.FINISHED_STOPPED
                req.stop_reason = last
                return True
        if len(req.all_token_ids) >= req.max_num_tokens:
            req.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False

    # ------------------------------------------------------------------------------------------
    # Finishing from outside: abort, stop strings
    # ------------------------------------------------------------------------------------------
    def finish_requests(self, request_ids: str | Iterable[str],
                        status: RequestStatus = RequestStatus.FINISHED_ABORTED,
                        stop_reason: int | str | None = None) -> list[Request]:
        """Finish requests now and free their blocks at once. Idempotent: unknown or already
        finished ids are ignored. Returns the requests it finished."""
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        done = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.is_finished():
                continue
            done.append(req)
        if not done:
            return done
        running_drop = {id(r) for r in done if r.status == RequestStatus.RUNNING}
        if running_drop:
            self.running = [r for r in self.running if id(r) not in running_drop]
        waiting_drop = [r for r in done if r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
                        and not (r.fork_leader is not None and r in r.fork_leader.pending_forks)]
        if waiting_drop:
            self.waiting.remove_requests(waiting_drop)
        for req in done:
            leader = req.fork_leader
            if leader is not None and req in leader.pending_forks:
                leader.pending_forks.remove(req)  # never forked: it holds no blocks
            self._unsent.discard(req.request_id)
            if req.pending_forks:
                # An aborted leader hands its unforked siblings to the first of them.
                heir, rest = req.pending_forks[0], req.pending_forks[1:]
                req.pending_forks = []
                heir.fork_leader, heir.pending_forks = None, rest
                for child in rest:
                    child.fork_leader = heir
                self.waiting.prepend_request(heir)  # it keeps the group's place in line
            req.status = status
            if stop_reason is not None:
                req.stop_reason = stop_reason
            self._free_request(req)
        return done

    abort_requests = finish_requests

    def _free_request(self, req: Request) -> None:
        self._running_leaders.discard(req)
        self.kv_cache_manager.free(req)
        self.finished_req_ids.add(req.request_id)
        del self.requests[req.request_id]

    # ------------------------------------------------------------------------------------------
    # Introspection
    # ------------------------------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def has_finished_requests(self) -> bool:
        return bool(self.finished_req_ids)

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def check_integrity(self) -> None:
        self.kv_cache_manager.check_integrity()
        for req in self.running:
            assert req.status == RequestStatus.RUNNING
        assert len(self.running) + sum(len(r.pending_forks) for r in self._running_leaders) <= self.max_num_seqs
        num_pending = sum(len(r.pending_forks) for r in self.requests.values())
        assert len(self.running) + len(self.waiting) + num_pending == len(self.requests)

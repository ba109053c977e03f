"""Scheduler: one rule, no phases (vLLM V1 style).

Every request has ``num_computed_tokens`` and ``num_tokens`` (plus draft tokens to verify); each
step hands out a token budget so the first catches up with the second. Prefill chunks, decodes
and draft verification share one batch. Running requests go first (low inter-token latency),
then waiting ones. A running request that cannot get a block preempts a victim (recompute); a
waiting request never preempts anyone.

Sequences that share KV (parallel samples, beams) enter through ``fork``; drafts through
``set_draft_tokens``. The schedule loop itself treats every running request alike.

A pooling request's output is a vector. An encoder's input runs whole in one step; on a
generator that also pools (``pooling_chunks``) it is a prompt like any other, chunked, and while
generation requests run, pooling inputs share a step only up to
``max_pooling_tokens_while_decoding`` tokens: the decodes' inter-token latency stays bounded.
"""
from __future__ import annotations

from collections.abc import Iterable

from pagedllm.config import SchedulerConfig
from pagedllm.core.admission import validate_pooling_request, validate_request
from pagedllm.core.kv_cache_manager import NO_NEW_BLOCKS, KVCacheManager
from pagedllm.core.outputs import CachedRequestData, EngineCoreOutputs, NewRequestData, RunnerOutput, SchedulerOutput
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.request_queue import create_request_queue
from pagedllm.core.scheduler_stats import SchedulerStats
from pagedllm.errors import check_request_id_free


def _count_loras(requests: Iterable[Request]) -> dict[str, int]:
    """Adapter name -> how many of ``requests`` use it."""
    counts: dict[str, int] = {}
    for r in requests:
        if r.lora_request is not None:
            counts[r.lora_request.lora_name] = counts.get(r.lora_request.lora_name, 0) + 1
    return counts


# The shared "no new block in any group" entry (the usual decode step); the runner only reads it.
_NO_IDS: list[list[int]] = []


class Scheduler:
    def __init__(self, scheduler_config: SchedulerConfig, num_blocks: int, block_size: int,
                 max_model_len: int, enable_caching: bool = True,
                 sliding_windows: tuple[int | None, ...] = (None,), max_loras: int = 0,
                 pooling_chunks: bool = False) -> None:
        """``sliding_windows``: each KV cache group's window (None: full attention), as the
        runner grouped the model's layers; one full-attention group by default. ``max_loras``:
        most LoRA adapters running at once (the worker's slots); 0: no adapters.
        ``pooling_chunks``: pooling inputs may run over several steps (a generator's decoder
        keeps their KV like a prompt's); False: each runs whole in one step (an encoder)."""
        self.max_loras = max_loras
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.long_prefill_token_threshold = scheduler_config.long_prefill_token_threshold
        self.policy = scheduler_config.scheduling_policy
        self.max_skip_ahead = scheduler_config.max_skip_ahead
        self.async_scheduling = scheduler_config.async_scheduling
        self.pooling_chunks = pooling_chunks
        self.max_pooling_tokens_while_decoding = scheduler_config.max_pooling_tokens_while_decoding
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.kv_cache_manager = KVCacheManager(num_blocks, block_size, enable_caching, sliding_windows,
                                               self.max_num_batched_tokens)

        self.requests: dict[str, Request] = {}
        self.waiting = create_request_queue(self.policy)
        self.running: list[Request] = []
        # Finished or aborted since the last schedule(): the runner must drop their state.
        self.finished_req_ids: set[str] = set()
        # Prefix-cache hits of sequences started (admitted, forked) since the last step's report.
        self._new_num_cached: dict[str, int] = {}
        self._stop_id_sets: dict[frozenset[int], frozenset[int]] = {}

    # -- Requests in -----------------------------------------------------------------------------
    def add_request(self, request: Request, validated: bool = False) -> None:
        """Queue a request, or reject it now (ValidationError) if it could never run.
        ``validated``: the caller ran ``validate`` on it already (it held the request meanwhile)."""
        self._register(request, validated)
        self.waiting.add_request(request)

    def validate(self, request: Request) -> None:
        """Raise ValidationError unless ``request`` could run alone in the empty cache."""
        if request.pooling_params is not None:
            validate_pooling_request(request, self.max_model_len,
                                     None if self.pooling_chunks else self.max_num_batched_tokens,
                                     self.kv_cache_manager)
        else:
            validate_request(request, self.max_model_len, self.kv_cache_manager)

    def _register(self, request: Request, validated: bool = False) -> None:
        check_request_id_free(request.request_id, self.requests)  # derived ids (samples, beams) too
        if not validated:
            self.validate(request)
        request.set_limits(self.max_model_len, self._stop_id_sets)
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request

    def fork(self, children: list[tuple[str, Request]], finish: Iterable[str] = ()) -> None:
        """Start sequences that continue others, then finish ``finish`` (FINISHED_STOPPED).

        Each ``(parent_id, child)``: the child's tokens continue a prefix of the parent's (a
        parallel sample: the prompt; a beam: the parent's tokens plus one). It shares every block
        holding its computed tokens (the first write into a shared block copies it) and runs at
        once while a sequence slot is free; otherwise, or when the parent holds no KV, it waits
        like any request and recomputes (its full blocks still hit the prefix cache). All forks
        read the state from before ``finish`` released anything: a beam step replaces its beams
        in one call.
        """
        for _, child in children:
            self._register(child)
        kv = self.kv_cache_manager
        started: list[tuple[Request, Request, int]] = []
        for parent_id, child in children:
            parent = self.requests.get(parent_id)
            running = parent is not None and parent.status == RequestStatus.RUNNING
            started.append((parent, child, kv.fork(parent, child) if running else 0))
        self.finish_requests(finish, RequestStatus.FINISHED_STOPPED)
        queued = []
        for parent, child, num_computed in started:
            if num_computed and len(self.running) < self.max_num_seqs:
                child.num_computed_tokens = num_computed
                child.num_cached_tokens = parent.num_cached_tokens
                self._new_num_cached[child.request_id] = max(child.num_cached_tokens, 0)
                child.status = RequestStatus.RUNNING
                self.running.append(child)
            else:
                kv.free(child)
                queued.append(child)
        if queued:
            self.waiting.prepend_requests(queued)  # part of a group already running: go first

    def set_draft_tokens(self, request_id: str, token_ids: list[int]) -> None:
        """Draft tokens to verify in the next step (never past the length limit)."""
        req = self.requests.get(request_id)
        if req is not None and req.status == RequestStatus.RUNNING:
            known = req.num_tokens + req.num_output_placeholders
            req.spec_token_ids = token_ids[:max(req.max_num_tokens - known - 1, 0)]

    # -- schedule() ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        kv = self.kv_cache_manager
        budget = self.max_num_batched_tokens
        pooling_budget = self._pooling_budget()
        num_scheduled: dict[str, int] = {}
        new_block_ids: dict[str, list[list[int]]] = {}  # per request, per KV cache group
        preempted: dict[str, str] = {}  # victim -> the running request that needed its blocks

        # 1. Running requests first, in order. One that cannot get a block preempts a victim,
        # which gives back what it was given this step (the loop walks a copy of the running
        # list, skipping victims it has not reached yet).
        running_status = RequestStatus.RUNNING
        for req in list(self.running):
            if budget <= 0:
                break
            if req.status is not running_status:
                continue  # preempted by a request before it
            # What it lacks: its tokens (those in flight too) and drafts to verify, never past the
            # last position whose logits matter.
            end = len(req.all_token_ids) + req.num_output_placeholders + len(req.spec_token_ids)
            if end >= req.max_num_tokens:
                end = req.max_num_tokens - 1
            n = end - req.num_computed_tokens
            if n <= 0:
                continue
            if req.pooling_params is not None:  # a chunked pooling input: its own budget too
                n = self._num_new_tokens(n, min(budget, pooling_budget))
                if n == 0:
                    continue
                pooling_budget -= n
            elif n > 1:  # one token always fits: the budget left is positive, a threshold >= 1
                n = self._num_new_tokens(n, budget)
            while (new_blocks := kv.allocate_slots(req, n)) is None:
                victim = self._pick_victim()
                if victim.request_id in num_scheduled:
                    budget += num_scheduled.pop(victim.request_id)
                    del new_block_ids[victim.request_id]
                self._preempt(victim)
                preempted[victim.request_id] = req.request_id
                if victim is req:
                    break
            else:
                num_scheduled[req.request_id] = n
                new_block_ids[req.request_id] = (_NO_IDS if new_blocks is NO_NEW_BLOCKS else
                                                 [[b.block_id for b in g] for g in new_blocks])
                budget -= n

        # 2. Then waiting requests, unless this step had to preempt (memory is tight).
        skipped = [] if preempted else self._schedule_waiting(budget, pooling_budget, num_scheduled)
        return self._update_after_schedule(num_scheduled, new_block_ids, preempted, skipped)

    def _num_new_tokens(self, n: int, budget: int) -> int:
        """A request's share of the step: the ``n`` tokens it lacks, capped by
        ``long_prefill_token_threshold`` and the budget left."""
        threshold = self.long_prefill_token_threshold
        if threshold and n > threshold:
            n = threshold
        return n if n < budget else budget

    def _pooling_budget(self) -> int:
        """The tokens pooling inputs may take this step: ``max_pooling_tokens_while_decoding``
        while a generation request runs (each of its steps then grows by at most that many
        tokens), else the whole budget."""
        cap = self.max_pooling_tokens_while_decoding
        if self.pooling_chunks and cap and any(r.pooling_params is None for r in self.running):
            return cap
        return self.max_num_batched_tokens

    def _pick_victim(self) -> Request:
        """FCFS: the most recently admitted; priority: the worst (priority, arrival)."""
        return self.running[-1] if self.policy == "fcfs" else max(self.running)

    def _schedule_waiting(self, budget: int, pooling_budget: int, num_scheduled: dict[str, int]) -> list[str]:
        """Admit waiting requests in queue order while budget, sequence slots and blocks last;
        returns the ids of those that did not fit and were skipped (a pooling input with no
        pooling budget left, or an adapter with no slot, is skipped the same way).

        Bounded skip-ahead: when the head does not fit in the KV cache, later requests may be
        admitted past it, each admission counting against every request it passes; once one
        has been passed ``max_skip_ahead`` times, admission stops until it fits. Its wait is thus
        bounded by those admissions plus the time the running requests need to finish (waiting
        requests preempt nobody, so blocks only free up), and it fits the empty cache.
        """
        kv = self.kv_cache_manager
        skipped: list[Request] = []
        # The adapters running: a request with another one waits while every slot is taken.
        loras = {r.lora_request.lora_int_id for r in self.running if r.lora_request} if self.max_loras else None
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting.pop_request()
            blocked = self._lora_blocked(req, loras)
            if not blocked:
                hit_blocks, num_hit, n = self._admission_size(req, budget, pooling_budget)
            if blocked or not 0 < n <= budget or kv.allocate_slots(req, n, num_hit, hit_blocks) is None:
                skipped.append(req)
                if len(skipped) > self.max_skip_ahead or any(
                        s.num_skipped_past >= self.max_skip_ahead for s in skipped):
                    break
                continue
            for s in skipped:
                s.num_skipped_past += 1
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
                self._new_num_cached[req.request_id] = num_hit
            req.num_computed_tokens = num_hit
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            if loras is not None and req.lora_request is not None:
                loras.add(req.lora_request.lora_int_id)
            num_scheduled[req.request_id] = n
            budget -= n
            if req.pooling_params is not None:
                pooling_budget -= n
            if any(s.num_skipped_past >= self.max_skip_ahead for s in skipped):
                break  # a skipped request has been passed often enough: it goes next
        if skipped:
            self.waiting.prepend_requests(skipped)
        return [r.request_id for r in skipped]

    def _admission_size(self, req: Request, budget: int, pooling_budget: int) -> tuple[list | None, int, int]:
        """A waiting request's prefix hit (blocks, tokens) and the tokens it would run now. A
        pooling request takes no hit (its pooler reads every position's hidden state) and runs
        whole unless ``pooling_chunks``."""
        if req.pooling_params is not None:
            if not self.pooling_chunks:
                return None, 0, req.num_tokens
            return None, 0, self._num_new_tokens(req.num_tokens, min(budget, pooling_budget))
        hit_blocks, num_hit = self.kv_cache_manager.get_computed_blocks(req)
        return hit_blocks, num_hit, self._num_new_tokens(req.num_tokens - num_hit, budget)

    def _lora_blocked(self, req: Request, loras: set[int] | None) -> bool:
        """Whether ``req``'s adapter would be one more than max_loras beside ``loras``."""
        lora = req.lora_request
        return (loras is not None and lora is not None and lora.lora_int_id not in loras
                and len(loras) >= self.max_loras)

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
        req.num_output_placeholders = 0  # in flight, lost: recomputed, they come out the same
        req.num_drafts_in_flight = 0
        req.num_sent_tokens = 0  # the runner drops it; it is resent whole on resume
        req.num_preemptions += 1
        self.waiting.prepend_request(req)

    def preempt_requests(self, request_ids: Iterable[str]) -> None:
        """Preempt running requests on their owner's behalf (a stalled beam group, say)."""
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is not None and req.status == RequestStatus.RUNNING:
                self._preempt(req)

    def _update_after_schedule(self, num_scheduled: dict[str, int],
                               new_block_ids: dict[str, list[list[int]]],
                               preempted: dict[str, str], skipped: list[str]) -> SchedulerOutput:
        """Write the step's work order and advance every scheduled request (the one place that
        does): the next schedule() sees these tokens as computed (the runner computes them
        before then), and a preemption frees exactly what was computed.

        A request the runner does not hold (admitted, resumed or forked) goes out whole; one it
        holds, as the diff since it last saw it (new block ids, tokens appended since)."""
        kv, requests = self.kv_cache_manager, self.requests
        new_reqs: list[NewRequestData] = []
        cached = CachedRequestData()
        add_id, add_blocks = cached.req_ids.append, cached.new_block_ids.append
        add_computed, add_tokens = cached.num_computed_tokens.append, cached.new_token_ids.append
        spec_tokens: dict[str, list[int]] = {}
        placeholders = self.async_scheduling
        num_prompt = 0
        for rid, n in num_scheduled.items():
            req = requests[rid]
            all_ids, start = req.all_token_ids, req.num_computed_tokens
            if start < req.num_prompt_tokens:  # a prefill chunk (or recomputation)
                num_prompt += min(req.num_prompt_tokens, start + n) - start
            if req.num_sent_tokens == 0:
                new_reqs.append(NewRequestData(rid, req.prompt_token_ids, req.output_token_ids,
                                               req.sampling_params, kv.get_block_ids(rid), start,
                                               req.eos_token_ids, req.lora_request, req.pooling_params))
            else:
                add_id(rid)
                add_blocks(new_block_ids[rid])
                add_computed(start)
                add_tokens(all_ids[req.num_sent_tokens:])
            known = len(all_ids) + req.num_output_placeholders  # tokens in flight are not drafts
            num_drafts = 0
            if req.spec_token_ids and start + n > known:  # the drafts that fit this step
                spec_tokens[rid] = req.spec_token_ids[:start + n - known]
                num_drafts = len(spec_tokens[rid])
                req.spec_token_ids = []  # verified once (async scheduling updates a step later)
            req.num_computed_tokens = start + n
            req.num_sent_tokens = len(all_ids)
            if placeholders and start + n >= known and not req.is_beam and req.pooling_params is None:
                # It samples: one more token in flight, and with drafts as if every draft were
                # accepted (the update rolls the rejected ones back, the runner already has).
                req.num_output_placeholders += 1 + num_drafts
                req.num_drafts_in_flight += num_drafts
        block_copies, replaced = kv.take_block_copies()
        finished, self.finished_req_ids = self.finished_req_ids, set()
        return SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            block_copies=block_copies,
            # Copy-on-write changed these tables beyond appending (new requests go out whole).
            replaced_block_tables={rid: kv.get_block_ids(rid) for rid in replaced
                                   if rid in cached.req_ids},
            scheduled_spec_decode_tokens=spec_tokens,
            finished_req_ids=finished,
            preempted_req_ids=set(preempted),
            num_scheduled_prompt_tokens=num_prompt,
            preempted_by=preempted,
            skipped_req_ids=skipped,
        )

    # -- update_from_output() --------------------------------------------------------------------
    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: RunnerOutput) -> EngineCoreOutputs:
        """Append the sampled tokens, apply the stop checks, free finished requests, and report
        the step (new tokens, finished requests, SchedulerStats)."""
        outputs = EngineCoreOutputs(num_cached_tokens=self._new_num_cached)
        self._new_num_cached = {}
        stats = outputs.scheduler_stats
        drafts = scheduler_output.scheduled_spec_decode_tokens
        logprobs, prompt_logprobs = runner_output.logprobs, runner_output.prompt_logprobs
        requests, running_status = self.requests, RequestStatus.RUNNING
        add_row, add_tokens = outputs.req_ids.append, outputs.new_token_ids.append  # the columns
        num_generated = 0
        any_finished = False
        for rid, new_ids in zip(runner_output.req_ids, runner_output.sampled_token_ids):
            req = requests.get(rid)
            if req is None or req.status is not running_status:
                continue  # aborted (or finished) after it was scheduled
            if req.pooling_params is not None:
                any_finished |= self._finish_pooling(req, runner_output.pooler_output, outputs)
                continue
            new_logprobs = logprobs[runner_output.req_id_to_index[rid]] if logprobs else None
            if req.num_output_placeholders and new_ids:
                req.num_output_placeholders -= 1  # the token in flight has landed
            if drafts and rid in drafts:
                verified = runner_output.num_draft_tokens.get(rid) if runner_output.num_draft_tokens else None
                self._update_spec_decode(req, len(drafts[rid]), len(new_ids), stats, verified)
            if req.is_beam:  # caught up: report the distribution; the beam search picks the token
                if new_ids:
                    outputs.add(rid, [], new_logprobs)
                continue
            # Append until a token stops the sequence; tokens sampled past it are dropped.
            all_ids, kept = req.all_token_ids, 0
            for tok in new_ids:
                all_ids.append(tok)
                kept += 1
                if (tok in req.maybe_stop_ids or len(all_ids) >= req.max_num_tokens) and req.check_stop():
                    break
            if kept < len(new_ids):
                new_ids = new_ids[:kept]
                new_logprobs = new_logprobs[:kept] if new_logprobs else new_logprobs
            num_generated += kept
            prompt_lp = prompt_logprobs.get(rid) if prompt_logprobs else None
            if prompt_lp is not None or new_logprobs:
                outputs.add(rid, new_ids, new_logprobs, prompt_lp)
            elif new_ids:
                add_row(rid)
                add_tokens(new_ids)
            if req.status is not running_status:
                outputs.finished[rid] = (req.get_finished_reason(), req.stop_reason)
                self._free_request(req)
                any_finished = True
        if any_finished:
            self.running = [r for r in self.running if r.status is running_status]
        stats.num_generation_tokens = num_generated
        self._fill_stats(stats, scheduler_output)
        return outputs

    def _finish_pooling(self, req: Request, pooler_output: dict[str, list[float]],
                        outputs: EngineCoreOutputs) -> bool:
        """Finish a pooling request with its vector if the runner pooled it (its input's last
        chunk ran this step); whether it finished."""
        rid = req.request_id
        if rid not in pooler_output:
            return False
        outputs.pooler_output[rid] = pooler_output[rid]
        req.status = RequestStatus.FINISHED_STOPPED
        outputs.finished[rid] = ("stop", None)
        self._free_request(req)
        return True

    def _update_spec_decode(self, req: Request, num_drafts: int, num_sampled: int,
                            stats: SchedulerStats, num_verified: int | None = None) -> None:
        """A request had ``num_drafts`` draft slots, verified ``num_verified`` of them (all, when
        None) and sampled ``num_sampled`` tokens (the accepted drafts, then one more): roll back
        the rejected ones and count the step."""
        num_accepted = num_sampled - 1
        # Rejected (or unused) drafts were scheduled but are not part of the sequence: roll back
        # so their slots are rewritten next step.
        req.num_computed_tokens -= num_drafts - num_accepted
        req.spec_token_ids = []
        if self.async_scheduling:  # the drafts' placeholders: the accepted landed, the rest are gone
            req.num_output_placeholders -= num_drafts
            req.num_drafts_in_flight -= num_drafts
        num_drafts = num_drafts if num_verified is None else num_verified
        if num_drafts == 0:
            return
        stats.num_drafts += 1
        stats.num_draft_tokens += num_drafts
        stats.num_accepted_tokens += num_accepted
        per_pos = stats.num_accepted_tokens_per_pos  # accepted: positions 0..m-1
        for pos in range(min(num_accepted, num_drafts)):
            if pos == len(per_pos):
                per_pos.append(0)
            per_pos[pos] += 1

    def _fill_stats(self, stats: SchedulerStats, so: SchedulerOutput) -> None:
        """The rest of the step's SchedulerStats (the update counted tokens and drafts)."""
        stats.num_prompt_tokens = so.num_scheduled_prompt_tokens
        stats.num_scheduled_tokens = so.total_num_scheduled_tokens
        stats.num_preempted_reqs = len(so.preempted_req_ids)
        stats.num_running_reqs, stats.num_waiting_reqs = len(self.running), len(self.waiting)
        stats.kv_cache_usage = self.kv_cache_manager.usage
        prefix = self.kv_cache_manager.make_prefix_cache_stats()
        stats.prefix_cache_queries, stats.prefix_cache_hits = prefix.queries, prefix.hits
        blocks = self.kv_cache_manager.block_pool.take_events()
        stats.num_blocks_allocated, stats.num_blocks_freed = blocks.num_allocated, blocks.num_freed
        stats.num_blocks_evicted, stats.num_blocks_copied = blocks.num_evicted, len(so.block_copies)
        if self.max_loras:
            stats.running_lora_adapters = _count_loras(self.running)
            stats.waiting_lora_adapters = _count_loras(self.waiting)

    # -- Finishing from outside: abort, stop strings, beams that end -----------------------------
    def finish_requests(self, request_ids: str | Iterable[str],
                        status: RequestStatus = RequestStatus.FINISHED_ABORTED,
                        stop_reason: int | str | None = None) -> list[Request]:
        """Finish requests now and free their blocks at once. Idempotent: unknown or already
        finished ids are ignored. Returns the requests it finished."""
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        done = [self.requests[rid] for rid in dict.fromkeys(request_ids) if rid in self.requests]
        running_drop = {id(r) for r in done if r.status == RequestStatus.RUNNING}
        if running_drop:
            self.running = [r for r in self.running if id(r) not in running_drop]
        waiting_drop = [r for r in done if r.status != RequestStatus.RUNNING]
        if waiting_drop:
            self.waiting.remove_requests(waiting_drop)
        for req in done:
            req.status = status
            if stop_reason is not None:
                req.stop_reason = stop_reason
            self._free_request(req)
        return done

    def _free_request(self, req: Request) -> None:
        self.kv_cache_manager.free(req)
        self.finished_req_ids.add(req.request_id)
        self._new_num_cached.pop(req.request_id, None)
        del self.requests[req.request_id]

    # -- Introspection ---------------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def check_integrity(self) -> None:
        """Every block accounted for, and every request reachable from exactly one queue."""
        self.kv_cache_manager.check_integrity()
        assert all(r.status == RequestStatus.RUNNING for r in self.running)
        assert all(r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED) for r in self.waiting)
        assert len(self.running) <= self.max_num_seqs
        queued = [r.request_id for r in self.running] + [r.request_id for r in self.waiting]
        assert sorted(queued) == sorted(self.requests), "a request in no queue, or in two"
        for rid in self.kv_cache_manager.req_to_blocks:
            req = self.requests.get(rid)
            assert req is not None and req.status == RequestStatus.RUNNING, f"{rid} holds blocks"

"""How several sequences share one prompt's KV, and how one grows by several tokens a step.

Mixed into the Scheduler (it uses its requests, queues and KV cache manager):
- parallel sampling: a leader prefills the prompt once; its children fork from it, sharing every
  block (the partial last one is copied on its first write), each with its own first token;
- beam search: a beam slot takes over another beam's sequence plus one token;
- speculative decoding: n-gram drafts proposed after each step.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from pagedllm.core.outputs import EngineCoreOutputs, RunnerOutput
from pagedllm.core.request import Request, RequestStatus

if TYPE_CHECKING:
    from pagedllm.core.scheduler import Scheduler


class SequenceSharingMixin:
    def _fork_children(self: Scheduler, leader: Request, runner_output: RunnerOutput,
                       outputs: EngineCoreOutputs) -> None:
        """The leader's prompt is computed: each pending child shares all its blocks (the partial
        last one included; the first write into it copies it) and takes its own first token."""
        tokens = runner_output.fork_token_ids[leader.request_id]
        logprobs = runner_output.fork_logprobs.get(leader.request_id)
        for i, child in enumerate(leader.pending_forks):
            self.kv_cache_manager.fork(leader, child)
            child.num_computed_tokens = leader.num_computed_tokens
            child.num_cached_tokens = leader.num_cached_tokens
            child.status = RequestStatus.RUNNING
            self.running.append(child)
            self._unsent.add(child.request_id)
            if child.is_beam:
                continue  # an idle beam slot: it gets its first token from the beam search
            child.all_token_ids.append(tokens[i])
            self.num_generation_tokens += 1
            stopped = self._check_stop(child)
            outputs.num_cached_tokens[child.request_id] = max(child.num_cached_tokens, 0)
            outputs.add(child.request_id, [tokens[i]],
                        [logprobs[i]] if logprobs and logprobs[i] is not None else None)
            if stopped:
                outputs.finished[child.request_id] = (child.get_finished_reason(), child.stop_reason)
                self._free_request(child)
                self.running.remove(child)
            elif self.proposer is not None:
                self._propose(child)
        leader.pending_forks = []
        self._running_leaders.discard(leader)

    def reassign_beams(self: Scheduler, assignments: list[tuple[str, str, int]]) -> None:
        """Beam search step: slot ``j`` takes over the sequence of beam ``p`` plus token ``t`` for
        every (j, p, t). Sequences are shared by reference count (the next write into a shared
        partial block copies it); all takeovers read the state from before any of them."""
        kv = self.kv_cache_manager
        plans = []
        for slot_id, parent_id, token in assignments:
            parent = self.requests[parent_id]
            running = parent.status == RequestStatus.RUNNING
            blocks, num_cached = kv.share_blocks(parent) if running else ([], 0)
            plans.append((self.requests[slot_id], parent.all_token_ids + [token], blocks, num_cached,
                          parent.num_computed_tokens if running else 0, list(parent.block_hashes)))
        slots = {id(plan[0]) for plan in plans}
        self.running = [r for r in self.running if id(r) not in slots]
        self.waiting.remove_requests([plan[0] for plan in plans])
        for slot, tokens, blocks, num_cached, num_computed, hashes in plans:
            kv.free(slot)
            slot.all_token_ids = tokens
            slot.block_hashes = hashes
            slot.num_computed_tokens = num_computed
            slot.num_sent_tokens = 0
            if blocks:
                kv.set_blocks(slot, blocks, num_cached)
                slot.status = RequestStatus.RUNNING
                self.running.append(slot)
                self._unsent.add(slot.request_id)  # the runner rebuilds its state from scratch
            else:  # the parent was preempted: recompute from the start
                slot.status = RequestStatus.PREEMPTED
                self._unsent.discard(slot.request_id)
                self.waiting.prepend_request(slot)

    def _propose(self: Scheduler, req: Request) -> None:
        """Draft tokens for the next step; never more than the request may still produce."""
        room = min(req.max_tokens - req.num_output_tokens,
                   self.max_model_len - len(req.all_token_ids)) - 1
        req.spec_token_ids = self.proposer.propose(req.all_token_ids, room) if room > 0 else []

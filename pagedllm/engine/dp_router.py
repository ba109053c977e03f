"""DPRouter: which data-parallel replica (engine core) serves a new request.

The rule, in one place:

1. Load. Each replica's load is ``4 * waiting + running`` (vLLM's DP load-balancing score: a
   waiting request costs a prefill and holds up everyone behind it). ``running`` is what the
   replica's last step reported (``SchedulerStats.num_running_reqs``), capped by the sequences
   this router knows are open there; every other open sequence counts as waiting, so requests
   routed since the replica's last step are counted at once (the router's own in-flight
   bookkeeping, exact: a sequence is open from its routing until its finish or abort).
2. Prefix affinity. The hash of the prompt's first full block (``hash_block_tokens``, the prefix
   cache's own hash, salted by the request's ``cache_salt``) maps to the replica that last served
   it. A request goes there, where that block (and likely more) is cached, unless that replica's
   load exceeds the least-loaded one's by more than ``affinity_slack`` (default: half a batch,
   ``max_num_seqs // 2`` load units, at least 1). Past that, queueing behind the holder costs
   more than recomputing the prefix, so the request goes to the least-loaded replica, which then
   becomes the prefix's holder: a hot prefix spreads over replicas as its load grows.
3. Otherwise the least-loaded replica; ties go to the replica routed fewest requests so far
   (then the lowest index), so that an idle server still spreads distinct prompts, and their
   cached blocks, over every replica.

A prompt shorter than one block has no prefix to follow. The prefix map is bounded (LRU), so a
long-running server with many distinct prefixes does not grow without limit.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from pagedllm.core.block_hash import hash_block_tokens

WAITING_WEIGHT = 4
MAX_PREFIXES = 1 << 16


class DPRouter:
    def __init__(self, num_replicas: int, block_size: int, affinity_slack: int) -> None:
        assert num_replicas >= 1 and block_size >= 1 and affinity_slack >= 0
        self.num_replicas = num_replicas
        self.block_size = block_size
        self.affinity_slack = affinity_slack
        self.owner: dict[str, int] = {}  # open sequence id (or beam request id) -> replica
        self.num_open = [0] * num_replicas
        self.num_running = [0] * num_replicas  # as each replica's last step reported
        self.prefix_holder: OrderedDict[int, int] = OrderedDict()  # first-block hash -> replica
        self.num_routed = [0] * num_replicas
        self.num_prefix_routed = [0] * num_replicas  # of which sent to a prefix's holder
        self.num_prompt_tokens = [0] * num_replicas  # of the requests routed (vllm:prompt_tokens)

    # -- load --------------------------------------------------------------------------------
    def load(self, replica: int) -> int:
        running = min(self.num_running[replica], self.num_open[replica])
        return WAITING_WEIGHT * (self.num_open[replica] - running) + running

    def least_loaded(self) -> int:
        return min(range(self.num_replicas), key=lambda i: (self.load(i), self.num_routed[i], i))

    def update_stats(self, replica: int, num_running_reqs: int) -> None:
        self.num_running[replica] = num_running_reqs

    # -- routing -----------------------------------------------------------------------------
    def prefix_hash(self, prompt_token_ids: list[int], cache_salt: str | None) -> int | None:
        if len(prompt_token_ids) < self.block_size:
            return None
        return hash_block_tokens(None, prompt_token_ids[:self.block_size], cache_salt)

    def route(self, prefix_hash: int | None) -> int:
        """The replica for a new request (nothing is recorded until ``assign``)."""
        least = self.least_loaded()
        holder = self.prefix_holder.get(prefix_hash) if prefix_hash is not None else None
        if holder is not None and self.load(holder) - self.load(least) <= self.affinity_slack:
            return holder
        return least

    def assign(self, replica: int, seq_ids: Iterable[str], prefix_hash: int | None,
               num_prompt_tokens: int = 0) -> None:
        """The request was queued on ``replica``: its sequences are open there."""
        if prefix_hash is not None:
            if self.prefix_holder.get(prefix_hash) == replica:
                self.num_prefix_routed[replica] += 1
            self.prefix_holder[prefix_hash] = replica
            self.prefix_holder.move_to_end(prefix_hash)
            if len(self.prefix_holder) > MAX_PREFIXES:
                self.prefix_holder.popitem(last=False)
        self.num_routed[replica] += 1
        self.num_prompt_tokens[replica] += num_prompt_tokens
        for sid in seq_ids:
            if sid not in self.owner:
                self.owner[sid] = replica
                self.num_open[replica] += 1

    # -- the end of a sequence ---------------------------------------------------------------
    def owner_of(self, seq_id: str) -> int | None:
        return self.owner.get(seq_id)

    def release(self, seq_ids: Iterable[str]) -> dict[int, list[str]]:
        """Sequences that finished or were aborted, grouped by the replica that held them
        (unknown ids, already released, are left out: aborts are idempotent)."""
        by_replica: dict[int, list[str]] = {}
        for sid in seq_ids:
            replica = self.owner.pop(sid, None)
            if replica is not None:
                self.num_open[replica] -= 1
                by_replica.setdefault(replica, []).append(sid)
        return by_replica

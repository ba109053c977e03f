"""Parallel sampling (n > 1): the prompt is prefilled once, the samples fork from it.

The first sample (the leader) is queued like any request. Once it has sampled its first token,
its prompt is in the KV cache and the other samples fork from it (``Scheduler.fork``): each
shares every prompt block, the partial last one included, and recomputes only the last prompt
token, to sample its own first token with its own seed. Until then the others exist only here,
so aborting the group while it waits leaves nothing behind in the scheduler.
"""
from __future__ import annotations

from collections.abc import Iterable

from pagedllm.core.outputs import EngineCoreOutputs
from pagedllm.core.request import Request
from pagedllm.core.scheduler import Scheduler


def sample_request_ids(request_id: str, n: int) -> list[str]:
    """The scheduler request ids of a request's ``n`` samples (the request's own id when n = 1)."""
    return [request_id] if n == 1 else [f"{i}_{request_id}" for i in range(n)]


class ParallelSampling:
    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.pending: dict[str, list[Request]] = {}  # leader id -> samples waiting to fork

    def add(self, leader: Request, others: list[Request], validated: bool = False) -> None:
        self.scheduler.add_request(leader, validated)
        if others:
            self.pending[leader.request_id] = others

    def step(self, outputs: EngineCoreOutputs) -> None:
        """Fork the samples of every leader that produced its first token this step."""
        if not self.pending:
            return
        ready = [rid for rid, ids in zip(outputs.req_ids, outputs.new_token_ids)
                 if ids and rid in self.pending]
        for leader_id in ready:
            self.scheduler.fork([(leader_id, child) for child in self.pending.pop(leader_id)])

    def abort(self, request_ids: Iterable[str]) -> None:
        """Forget samples that have not forked yet (the group's leader or the samples aborted)."""
        drop = set(request_ids)
        for leader_id in [rid for rid in self.pending if rid in drop]:
            del self.pending[leader_id]
        for leader_id, children in self.pending.items():
            children[:] = [c for c in children if c.request_id not in drop]

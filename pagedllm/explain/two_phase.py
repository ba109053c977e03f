"""nano-vllm's two-phase rule, as a tiny model for the lesson's exercise.

nano-vllm schedules a step as either all prefill or all decode: first it tries to admit waiting
sequences whole (each must fit the token budget and get every block it needs); only if none was
admitted does it decode the running ones, each needing a new block exactly when its newest token
starts one (``len % block_size == 1``), preempting from the tail of the running queue when no
block is free. Lengths count every token, the newest (not yet in the cache) included.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.utils import cdiv


@dataclass
class TwoPhaseResult:
    phase: str  # "prefill" or "decode"
    scheduled: list[str]
    preempted: list[str] = field(default_factory=list)
    free_blocks_after: int = 0
    reasons: list[str] = field(default_factory=list)


def two_phase_step(block_size: int, free_blocks: int, running: list[tuple[str, int]],
                   waiting: list[tuple[str, int]], max_num_batched_tokens: int,
                   max_num_seqs: int = 256) -> TwoPhaseResult:
    reasons: list[str] = []
    free = free_blocks
    prefill: list[str] = []
    tokens = 0
    for name, length in waiting:  # phase 1: prefill, whole sequences from the queue head
        need = cdiv(length, block_size)
        if len(prefill) >= max_num_seqs:
            break
        if tokens + length > max_num_batched_tokens:
            reasons.append(f"prefill: {name} ({length} tokens) would exceed the budget "
                           f"{max_num_batched_tokens}: stop")
            break
        if need > free:
            reasons.append(f"prefill: {name} needs {need} blocks ({length} tokens / {block_size}), "
                           f"only {free} free: can_allocate fails, the prefill loop breaks")
            break
        free -= need
        tokens += length
        prefill.append(name)
        reasons.append(f"prefill: {name} admitted, {need} blocks")
    if prefill:
        reasons.append("some sequence was admitted, so this step is prefill only: running "
                       "sequences wait")
        return TwoPhaseResult("prefill", prefill, [], free, reasons)
    reasons.append("nothing admitted, so this step decodes the running queue")
    queue = list(running)
    scheduled: list[str] = []
    preempted: list[str] = []
    while queue:  # phase 2: decode, one token each, preempting from the tail
        name, length = queue.pop(0)
        need = 1 if length % block_size == 1 else 0
        while need > free:
            if queue:
                victim = queue.pop()
                preempted.append(victim[0])
                free += cdiv(victim[1] - 1, block_size)
                reasons.append(f"decode: {name} needs a block, none free: preempt {victim[0]} "
                               "(the tail of running)")
            else:
                preempted.append(name)
                reasons.append(f"decode: {name} needs a block, none free: preempt itself")
                break
        else:
            free -= need
            scheduled.append(name)
            why = (f"{length} % {block_size} == 1, its newest token starts a new block: takes 1 "
                   f"of {free + 1} free" if need else
                   f"{length} % {block_size} == {length % block_size} != 1, the token fits its "
                   "last block")
            reasons.append(f"decode: {name} (length {length}): {why}")
    return TwoPhaseResult("decode", scheduled, preempted, free, reasons)

"""Beam search inside the engine, scored as Hugging Face transformers scores it.

Each beam is a request in the scheduler (``is_beam``): once its sequence is computed it reports
the top-K logprobs of the next token and waits. When every live beam of a group has reported, the
group picks the K best continuations over all beams (K = max(2, 1 + #EOS) * width, as
transformers does), moves those that end (EOS, or the length limit) to the finished list with the
length penalty ``score = cum_logprob / generated_len ** length_penalty``, and keeps the ``width``
best open ones. A beam slot then takes over its parent's sequence plus the chosen token
(``Scheduler.reassign_beams``): blocks are shared by reference count and the first write into a
shared partial block copies it, so memory grows only with what the beams do not share.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from pagedllm.core.outputs import TokenLogprobs
from pagedllm.errors import ValidationError


@dataclass
class BeamSearchParams:
    """vLLM's BeamSearchParams."""
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0  # accepted for vLLM compatibility; beams are scored, not sampled
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.beam_width, int) or self.beam_width < 1:
            raise ValidationError(f"beam_width must be >= 1, got {self.beam_width!r}", "beam_width")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValidationError(f"max_tokens must be >= 1, got {self.max_tokens!r}", "max_tokens")
        for name in ("length_penalty", "temperature"):  # NaN would poison every score
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValidationError(f"{name} must be a finite number, got {v!r}", name)


@dataclass
class _Beam:
    slot_id: str
    score: float  # sum of logprobs of the generated tokens
    tokens: list[int] = field(default_factory=list)


@dataclass
class FinishedBeam:
    tokens: list[int]  # generated tokens (EOS included when it ended the beam)
    cum_logprob: float
    score: float  # cum_logprob / len(tokens) ** length_penalty
    finish_reason: str


class BeamSearchGroup:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: BeamSearchParams,
                 slot_ids: list[str], eos_token_ids: frozenset[int]) -> None:
        self.request_id = request_id
        self.prompt_text: str | None = None
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.slot_ids = slot_ids
        self.eos_token_ids = frozenset() if params.ignore_eos else eos_token_ids
        self.num_candidates = max(2, 1 + len(self.eos_token_ids)) * params.beam_width
        # Only the leader slot is live at first: transformers starts beams 1.. at -inf.
        self.beams: list[_Beam] = [_Beam(slot_ids[0], 0.0)]
        self.reports: dict[str, TokenLogprobs] = {}
        self.finished: list[FinishedBeam] = []
        self.improvement_possible = True
        self.done = False

    @staticmethod
    def num_logprobs(beam_width: int, num_eos: int) -> int:
        return max(2, 1 + num_eos) * beam_width

    def add_report(self, slot_id: str, logprobs: TokenLogprobs) -> None:
        self.reports[slot_id] = logprobs

    def ready(self) -> bool:
        return all(b.slot_id in self.reports for b in self.beams)

    def advance(self) -> tuple[list[tuple[str, str, int]], list[str]]:
        """One beam step. Returns (assignments (slot, parent slot, token), idle slot ids); sets
        ``done`` when the search is over."""
        p, width = self.params, self.params.beam_width
        gen_len = len(self.beams[0].tokens)
        candidates: list[tuple[float, int, int]] = []  # (accumulated logprob, beam index, token)
        for bi, beam in enumerate(self.beams):
            report = self.reports[beam.slot_id]
            # Entry 0 is the sampled (argmax) token; entries 1.. are the top-K by rank.
            for tok, lp in zip(report.token_ids[1:], report.logprobs[1:]):
                candidates.append((beam.score + lp, bi, tok))
        self.reports.clear()
        candidates.sort(key=lambda c: -c[0])
        candidates = candidates[:self.num_candidates]
        at_limit = gen_len + 1 >= p.max_tokens

        def hits(tok: int) -> bool:
            return at_limit or tok in self.eos_token_ids

        # Finished: only the first `width` ranks may finish (the rest are spares to continue).
        if self.improvement_possible:
            for score, bi, tok in candidates[:width]:
                if hits(tok):
                    beam = self.beams[bi]
                    reason = "length" if tok not in self.eos_token_ids else "stop"
                    self.finished.append(FinishedBeam(beam.tokens + [tok], score,
                                                      score / (gen_len + 1) ** p.length_penalty, reason))
            self.finished.sort(key=lambda f: -f.score)
            del self.finished[width:]
        # Next running beams: the best `width` continuations that did not end.
        open_ = [c for c in candidates if not hits(c[2])][:width]
        if not open_:
            self.done = True
            return [], [b.slot_id for b in self.beams]
        # transformers' early-stop heuristic (early_stopping=False): stop once the best open
        # beam, scored at its current length, cannot beat the worst finished one.
        if len(self.finished) == width and open_[0][0] / (gen_len + 1) ** p.length_penalty <= self.finished[-1].score:
            self.improvement_possible = False
        if not self.improvement_possible:
            self.done = True
            return [], [b.slot_id for b in self.beams]

        # Map continuations onto slots: a parent's first child keeps the parent's slot.
        used_parents: set[int] = set()
        free_slots = [s for s in self.slot_ids if s not in {b.slot_id for b in self.beams}]
        pending: list[tuple[float, int, int]] = []
        assignments: list[tuple[str, str, int]] = []
        new_beams: list[_Beam] = []
        for score, bi, tok in open_:
            parent = self.beams[bi]
            if bi not in used_parents:
                used_parents.add(bi)
                assignments.append((parent.slot_id, parent.slot_id, tok))
                new_beams.append(_Beam(parent.slot_id, score, parent.tokens + [tok]))
            else:
                pending.append((score, bi, tok))
        free_slots += [b.slot_id for i, b in enumerate(self.beams) if i not in used_parents]
        for (score, bi, tok), slot in zip(pending, free_slots):
            parent = self.beams[bi]
            assignments.append((slot, parent.slot_id, tok))
            new_beams.append(_Beam(slot, score, parent.tokens + [tok]))
        taken = {b.slot_id for b in new_beams}
        idle = [s for s in self.slot_ids if s not in taken]  # the caller frees these
        self.slot_ids = [s for s in self.slot_ids if s in taken]
        new_beams.sort(key=lambda b: -b.score)
        self.beams = new_beams
        return assignments, idle

    def results(self) -> list[FinishedBeam]:
        return list(self.finished)

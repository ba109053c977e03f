"""Beam search inside the engine, scored as Hugging Face transformers scores it.

Each beam is a request in the scheduler (``is_beam``): once its sequence is computed it reports
the top-K logprobs of the next token and waits. When every live beam of a group has reported, the
group picks the K best continuations over all beams (K = max(2, 1 + #EOS) * width, as
transformers does), moves those that end (EOS, or the length limit) to the finished list with the
length penalty ``score = cum_logprob / generated_len ** length_penalty``, and keeps the ``width``
best open ones. Each continuation is a new request forked from its parent beam
(``Scheduler.fork``): it shares the parent's blocks by reference count, the first write into a
shared partial block copies it, so memory grows only with what the beams do not share.
"""
from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field

from pagedllm.beam_search_params import BeamSearchParams
from pagedllm.core.outputs import EngineCoreOutputs, FinishedBeam, TokenLogprobs
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.scheduler import Scheduler
from pagedllm.errors import ValidationError
from pagedllm.sampling_params import SamplingParams

MAX_BEAM_LOGPROBS = 20  # top-K per step the runner reports; K = max(2, 1 + #EOS) * width


@dataclass
class _Beam:
    request_id: str  # the scheduler request holding this beam's sequence
    score: float  # sum of logprobs of the generated tokens
    tokens: list[int] = field(default_factory=list)


class BeamSearchGroup:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: BeamSearchParams,
                 first_beam_id: str, eos_token_ids: frozenset[int]) -> None:
        self.request_id = request_id
        self.prompt_text: str | None = None
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.eos_token_ids = frozenset() if params.ignore_eos else eos_token_ids
        self.num_candidates = max(2, 1 + len(self.eos_token_ids)) * params.beam_width
        # One beam at first: transformers starts beams 1.. at -inf.
        self.beams: list[_Beam] = [_Beam(first_beam_id, 0.0)]
        self.reports: dict[str, TokenLogprobs] = {}
        self.finished: list[FinishedBeam] = []
        self.improvement_possible = True
        self.done = False

    @staticmethod
    def num_logprobs(beam_width: int, num_eos: int) -> int:
        return max(2, 1 + num_eos) * beam_width

    def add_report(self, beam_id: str, logprobs: TokenLogprobs) -> None:
        self.reports[beam_id] = logprobs

    def ready(self) -> bool:
        return all(b.request_id in self.reports for b in self.beams)

    def advance(self) -> list[tuple[str, _Beam]]:
        """One beam step. Returns the new beams, best first, each with its parent's request id
        (the caller gives each a request); sets ``done`` when the search is over."""
        p, width = self.params, self.params.beam_width
        gen_len = len(self.beams[0].tokens)
        candidates: list[tuple[float, int, int]] = []  # (accumulated logprob, beam index, token)
        for bi, beam in enumerate(self.beams):
            report = self.reports[beam.request_id]
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
            return []
        # transformers' early-stop heuristic (early_stopping=False): stop once the best open
        # beam, scored at its current length, cannot beat the worst finished one.
        if len(self.finished) == width and open_[0][0] / (gen_len + 1) ** p.length_penalty <= self.finished[-1].score:
            self.improvement_possible = False
        if not self.improvement_possible:
            self.done = True
            return []
        return [(self.beams[bi].request_id, _Beam("", score, self.beams[bi].tokens + [tok]))
                for score, bi, tok in open_]

    def results(self) -> list[FinishedBeam]:
        return list(self.finished)


class BeamSearch:
    """The engine's beam searches: each group's beams as scheduler requests, advanced when all
    of a group's beams have reported."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.groups: dict[str, BeamSearchGroup] = {}
        self._group_of: dict[str, BeamSearchGroup] = {}  # beam request id -> its group
        self._params: dict[str, tuple[SamplingParams, float, int]] = {}  # per group: beam params
        self._ids = itertools.count()

    def add(self, request_id: str, prompt_token_ids: list[int], params: BeamSearchParams,
            eos_token_ids: frozenset[int], arrival_time: float, priority: int = 0) -> BeamSearchGroup:
        k = BeamSearchGroup.num_logprobs(params.beam_width, 0 if params.ignore_eos else len(eos_token_ids))
        if k > MAX_BEAM_LOGPROBS:
            raise ValidationError(f"beam_width={params.beam_width} needs {k} logprobs per step; "
                                  f"the limit is {MAX_BEAM_LOGPROBS}", "n")
        # Greedy with top-k logprobs: the runner reports the distribution; the group chooses.
        beam_params = SamplingParams(temperature=0.0, max_tokens=params.max_tokens, logprobs=k,
                                     ignore_eos=True, detokenize=False)
        first = self._new_request(request_id, prompt_token_ids, beam_params, eos_token_ids,
                                  arrival_time, priority, [])
        self.scheduler.add_request(first)
        group = BeamSearchGroup(request_id, prompt_token_ids, params, first.request_id, eos_token_ids)
        self.groups[request_id] = group
        self._group_of[first.request_id] = group
        self._params[request_id] = (beam_params, arrival_time, priority)
        return group

    def _new_request(self, request_id: str, prompt: list[int], params: SamplingParams,
                     eos: frozenset[int], arrival_time: float, priority: int, tokens: list[int]) -> Request:
        req = Request(f"beam{next(self._ids)}_{request_id}", prompt, params, eos,
                      arrival_time=arrival_time, priority=priority, output_token_ids=tokens)
        req.is_beam = True
        return req

    def step(self, outputs: EngineCoreOutputs, stalled: bool) -> list[BeamSearchGroup]:
        """Take the step's reports; advance every group whose beams all reported. Returns the
        groups that finished. ``stalled``: the step scheduled nothing while requests wait."""
        if not self.groups:
            return []
        touched: dict[str, BeamSearchGroup] = {}
        for rid, logprobs in outputs.new_logprobs.items():
            group = self._group_of.get(rid)
            if group is not None:
                group.add_report(rid, logprobs[-1])
                touched[group.request_id] = group
        done = []
        for group in touched.values():
            if group.ready():
                self._advance(group)
                if group.done:
                    done.append(group)
        if stalled:
            self._release_stalled()
        return done

    def _advance(self, group: BeamSearchGroup) -> None:
        old_ids = [b.request_id for b in group.beams]
        continuations = group.advance()
        params, arrival_time, priority = self._params[group.request_id]
        forks = []
        for parent_id, beam in continuations:
            child = self._new_request(group.request_id, group.prompt_token_ids, params,
                                      group.eos_token_ids, arrival_time, priority, beam.tokens)
            beam.request_id = child.request_id
            forks.append((parent_id, child))
            self._group_of[child.request_id] = group
        group.beams = [beam for _, beam in continuations]
        # The old beams end once their continuations hold a share of their blocks.
        self.scheduler.fork(forks, finish=old_ids)
        for rid in old_ids:
            del self._group_of[rid]
        if group.done:
            self._forget(group)

    def _release_stalled(self) -> None:
        """A group waits for a beam that lost its KV (preempted) while its other beams, idle,
        hold the memory that beam needs: give their memory back too, so that the group resumes
        together (their full blocks stay in the prefix cache)."""
        requests = self.scheduler.requests
        for group in self.groups.values():
            statuses = [requests[b.request_id].status for b in group.beams if b.request_id in requests]
            if RequestStatus.RUNNING in statuses and any(s != RequestStatus.RUNNING for s in statuses):
                self.scheduler.preempt_requests(b.request_id for b in group.beams)

    def abort(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            group = self.groups.get(rid)
            if group is not None:
                ids = [b.request_id for b in group.beams]
                self._forget(group)
                for bid in ids:
                    self._group_of.pop(bid, None)
                self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)

    def _forget(self, group: BeamSearchGroup) -> None:
        del self.groups[group.request_id]
        del self._params[group.request_id]

    def has_unfinished(self) -> bool:
        return bool(self.groups)

"""OutputProcessor: EngineCoreOutputs -> RequestOutputs (detokenize, stop strings, logprobs,
stream deltas, the gathering of n > 1 samples under their parent request, and the beams of a
beam search, decoded once it ends)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from pagedllm.core.outputs import EngineCoreOutputs, FinishedBeam, TokenLogprobs
from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.engine.token_decode import decode_function
from pagedllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from pagedllm.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class ParentRequest:
    """The user's request; its ``n`` samples run as child requests in the scheduler."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    children: list["RequestState"] = field(default_factory=list)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int = 0
    num_finished: int = 0

    @property
    def finished(self) -> bool:
        return self.num_finished == len(self.children)


@dataclass
class BeamSearchRequest:
    """A beam search the front end waits on: its beams come back whole, once, best first."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]


@dataclass
class RequestState:
    """One child sequence (index ``index`` among the parent's n)."""
    request_id: str
    index: int
    parent: ParentRequest
    detokenizer: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_sent_tokens: int = 0
    num_sent_chars: int = 0


class OutputProcessor:
    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer
        self._decode = None if tokenizer is None else decode_function(tokenizer)
        self.request_states: dict[str, RequestState] = {}
        self.parents: dict[str, ParentRequest] = {}
        self.beam_searches: dict[str, BeamSearchRequest] = {}

    def add_beam_search(self, request: BeamSearchRequest) -> None:
        self.beam_searches[request.request_id] = request

    def add_request(self, parent: ParentRequest, child_ids: list[str]) -> None:
        params = parent.params
        self.parents[parent.request_id] = parent
        if params.prompt_logprobs is not None:
            parent.prompt_logprobs = [None] * len(parent.prompt_token_ids)
        for i, cid in enumerate(child_ids):
            detok = None
            if self.tokenizer is not None and params.detokenize:
                detok = IncrementalDetokenizer(self.tokenizer, parent.prompt_token_ids,
                                               params.skip_special_tokens, params.stop,
                                               params.include_stop_str_in_output, params.min_tokens,
                                               self._decode)
            state = RequestState(cid, i, parent, detok,
                                 logprobs=[] if params.logprobs is not None else None,
                                 cumulative_logprob=0.0 if params.logprobs is not None else None)
            parent.children.append(state)
            self.request_states[cid] = state

    def has_unfinished_requests(self) -> bool:
        return bool(self.parents) or bool(self.beam_searches)

    def get_num_unfinished_requests(self) -> int:
        return len(self.parents) + len(self.beam_searches)

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        """Forget parents (or children, or beam searches) and return the ids the engine core
        must abort (a beam search goes by its own id)."""
        child_ids: list[str] = []
        for rid in request_ids:
            parent = self.parents.pop(rid, None)
            if parent is not None:
                for child in parent.children:
                    self.request_states.pop(child.request_id, None)
                    child_ids.append(child.request_id)
            elif self.beam_searches.pop(rid, None) is not None:
                child_ids.append(rid)
            elif rid in self.request_states:
                child_ids.append(rid)
                state = self.request_states.pop(rid)
                self.parents.pop(state.parent.request_id, None)
        return child_ids

    def process_outputs(self, outputs: EngineCoreOutputs) -> tuple[list[RequestOutput], list[tuple[str, str]]]:
        """Returns the RequestOutputs to show and the (child id, stop string) pairs that the
        scheduler must now finish because a stop string appeared in their text."""
        now = time.monotonic()
        results: dict[str, RequestOutput] = {}
        stopped_by_string: list[tuple[str, str]] = []
        states = self.request_states
        for rid, num_cached in outputs.num_cached_tokens.items():
            state = states.get(rid)
            if state is not None:
                state.parent.num_cached_tokens = num_cached
        finished, all_logprobs, all_prompt_logprobs = (outputs.finished, outputs.new_logprobs,
                                                       outputs.new_prompt_logprobs)
        for rid, new_ids in zip(outputs.req_ids, outputs.new_token_ids):
            state = states.get(rid)
            # A child the front stopped (a stop string) may still have rows in flight: a core
            # in its own process steps on until it reads the finish. They are not its output.
            if state is None or state.finish_reason is not None:
                continue
            parent = state.parent
            if new_ids:
                if parent.metrics.first_token_time is None:
                    parent.metrics.first_token_time = now
                parent.metrics.last_token_time = now
            if all_prompt_logprobs and parent.prompt_logprobs is not None:
                chunk = all_prompt_logprobs.get(rid)
                if chunk is not None:
                    self._add_prompt_logprobs(parent, chunk.start, chunk.entries)
            finish_reason, stop_reason = finished.get(rid, (None, None))
            state.token_ids.extend(new_ids)
            new_logprobs = all_logprobs.get(rid) if all_logprobs else None
            if new_logprobs and state.logprobs is not None:
                for tl in new_logprobs:
                    state.logprobs.append(self._logprob_dict(tl))
                    state.cumulative_logprob += tl.logprobs[0]
            if state.detokenizer is not None and new_ids:
                finish_reason, stop_reason = self._update_text(state, new_ids, finish_reason, stop_reason,
                                                               stopped_by_string)
            if finish_reason is not None:
                state.finish_reason, state.stop_reason = finish_reason, stop_reason
                parent.num_finished += 1
            self._publish(results, parent, state, now)
        for rid, beams in outputs.finished_beams.items():
            beam_search = self.beam_searches.pop(rid, None)
            if beam_search is not None:  # None: aborted while its last step ran
                results[rid] = self._beam_output(beam_search, beams)
        return list(results.values()), stopped_by_string

    @staticmethod
    def _update_text(state: RequestState, new_ids: list[int], finish_reason: str | None,
                     stop_reason: int | str | None, stopped_by_string: list[tuple[str, str]]
                     ) -> tuple[str | None, int | str | None]:
        """Detokenize ``new_ids`` into ``state``; the finish, a stop string's included."""
        # The EOS / stop token itself is never shown as text.
        ids = new_ids
        ended_by_token = finish_reason == "stop" and (stop_reason is None or isinstance(stop_reason, int))
        if ended_by_token and not state.parent.params.include_stop_str_in_output:
            ids = new_ids[:-1]
        stop_str = state.detokenizer.update(ids)
        if stop_str is None:
            return finish_reason, stop_reason
        if finish_reason is None:  # still running in the scheduler: finish it there
            stopped_by_string.append((state.request_id, stop_str))
        return "stop", stop_str

    def _publish(self, results: dict[str, RequestOutput], parent: ParentRequest, state: RequestState,
                 now: float) -> None:
        """The parent's output of this step, if it shows one; a finished parent is forgotten."""
        ro = self._make_output(parent, state)
        if ro is not None:
            prev = results.get(parent.request_id)
            if prev is not None and parent.params.output_kind == RequestOutputKind.DELTA:
                ro.outputs = prev.outputs + ro.outputs  # n > 1: every child's delta of this step
            results[parent.request_id] = ro
        if parent.finished:
            parent.metrics.finished_time = now
            self.parents.pop(parent.request_id, None)
            for child in parent.children:
                self.request_states.pop(child.request_id, None)

    def _beam_output(self, request: BeamSearchRequest, beams: list[FinishedBeam]) -> RequestOutput:
        completions = []
        for i, beam in enumerate(beams):
            shown = beam.tokens[:-1] if beam.finish_reason == "stop" else beam.tokens  # EOS: no text
            text = self.tokenizer.decode(shown, skip_special_tokens=True) if self.tokenizer is not None else ""
            completions.append(CompletionOutput(i, text, list(beam.tokens), beam.cum_logprob, None,
                                                beam.finish_reason))
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, None,
                             completions, True, beam_scores=[b.score for b in beams])

    def _add_prompt_logprobs(self, parent: ParentRequest, start: int, entries: list[TokenLogprobs]) -> None:
        assert parent.prompt_logprobs is not None
        for i, tl in enumerate(entries):
            pos = start + i
            if 0 < pos < len(parent.prompt_logprobs):
                parent.prompt_logprobs[pos] = self._logprob_dict(tl)

    def _logprob_dict(self, tl: TokenLogprobs) -> dict[int, Logprob]:
        d: dict[int, Logprob] = {}
        for tok, lp, rank in zip(tl.token_ids, tl.logprobs, tl.ranks):
            if tok not in d:
                text = self._decode([tok], skip_special_tokens=False) if self._decode is not None else None
                d[tok] = Logprob(lp, rank, text)
        return d

    def _make_output(self, parent: ParentRequest, state: RequestState) -> RequestOutput | None:
        kind = parent.params.output_kind
        if kind == RequestOutputKind.FINAL_ONLY:
            if not parent.finished:
                return None
            completions = [self._completion(c, delta=False) for c in parent.children]
        elif kind == RequestOutputKind.DELTA:
            completions = [self._completion(state, delta=True)]
        else:
            completions = [self._completion(c, delta=False) for c in parent.children]
        return RequestOutput(
            request_id=parent.request_id, prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids, prompt_logprobs=parent.prompt_logprobs,
            outputs=completions, finished=parent.finished,
            num_cached_tokens=parent.num_cached_tokens, metrics=parent.metrics)

    def _completion(self, state: RequestState, delta: bool) -> CompletionOutput:
        finished = state.finish_reason is not None
        detok = state.detokenizer
        if delta:
            tokens = state.token_ids[state.num_sent_tokens:]
            logprobs = state.logprobs[state.num_sent_tokens:] if state.logprobs is not None else None
            state.num_sent_tokens = len(state.token_ids)
            text = ""
            if detok is not None:
                text = detok.text_to_stream(state.num_sent_chars, finished)
                state.num_sent_chars += len(text)
        else:
            tokens, logprobs = list(state.token_ids), state.logprobs
            text = detok.output_text if detok is not None else ""
        return CompletionOutput(index=state.index, text=text, token_ids=tokens,
                                cumulative_logprob=state.cumulative_logprob, logprobs=logprobs,
                                finish_reason=state.finish_reason, stop_reason=state.stop_reason)

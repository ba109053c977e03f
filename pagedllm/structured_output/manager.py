"""StructuredOutputManager: what the engine core calls for constrained requests.

* ``add``: the constraint is checked now (ValidationError: nothing queued), its grammar compiles
  in a small thread pool, cached by (kind, spec), and the request is held here, as vLLM's
  WAITING_FOR_FSM, until it is ready; ``release_ready`` (start of each step) lets it into the
  scheduler through the caller's ``enter``, in arrival order. The step loop never compiles.
* One matcher per sequence, copied from the compiled grammar when the sequence first samples and
  fed the sequence's accepted tokens, so forks (n > 1) and resumed (preempted) sequences need no
  special case; ``accept`` advances it with the tokens each step appended.
* ``grammar_bitmask``: after ``schedule()``, a bitmask per row that samples this step (a partial
  prefill samples nothing and gets none; a request verifying drafts gets 1 + len(drafts) rows).
  Once a grammar is complete the mask allows only EOS, so the request ends there as any request
  ends at EOS ("stop"), and its text is exactly the grammar's.
* ``truncate_drafts``: drafts stop at the first token the grammar rejects.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass
from typing import Any

from pagedllm.core.outputs import EngineCoreOutputs, SchedulerOutput
from pagedllm.core.request import Request
from pagedllm.errors import ValidationError
from pagedllm.structured_output.backend import GrammarBackend
from pagedllm.structured_output.grammar import grammar_source
from pagedllm.structured_outputs_params import StructuredOutputsParams

logger = logging.getLogger("pagedllm")
GrammarKey = tuple[str, str]
MAX_CACHED_GRAMMARS = 256


@dataclass(slots=True)
class _Held:
    key: GrammarKey
    sample_ids: list[str]
    enter: Callable[[], None]


class StructuredOutputManager:
    def __init__(self, tokenizer_path: str, max_workers: int = 2,
                 disable_any_whitespace: bool | None = None) -> None:
        self.tokenizer_path = tokenizer_path
        self.max_workers = max_workers
        # The engine's structured_outputs_config default, for requests that leave it unset.
        self.disable_any_whitespace = disable_any_whitespace
        self.backend: GrammarBackend | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._grammars: dict[GrammarKey, Future] = {}  # the cache: compiled or compiling
        self._held: dict[str, _Held] = {}  # request id -> held until its grammar is ready
        self._keys: dict[str, GrammarKey] = {}  # sequence id -> its grammar
        self._matchers: dict[str, Any] = {}  # sequence id -> its matcher (made on first sample)
        self.num_compiles = 0  # grammars compiled (cache misses), for tests and metrics

    # -- admission ---------------------------------------------------------------------------
    def add(self, request_id: str, params: StructuredOutputsParams, sample_ids: list[str],
            eos_token_ids: frozenset[int], enter: Callable[[], None]) -> None:
        if (self.disable_any_whitespace is not None and params.disable_any_whitespace is None
                and params.whitespace_pattern is None):
            params = dataclasses.replace(params, disable_any_whitespace=self.disable_any_whitespace)
        key = params.key
        future = self._grammars.get(key)
        if future is None:
            source = grammar_source(params)  # ValidationError here: nothing is held or queued
            if self.backend is None:
                self.backend = GrammarBackend(self.tokenizer_path, eos_token_ids)
                self._pool = ThreadPoolExecutor(self.max_workers, thread_name_prefix="pagedllm-grammar")
            future = self._grammars[key] = self._pool.submit(self.backend.compile, source)
            self.num_compiles += 1
            if len(self._grammars) > MAX_CACHED_GRAMMARS:
                self._evict()
        for sid in sample_ids:
            self._keys[sid] = key
        if future.done() and not self._held:
            self._enter(request_id, _Held(key, sample_ids, enter))
        else:
            self._held[request_id] = _Held(key, sample_ids, enter)

    def _evict(self) -> None:
        """Drop the oldest compiled grammars no sequence uses (clients choose schemas freely)."""
        in_use = set(self._keys.values())
        for key in [k for k in self._grammars if k not in in_use][:len(self._grammars) // 4]:
            if self._grammars[key].done():
                del self._grammars[key]

    def release_ready(self, wait_s: float = 0.0) -> list[str]:
        """Let in every held request whose grammar is ready, in arrival order; returns the
        sequence ids of requests whose grammar failed to compile (the caller aborts them).
        ``wait_s``: with nothing else to run, wait that long for the oldest grammar rather than
        spin through empty steps."""
        if wait_s and self._held:
            oldest = self._grammars[next(iter(self._held.values())).key]
            futures_wait([oldest], timeout=wait_s)
        failed: list[str] = []
        for rid in [r for r, h in self._held.items() if self._grammars[h.key].done()]:
            held = self._held.pop(rid)
            if not self._enter(rid, held):
                failed.extend(held.sample_ids)
        return failed

    def _enter(self, request_id: str, held: _Held) -> bool:
        future = self._grammars[held.key]
        if future.exception() is not None:
            logger.error("request %s: its grammar did not compile: %s", request_id, future.exception())
            del self._grammars[held.key]  # not cached: the next request tries again
            for sid in held.sample_ids:
                self._keys.pop(sid, None)
            return False
        try:
            held.enter()
        except ValidationError as e:  # checked at add; only a changed scheduler gets here
            logger.error("request %s could not be queued: %s", request_id, e)
            return False
        return True

    def has_held(self) -> bool:
        return bool(self._held)

    def is_held(self, request_id: str) -> bool:
        return request_id in self._held

    def abort(self, request_ids: Iterable[str]) -> None:
        """Forget requests (or sequences) held here, and the matchers of sequences aborted or
        finished by the front end (stop strings)."""
        drop = set(request_ids)
        for rid in [r for r, h in self._held.items() if r in drop or drop & set(h.sample_ids)]:
            for sid in self._held.pop(rid).sample_ids:
                drop.add(sid)
        for sid in drop:
            self._keys.pop(sid, None)
            self._matchers.pop(sid, None)

    # -- each step ---------------------------------------------------------------------------
    def _matcher(self, seq_id: str, req: Request) -> Any | None:
        matcher = self._matchers.get(seq_id)
        if matcher is None:
            key = self._keys.get(seq_id)
            if key is None:
                return None
            matcher = self._grammars[key].result().deep_copy()
            matcher.consume_tokens(req.output_token_ids)  # a fork's, a resumed sequence's
            self._matchers[seq_id] = matcher
        return matcher

    def grammar_bitmask(self, so: SchedulerOutput, requests: dict[str, Request]
                        ) -> dict[str, bytes] | None:
        """The bitmask rows of the structured requests that sample in this step's work order."""
        if not self._keys:
            return None
        spec = so.scheduled_spec_decode_tokens
        batch: list[tuple[str, Any]] = []
        with_drafts: list[tuple[str, Any, list[int]]] = []
        for rid in so.num_scheduled_tokens:
            req = requests.get(rid)
            if rid not in self._keys or req is None:
                continue
            drafts = spec.get(rid, ())
            if req.num_computed_tokens - len(drafts) < req.num_tokens:
                continue  # a partial prefill: it samples nothing this step
            matcher = self._matcher(rid, req)
            if drafts:
                with_drafts.append((rid, matcher, list(drafts)))
            else:
                batch.append((rid, matcher))
        if not batch and not with_drafts:
            return None
        assert self.backend is not None
        masks: dict[str, bytes] = {}
        if batch:
            packed, size = self.backend.fill_bitmasks([m for _, m in batch]), self.backend.row_bytes
            for i, (rid, _) in enumerate(batch):
                masks[rid] = packed[i * size:(i + 1) * size]
        for rid, matcher, drafts in with_drafts:
            rows = [self.backend.fill_bitmask(matcher)]
            for tok in drafts:  # the state after each draft prefix, then back
                matcher.consume_token(tok)
                rows.append(self.backend.fill_bitmask(matcher))
            matcher.rollback(len(drafts))
            masks[rid] = b"".join(rows)
        return masks

    def accept(self, outputs: EngineCoreOutputs, requests: dict[str, Request]) -> None:
        """Advance the matchers with the tokens this step appended; drop finished sequences'."""
        if not self._keys:
            return
        for rid, new_ids in zip(outputs.req_ids, outputs.new_token_ids):
            if not new_ids or rid not in self._keys:
                continue
            matcher = self._matchers.get(rid)
            if matcher is None:  # made now from the accepted tokens, the new ones included
                req = requests.get(rid)
                if req is not None:
                    self._matcher(rid, req)
            elif matcher.is_stopped():
                continue  # complete: the token was EOS, and the scheduler ends the sequence
            elif not matcher.consume_tokens(new_ids):
                logger.warning("request %s: token(s) %s outside its grammar (%s)", rid, new_ids,
                               matcher.get_error())
        for rid in outputs.finished:
            self._keys.pop(rid, None)
            self._matchers.pop(rid, None)

    def has_grammar(self, seq_id: str) -> bool:
        return seq_id in self._keys

    def truncate_drafts(self, seq_id: str, drafts: list[int]) -> list[int]:
        matcher = self._matchers.get(seq_id)
        if matcher is None or not drafts:
            return drafts
        return drafts[:matcher.validate_tokens(drafts)]

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

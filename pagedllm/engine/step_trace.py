"""The step trace: one JSON record per engine step, built from what the step reported.

``StepRecorder`` turns a step's (SchedulerOutput, EngineCoreOutputs, StepTimings) into a plain
dict (schema: docs/trace_schema.md, ``"v": 1``). It never re-derives scheduling decisions: who
ran, why it was preempted, who was skipped and the block events all come from the step's own
records. The one thing those records do not repeat is a cached request's prompt length (the
runner-style diffs only carry new tokens), so a tiny per-request table, fed by the same diffs,
remembers it; that is what tells a prefill chunk from a decode and a recompute from either.

``StepTraceWriter`` is the ``--trace-file`` observer (``LLMEngine.step_observers``): JSON lines,
flushed every step so a crash keeps what came before. Torch-free, like the rest of engine/.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import IO, Any

from pagedllm.config import EngineConfig
from pagedllm.core.block_pool import NULL_BLOCK_ID
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.outputs import EngineCoreOutputs, SchedulerOutput
from pagedllm.core.scheduler import Scheduler
from pagedllm.engine.engine_stats import StepTimings
from pagedllm.errors import PagedLLMError

SCHEMA_VERSION = 1
# Why a request took its share of the budget (the "kind" of a scheduled entry).
KINDS = ("prefill", "decode", "draft", "recompute")


@dataclass(slots=True)
class _Known:
    """What the trace remembers of a request the runner holds."""
    num_prompt_tokens: int  # -1: seen only as a diff (the recorder was attached mid-run)
    num_tokens: int  # prompt + outputs the scheduler has sent so far
    recomputing: bool  # resumed after preemption and not yet caught up


def block_map(kv: KVCacheManager) -> dict[str, Any]:
    """A snapshot of the KV cache, read-only: every block's ref count, the blocks each request
    holds, and the free blocks that still hold a prefix-cache hash (reusable until evicted).

    ``tables`` lists every block a request holds over all KV cache groups (group order, null
    slots left out), so every block with ref_cnt > 0 has an owner; with one group it is that
    group's block table. With several groups (or one sliding-window group, whose table has null
    slots), ``group_tables`` keeps each group's table as the runner sees it (-1: a slot that left
    the window) and ``sliding_windows`` says which group is which."""
    blocks = kv.block_pool.blocks
    group_tables = {rid: kv.get_block_ids(rid) for rid in kv.req_to_blocks}
    snapshot: dict[str, Any] = {
        "num_blocks": len(blocks),
        "block_size": kv.block_size,
        "ref_cnt": [b.ref_cnt for b in blocks],
        "tables": {rid: [b for table in tables for b in table if b != NULL_BLOCK_ID]
                   for rid, tables in group_tables.items()},
        "cached_free": [b.block_id for b in blocks if b.ref_cnt == 0 and b.block_hash is not None],
    }
    if kv.sliding_windows != (None,):  # otherwise ``tables`` is the one table, exactly
        snapshot["group_tables"] = group_tables
        snapshot["sliding_windows"] = list(kv.sliding_windows)
    return snapshot


class StepRecorder:
    """Builds the step records. ``kv`` (optional) is read for block-map snapshots, at most one
    every ``block_map_interval_s`` seconds (0: every step; None: never)."""

    def __init__(self, max_num_batched_tokens: int, kv: KVCacheManager | None = None,
                 block_map_interval_s: float | None = 1.0) -> None:
        self.max_num_batched_tokens = max_num_batched_tokens
        self.kv = kv
        self.block_map_interval_s = block_map_interval_s
        self.num_steps = 0
        self._known: dict[str, _Known] = {}
        self._external: list[str] = []
        self._last_map = float("-inf")

    def observe(self, so: SchedulerOutput, outs: EngineCoreOutputs, timings: StepTimings,
                force_block_map: bool = False) -> dict[str, Any]:
        """The record of one step; call it for every step, in order (the table follows diffs)."""
        now = time.time()
        self.num_steps += 1
        admitted, resumed, starts = self._apply(so)
        spec = so.scheduled_spec_decode_tokens
        spent = dict.fromkeys(KINDS, 0)
        reqs = []
        for rid, n in so.num_scheduled_tokens.items():
            entry = self._classify(self._known[rid], rid, n, starts[rid], spec.get(rid))
            num_drafts = entry.get("drafts", 0)
            # A draft-verification entry: its one real token is a decode, the rest drafts.
            spent["decode" if entry["kind"] == "draft" else entry["kind"]] += n - num_drafts
            spent["draft"] += num_drafts
            reqs.append(entry)
        s = outs.scheduler_stats
        record: dict[str, Any] = {
            "v": SCHEMA_VERSION,
            "step": self.num_steps,
            "t": round(now, 6),
            "ms": {"schedule": _ms(timings.schedule_s), "execute": _ms(timings.execute_s),
                   "update": _ms(timings.update_s)},
            "budget": {"max": self.max_num_batched_tokens, "used": so.total_num_scheduled_tokens,
                       **spent},
            "reqs": reqs,
            "admitted": admitted,
            "resumed": resumed,
            "skipped": list(so.skipped_req_ids),
            "preempted": [{"id": v, "needed_by": by} for v, by in so.preempted_by.items()],
            "finished": [{"id": rid, "reason": reason} for rid, (reason, _) in outs.finished.items()]
                        + [{"id": rid, "reason": "external"} for rid in self._external],
            "cached_tokens": dict(outs.num_cached_tokens),
            "queues": {"running": s.num_running_reqs, "waiting": s.num_waiting_reqs},
            "kv_usage": round(s.kv_cache_usage, 4),
            "tokens": {"prompt": s.num_prompt_tokens, "generation": s.num_generation_tokens},
            "prefix_cache": {"queries": s.prefix_cache_queries, "hits": s.prefix_cache_hits},
            "spec": {"drafts": s.num_drafts, "draft_tokens": s.num_draft_tokens,
                     "accepted": s.num_accepted_tokens},
            "blocks": {"allocated": s.num_blocks_allocated, "freed": s.num_blocks_freed,
                       "evicted": s.num_blocks_evicted, "copied": s.num_blocks_copied,
                       "copies": [list(c) for c in so.block_copies]},
        }
        for rid in outs.finished:  # freed now; the next step's finished_req_ids repeats it
            self._known.pop(rid, None)
        if self.kv is not None and self._block_map_due(now, force_block_map):
            record["block_map"] = block_map(self.kv)
        return record

    def request_block_map(self) -> None:
        """Put a block map in the next record (a new viewer needs one at once)."""
        self._last_map = float("-inf")

    def skip(self, so: SchedulerOutput, outs: EngineCoreOutputs) -> None:
        """Follow a step without building its record (a sampled stream drops most steps, but
        the table must see every diff)."""
        self.num_steps += 1
        self._apply(so)
        for rid in outs.finished:
            self._known.pop(rid, None)

    def _apply(self, so: SchedulerOutput) -> tuple[list[str], list[str], dict[str, int]]:
        """Follow the step's diffs (as a runner does): returns the admitted and resumed ids, and
        each scheduled request's computed tokens before this step."""
        known = self._known
        # Still known here: finished outside the scheduler's update since the last step (an
        # abort, a stop string, a beam group's end); reported with reason "external".
        self._external = [rid for rid in so.finished_req_ids if known.pop(rid, None) is not None]
        for rid in so.preempted_req_ids:
            known.pop(rid, None)
        admitted, resumed, starts = [], [], {}
        for new in so.scheduled_new_reqs:
            # Sent whole: a first admission, a fork, or a resume after preemption (its outputs
            # so far come along and are computed again).
            is_resume = bool(new.output_token_ids)
            (resumed if is_resume else admitted).append(new.req_id)
            known[new.req_id] = _Known(len(new.prompt_token_ids),
                                       len(new.prompt_token_ids) + len(new.output_token_ids), is_resume)
            starts[new.req_id] = new.num_computed_tokens
        cached = so.scheduled_cached_reqs
        for rid, num_computed, new_ids in zip(cached.req_ids, cached.num_computed_tokens,
                                              cached.new_token_ids):
            entry = known.get(rid)
            if entry is None:  # attached mid-run: the prompt length is unknown
                entry = known[rid] = _Known(-1, num_computed, False)
            entry.num_tokens += len(new_ids)
            starts[rid] = num_computed
        return admitted, resumed, starts

    def _classify(self, known: _Known, rid: str, n: int, start: int,
                  drafts: list[int] | None) -> dict[str, Any]:
        num_drafts = len(drafts) if drafts else 0
        entry: dict[str, Any] = {"id": rid, "n": n, "start": start}
        if num_drafts:
            entry["drafts"] = num_drafts
        end = start + n - num_drafts
        if known.recomputing:
            kind = "recompute"
            if end >= known.num_tokens:
                known.recomputing = False  # caught up: decodes from here on
        elif 0 <= start < known.num_prompt_tokens:
            kind = "prefill"
            entry["prompt"] = known.num_prompt_tokens
        elif known.num_prompt_tokens < 0 and n - num_drafts > 1:
            kind = "prefill"  # prompt length unknown; more than one new token is a prefill chunk
        else:
            kind = "draft" if num_drafts else "decode"
        entry["kind"] = kind
        return entry

    def _block_map_due(self, now: float, force: bool) -> bool:
        interval = self.block_map_interval_s
        if not force and (interval is None or now - self._last_map < interval):
            return False
        self._last_map = now
        return True


def _ms(seconds: float) -> float:
    return round(seconds * 1000.0, 3)


class StepTraceWriter:
    """The ``trace_file`` observer: one JSON line per step (plus a header line first)."""

    def __init__(self, path: str, max_num_batched_tokens: int, kv: KVCacheManager | None = None,
                 block_map_interval_s: float | None = 1.0) -> None:
        self.path = path
        self.recorder = StepRecorder(max_num_batched_tokens, kv, block_map_interval_s)
        self._file: IO[str] | None = open(path, "w", encoding="utf-8")
        header = {"v": SCHEMA_VERSION, "header": True, "t": round(time.time(), 6),
                  "max_num_batched_tokens": max_num_batched_tokens,
                  "num_blocks": kv.num_blocks if kv is not None else None,
                  "block_size": kv.block_size if kv is not None else None}
        self._write(header)

    @classmethod
    def for_config(cls, config: EngineConfig, scheduler: Scheduler) -> "StepTraceWriter":
        """The engine's one-line hook: trace this scheduler's steps into the configured file."""
        path = config.observability_config.trace_file
        assert path, "no trace_file configured"
        return cls(path, scheduler.max_num_batched_tokens, scheduler.kv_cache_manager)

    def __call__(self, so: SchedulerOutput, outs: EngineCoreOutputs, timings: StepTimings) -> None:
        if self._file is not None:
            self._write(self.recorder.observe(so, outs, timings))

    def _write(self, record: dict[str, Any]) -> None:
        assert self._file is not None
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_trace(path: str) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """(header or None, step records) of a trace file; refuses other schema versions."""
    header, steps = None, []
    with open(path, encoding="utf-8") as f:
        for num, line in enumerate(f, 1):
            if not line.strip():
                continue
            record = json.loads(line)
            if record.get("v") != SCHEMA_VERSION:
                raise PagedLLMError(f"{path}:{num}: trace schema v{record.get('v')}, this reader "
                                 f"knows v{SCHEMA_VERSION}")
            if record.get("header"):
                header = record
            else:
                steps.append(record)
    return header, steps

"""Replay: drive the real Scheduler and the FakeRunner one step at a time and show each step.

This is the engine loop without the engine (schedule -> FakeRunner -> update -> parallel
sampling's forks), so a scenario needs no model and no tokenizer. Each step becomes a step-trace
record (StepRecorder, the same code as ``--trace-file``) with a block map taken right after
scheduling, i.e. the block tables the step computes into, and the queues read from the scheduler
before and after it.
"""
from __future__ import annotations

import itertools

from rich.console import Console

from pagedllm.config import SchedulerConfig
from pagedllm.core.request import Request
from pagedllm.core.scheduler import Scheduler
from pagedllm.engine.engine_stats import StepTimings
from pagedllm.engine.parallel_sampling import ParallelSampling
from pagedllm.engine.step_trace import StepRecorder, block_map
from pagedllm.explain.render import Record, is_plain, render_blocks, render_plain_step, render_step
from pagedllm.runner.fake import FakeRunner
from pagedllm.sampling_params import SamplingParams

VOCAB = 1000
_NO_TIME = StepTimings(0.0, 0.0, 0.0)  # scenario output must not depend on the clock


class Replay:
    def __init__(self, console: Console, num_blocks: int, block_size: int = 4,
                 max_model_len: int = 128, enable_caching: bool = True, **scheduler_kwargs: int | str) -> None:
        self.console = console
        self.scheduler = Scheduler(SchedulerConfig(**scheduler_kwargs), num_blocks, block_size,  # type: ignore[arg-type]
                                   max_model_len, enable_caching)
        self.runner = FakeRunner(vocab_size=VOCAB, verify_kv=True)
        self.runner.initialize_kv_cache(num_blocks, block_size)
        self.recorder = StepRecorder(self.scheduler.max_num_batched_tokens, kv=None)
        self.sampling = ParallelSampling(self.scheduler)
        self._arrival = itertools.count()
        self.records: list[Record] = []
        self.symbols: dict[str, str] = {}  # request -> its letter in the block map
        self._last_tables: dict[str, list[int]] = {}  # the previous step's block tables

    def add(self, rid: str, prompt: list[int], max_tokens: int, n: int = 1) -> None:
        """Queue a request (n > 1: parallel samples ``i_rid`` forked from the first)."""
        arrival = float(next(self._arrival))
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        ids = [rid] if n == 1 else [f"{i}_{rid}" for i in range(n)]
        reqs = [Request(cid, prompt, sp, arrival_time=arrival) for cid in ids]
        self.sampling.add(reqs[0], reqs[1:])

    def queues(self) -> dict[str, list[str]]:
        s = self.scheduler
        return {"running": [r.request_id for r in s.running],
                "waiting": [r.request_id for r in s.waiting]}

    def step(self, note: str | None = None, show: bool = True) -> Record:
        before = self.queues()
        so = self.scheduler.schedule()
        snapshot = block_map(self.scheduler.kv_cache_manager)
        ro = self.runner.execute_model(so)
        outs = self.scheduler.update_from_output(so, ro)
        self.sampling.step(outs)
        self.scheduler.check_integrity()
        rec = self.recorder.observe(so, outs, _NO_TIME)
        rec["block_map"] = snapshot
        self.records.append(rec)
        plain_tables, self._last_tables = self._last_tables, snapshot["tables"]
        if show and note is None and is_plain(rec) and snapshot["tables"] == plain_tables:
            render_plain_step(self.console, rec)
        elif show:
            render_step(self.console, rec, note, (before, self.queues()), symbols=self.symbols)
        return rec

    def show_blocks(self, title: str) -> None:
        """The cache as it is now (after the last step)."""
        self.console.rule(title, characters="-")
        render_blocks(self.console, block_map(self.scheduler.kv_cache_manager), self.symbols)

    def run(self, notes: dict[int, str] | None = None, max_steps: int = 50) -> None:
        """Step until every request has finished; ``notes``: step number -> a remark to print."""
        notes = notes or {}
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished_requests():
                return
            self.step(notes.get(self.recorder.num_steps + 1))
        raise AssertionError(f"scenario not finished after {max_steps} steps")


def tokens(start: int, num: int) -> list[int]:
    """A prompt of ``num`` distinct token ids (scenarios keep prompts apart unless they share)."""
    return list(range(start, start + num))

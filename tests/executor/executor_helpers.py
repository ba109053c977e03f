"""Runners and builders shared by the executor tests.

The runner classes here are imported by spawned workers too (spawn hands the child the parent's
sys.path, where pytest put this folder), so keep this module light: no pytest fixtures, no torch.
"""
from __future__ import annotations

import random
import time

import psutil

from pagedllm.config import SchedulerConfig
from pagedllm.core.request import Request
from pagedllm.core.scheduler import Scheduler
from pagedllm.errors import ValidationError
from pagedllm.executor import Executor
from pagedllm.runner.fake import FakeRunner
from pagedllm.sampling_params import SamplingParams

VOCAB = 1000
BLOCK_SIZE = 4


class SlowFakeRunner(FakeRunner):
    """A FakeRunner whose every step takes ``delay_s`` (a worker busy in a long step)."""

    def __init__(self, delay_s: float, **kwargs) -> None:
        super().__init__(**kwargs)
        self.delay_s = delay_s

    def execute_model(self, so):
        time.sleep(self.delay_s)
        return super().execute_model(so)


def torch_free_runner() -> FakeRunner:
    """A FakeRunner that fails to start if anything imported torch into its worker."""
    import sys

    heavy = sorted(m for m in ("torch", "numpy", "transformers") if m in sys.modules)
    if heavy:
        raise RuntimeError(f"the worker imported {heavy} before building a FakeRunner")
    return FakeRunner(vocab_size=VOCAB)


def failing_runner() -> FakeRunner:
    raise RuntimeError("boom while building the runner")


def invalid_runner() -> FakeRunner:
    raise ValidationError("kv_cache_memory_bytes is too small for one block", "kv_cache_memory_bytes")


def workload(num_requests: int = 12, seed: int = 0) -> list[Request]:
    """Prompts sharing prefixes (prefix-cache hits), of mixed lengths (chunking), some n > 1."""
    rng = random.Random(seed)
    base = [rng.randrange(1, VOCAB) for _ in range(12)]
    reqs = []
    for i in range(num_requests):
        prompt = base[: rng.choice([0, 4, 8, 12])] + [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 20))]
        sp = SamplingParams(max_tokens=rng.randint(1, 16), ignore_eos=True)
        reqs.append(Request(f"r{i}", prompt, sp, frozenset(), arrival_time=float(i)))
    return reqs


def run_loop(executor: Executor, num_blocks: int = 24, **sched_kwargs) -> tuple[dict, list]:
    """Drive a Scheduler over ``workload()`` with ``executor``: (tokens per request, every
    RunnerOutput in step order). Few blocks and a small budget: chunking and preemption."""
    sched_kwargs.setdefault("max_num_batched_tokens", 16)
    sched_kwargs.setdefault("max_num_seqs", 6)
    sched = Scheduler(SchedulerConfig(**sched_kwargs), num_blocks, BLOCK_SIZE, 64, True)
    executor.initialize(num_blocks, BLOCK_SIZE)
    for req in workload():
        sched.add_request(req)
    tokens: dict[str, list[int]] = {}
    runner_outputs = []
    for _ in range(2000):
        if not sched.has_unfinished_requests():
            break
        so = sched.schedule()
        ro = executor.execute_model(so)
        runner_outputs.append(ro)
        for out in sched.update_from_output(so, ro):
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        sched.check_integrity()
    assert not sched.has_unfinished_requests()
    return tokens, runner_outputs


def child_pids() -> set[int]:
    """This process's live children, less multiprocessing's resource tracker (spawn starts one
    per process, for its life)."""
    pids = set()
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() == psutil.STATUS_ZOMBIE or "resource_tracker" in " ".join(child.cmdline()):
                continue
        except psutil.NoSuchProcess:
            continue
        pids.add(child.pid)
    return pids

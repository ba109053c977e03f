"""What goes wrong with two ranks is said in words, at once: a size that does not split the heads
(before any worker starts), a group that cannot form (a port in use, a master nobody can reach),
a rank killed in the middle of a step; and no worker outlives its executor."""
from __future__ import annotations

import functools
import os
import signal
import socket
import threading
import time

import psutil
import pytest
from dist_helpers import DEMO_MODEL_DIR, SlowFakeRunner

from pagedllm.config import EngineConfig
from pagedllm.core.outputs import CachedRequestData, SchedulerOutput
from pagedllm.distributed.tp_sizes import (
    check_heads_split,
    check_tensor_parallel_size,
    split_size,
    valid_tensor_parallel_sizes,
    vocab_rows_per_rank,
)
from pagedllm.errors import EngineDeadError, ValidationError
from pagedllm.executor import create_executor
from pagedllm.executor.multiproc import MultiprocExecutor
from pagedllm.runner.fake import FakeRunner

FAKE = functools.partial(FakeRunner, vocab_size=100)


def _children() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True)
            if "resource_tracker" not in " ".join(p.cmdline())]


@pytest.fixture
def no_orphans():
    before = {p.pid for p in _children()}
    yield
    left = [p for p in _children() if p.pid not in before]
    _, alive = psutil.wait_procs(left, timeout=10)
    assert not alive, [" ".join(p.cmdline()) for p in alive]


def test_valid_sizes_follow_the_heads():
    def sizes(heads, kv_heads, inter):
        return valid_tensor_parallel_sizes({"num_attention_heads": heads,
                                            "num_key_value_heads": kv_heads, "intermediate_size": inter})
    assert sizes(8, 4, 172) == [1, 2, 4]      # the demo model: 172 MLP units stop 8
    assert sizes(8, 2, 128) == [1, 2, 4, 8]   # 4 and 8 replicate the 2 KV heads
    assert sizes(4, 1, 128) == [1, 2, 4]      # one KV head, replicated on every rank
    assert sizes(6, 4, 96) == [1, 2]          # 3 splits neither 4 KV heads nor replicates them
    with pytest.raises(ValidationError, match=r"num_attention_heads 6.*valid sizes: 1, 2$"):
        check_tensor_parallel_size({"num_attention_heads": 6, "num_key_value_heads": 4,
                                    "intermediate_size": 96}, 3)


def test_the_layers_split_by_the_same_rule():
    # What the layers' constructors call: the rule valid_tensor_parallel_sizes applies to a config.
    assert split_size(172, 4, "intermediate size") == 43
    with pytest.raises(ValidationError, match="intermediate size 172 does not split over 8 ranks") as e:
        split_size(172, 8, "intermediate size")
    assert e.value.param == "tensor_parallel_size"
    check_heads_split(8, 2, 8)  # two KV heads, each replicated on four ranks
    check_heads_split(8, 4, 2)
    for heads, kv_heads, tp in ((6, 4, 3), (6, 4, 4), (8, 3, 2)):
        with pytest.raises(ValidationError, match=f"{heads} heads / {kv_heads} KV heads do not split"):
            check_heads_split(heads, kv_heads, tp)
        assert tp not in valid_tensor_parallel_sizes({"num_attention_heads": heads, "num_key_value_heads":
                                                      kv_heads, "intermediate_size": 96})
    assert [vocab_rows_per_rank(512, tp) for tp in (1, 2, 3, 5)] == [512, 256, 171, 103]


def test_a_size_that_does_not_split_the_demo_model_fails_before_spawning(no_orphans, monkeypatch):
    config = EngineConfig.from_kwargs(str(DEMO_MODEL_DIR), device="cpu", tensor_parallel_size=3)
    before = {p.pid for p in _children()}  # other tests' helpers (a Ray node, say) may be up

    def no_process(*args, **kwargs):
        raise AssertionError("a worker process was started for a size that cannot work")

    monkeypatch.setattr("pagedllm.executor.multiproc.ChildProcess", no_process)
    with pytest.raises(ValidationError, match="tensor_parallel_size=3 .* valid sizes: 1, 2, 4") as e:
        create_executor(config, max_model_len=256)
    assert e.value.param == "tensor_parallel_size"
    assert not [p for p in _children() if p.pid not in before]


@pytest.mark.slow  # two workers import torch (about 10 s here)
def test_a_port_in_use_is_named(no_orphans):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError, match=rf"could not form the tensor-parallel group: rank 0 "
                                                  rf"of 2 at tcp://127.0.0.1:{port}.*address already in use"):
            MultiprocExecutor(FAKE, world_size=2, master_port=port, init_timeout_s=30)
        assert time.monotonic() - t0 < 60  # the workers' start, not the 30 s group timeout


@pytest.mark.slow  # two workers import torch, then a 3 s timeout
def test_a_master_nobody_can_reach_is_named_within_the_timeout(no_orphans):
    t0 = time.monotonic()
    with pytest.raises(EngineDeadError, match=r"could not form the tensor-parallel group: rank \d of 2 "
                                              r"at tcp://no-such-host.invalid:\d+ .*timeout 3 s"):
        MultiprocExecutor(FAKE, world_size=2, master_addr="no-such-host.invalid", master_port=29555,
                          init_timeout_s=3)
    assert time.monotonic() - t0 < 60


def test_a_rank_killed_mid_step_wakes_the_engine_naming_it(no_orphans):
    # Rank 0's step takes 60 s: the engine must wake on rank 1's death, not on rank 0's reply
    # (at once, usually; bounded at 30 s for a loaded machine).
    executor = MultiprocExecutor(functools.partial(SlowFakeRunner, 60.0), world_size=2)
    pids = executor.worker_pids
    try:
        executor.initialize(8, 4)
        victim = pids[1]
        killed_at: list[float] = []

        def kill_soon() -> None:
            time.sleep(0.3)
            killed_at.append(time.monotonic())
            os.kill(victim, signal.SIGKILL)

        threading.Thread(target=kill_soon, daemon=True).start()
        with pytest.raises(EngineDeadError, match=r"worker rank 1 .* killed by signal SIGKILL"):
            executor.execute_model(SchedulerOutput([], CachedRequestData(), {}, 0))
        assert time.monotonic() - killed_at[0] < 30.0
        with pytest.raises(EngineDeadError, match="rank 1"):
            executor.check_health()  # and every later call says the same
    finally:
        executor.shutdown()
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
                   for pid in pids)

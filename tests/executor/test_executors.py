"""The uniproc and mp executors over the FakeRunner: same results, clear deaths, no orphans.

A worker costs a fresh interpreter (about a second here), so tests share one mp executor where they can.
"""
from __future__ import annotations

import functools
import os
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest
from executor_helpers import (
    VOCAB,
    SlowFakeRunner,
    child_pids,
    failing_runner,
    invalid_runner,
    run_loop,
    torch_free_runner,
    workload,
)

from pagedllm.config import EngineConfig, ModelConfig, ParallelConfig
from pagedllm.core.outputs import CachedRequestData, SchedulerOutput
from pagedllm.errors import EngineDeadError, ValidationError
from pagedllm.executor import create_executor
from pagedllm.executor.ipc import RemoteTraceback
from pagedllm.executor.multiproc import MultiprocExecutor
from pagedllm.executor.uniproc import UniProcExecutor
from pagedllm.runner.fake import FakeRunner

FAKE = functools.partial(FakeRunner, vocab_size=VOCAB, verify_kv=True)


def _config(backend: str | None) -> EngineConfig:
    return EngineConfig(ModelConfig(model="unused"), parallel_config=ParallelConfig(backend))


@pytest.fixture(scope="module")
def mp_executor():
    before = child_pids()
    executor = MultiprocExecutor(FAKE)
    yield executor
    executor.shutdown()
    assert child_pids() == before, "a worker outlived shutdown()"


@pytest.fixture(scope="module")
def uni_results():
    return run_loop(UniProcExecutor(FAKE()))


def test_uniproc_and_mp_give_identical_runner_outputs(mp_executor, uni_results):
    tokens, runner_outputs = run_loop(mp_executor)
    assert tokens == uni_results[0]
    assert runner_outputs == uni_results[1]
    assert len(tokens) == len(workload())


def test_mp_runs_the_loop_again_on_the_same_worker(mp_executor, uni_results):
    """A second engine's worth of steps on the shared worker (requests ids reused)."""
    mp_executor.check_health()
    assert mp_executor.determine_num_blocks(4) == 1024
    assert run_loop(mp_executor)[0] == uni_results[0]


def test_two_ranks_get_every_step_and_rank0_answers(uni_results):
    """Tensor parallelism's shape: every rank applies every SchedulerOutput (each FakeRunner
    verifies its own KV), rank 0's output comes back."""
    with MultiprocExecutor(FAKE, world_size=2) as executor:
        assert len(set(executor.worker_pids)) == 2
        tokens, runner_outputs = run_loop(executor)
    assert tokens == uni_results[0] and runner_outputs == uni_results[1]


def test_create_executor_chooses_by_backend():
    runner = FAKE()
    for backend in (None, "uni"):
        executor = create_executor(_config(backend), runner)
        assert isinstance(executor, UniProcExecutor) and executor.runner is runner
    # More than one rank: worker processes unless told otherwise; never the engine's process.
    assert ParallelConfig(tensor_parallel_size=2).distributed_executor_backend == "mp"
    assert ParallelConfig("ray", 2).distributed_executor_backend == "ray"
    with pytest.raises(ValidationError, match="tensor_parallel_size=2 needs 'mp'"):
        ParallelConfig("uni", 2)
    with pytest.raises(ValidationError, match="must be one of uni, mp, ray"):
        EngineConfig.from_kwargs("unused", distributed_executor_backend="threads")
    assert EngineConfig.from_kwargs("x", distributed_executor_backend="mp").parallel_config == ParallelConfig("mp")
    with pytest.raises(TypeError, match="needs a runner"):
        create_executor(_config("uni"))


def test_create_mp_executor_with_a_runner_instance(uni_results):
    """A runner instance travels to the worker as a pickled copy."""
    runner = FAKE()
    with create_executor(_config("mp"), runner) as executor:
        assert isinstance(executor, MultiprocExecutor)
        assert run_loop(executor)[0] == uni_results[0]
    assert runner.num_steps == 0  # the worker ran its own copy


def test_a_fake_runner_worker_never_imports_torch():
    with MultiprocExecutor(torch_free_runner) as executor:
        executor.check_health()


def test_shutdown_is_idempotent_and_final():
    for executor in (UniProcExecutor(FAKE()), MultiprocExecutor(FAKE)):
        pids = getattr(executor, "worker_pids", [])
        executor.shutdown()
        executor.shutdown()
        with pytest.raises(EngineDeadError, match="shut down"):
            executor.check_health()
        assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                       for p in pids)


def test_killed_worker_gives_engine_dead_error_at_once():
    before = child_pids()
    executor = MultiprocExecutor(FAKE)
    executor.initialize(16, 4)
    os.kill(executor.worker_pids[0], signal.SIGKILL)
    with pytest.raises(EngineDeadError, match=r"rank 0 .* killed by signal SIGKILL"):
        executor.execute_model(SchedulerOutput([], CachedRequestData(), {}, 0))
    with pytest.raises(EngineDeadError, match="SIGKILL"):
        executor.check_health()
    executor.shutdown()
    assert child_pids() == before


def test_worker_killed_during_a_step_wakes_the_engine():
    """The engine is blocked waiting for a long step when the worker dies: no hang (the step
    would take 300 s; the wake-up is bounded generously, a loaded machine is slow)."""
    before = child_pids()
    executor = MultiprocExecutor(functools.partial(SlowFakeRunner, 300.0, vocab_size=VOCAB))
    executor.initialize(16, 4)
    pid = executor.worker_pids[0]
    killed_at: list[float] = []

    def kill_soon() -> None:
        time.sleep(0.3)
        killed_at.append(time.monotonic())
        os.kill(pid, signal.SIGKILL)

    threading.Thread(target=kill_soon, daemon=True).start()
    with pytest.raises(EngineDeadError, match="SIGKILL"):
        executor.execute_model(SchedulerOutput([], CachedRequestData(), {}, 0))
    assert time.monotonic() - killed_at[0] < 30.0
    executor.shutdown()
    assert child_pids() == before


def test_runner_error_in_a_step_is_reported_and_final():
    with MultiprocExecutor(FAKE) as executor:
        executor.initialize(16, 4)
        bogus = SchedulerOutput([], CachedRequestData(["ghost"], [[1]], [0], [[5]]), {"ghost": 1}, 1)
        with pytest.raises(EngineDeadError, match="rank 0 failed in execute_model: KeyError: 'ghost'") as info:
            executor.execute_model(bogus)
        assert isinstance(info.value.__cause__, RemoteTraceback)
        assert "fake.py" in str(info.value.__cause__)  # the worker's traceback rides along
        with pytest.raises(EngineDeadError, match="failed in execute_model"):
            executor.check_health()


def test_startup_failure_carries_the_worker_exception():
    before = child_pids()
    start = time.monotonic()
    with pytest.raises(EngineDeadError, match="rank 0 failed to start: RuntimeError: boom while building"):
        MultiprocExecutor(failing_runner)
    # pagedllm's own errors keep their type across the wire (a ValidationError stays a 400).
    with pytest.raises(ValidationError, match="too small for one block") as info:
        MultiprocExecutor(invalid_runner)
    assert info.value.param == "kv_cache_memory_bytes"
    # With two ranks failing, whichever report is read first: the worker's text, never a bare exit code.
    with pytest.raises(EngineDeadError, match="boom while building the runner"):
        MultiprocExecutor(failing_runner, world_size=2)
    assert time.monotonic() - start < 20
    assert child_pids() == before


def test_startup_timeout_is_clear():
    with pytest.raises(EngineDeadError, match="did not start within 0 s"):
        MultiprocExecutor(functools.partial(SlowFakeRunner, 1.0), startup_timeout_s=0.0)


def test_a_forgotten_executor_still_reaps_its_worker():
    """No shutdown() call: garbage collection (or interpreter exit) stops the worker."""
    import gc

    before = child_pids()
    executor = MultiprocExecutor(FAKE)
    assert set(executor.worker_pids) <= child_pids()
    del executor
    gc.collect()
    assert child_pids() == before


_ORPHAN_SCRIPT = """
import functools, sys, time
sys.path.insert(0, {helpers!r})
from executor_helpers import SlowFakeRunner
from pagedllm.core.outputs import CachedRequestData, SchedulerOutput
from pagedllm.executor.multiproc import MultiprocExecutor
if __name__ == "__main__":
    executor = MultiprocExecutor(functools.partial(SlowFakeRunner, 1.0, vocab_size=10))
    print(executor.worker_pids[0], flush=True)
    executor.execute_model(SchedulerOutput([], CachedRequestData(), {{}}, 0))  # killed in here
"""


def test_worker_exits_when_the_engine_process_is_killed(tmp_path):
    """kill -9 of the engine's process (while its worker is in a step) skips every cleanup: the
    worker must notice by itself, and not block on sending a reply nobody will read."""
    import subprocess
    import sys

    script = tmp_path / "engine.py"
    script.write_text(_ORPHAN_SCRIPT.format(helpers=str(Path(__file__).parent)))
    engine = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        worker = psutil.Process(int(engine.stdout.readline()))
        engine.kill()
        engine.wait(10)
        worker.wait(timeout=5)  # psutil.TimeoutExpired if it outlived the engine
    finally:
        engine.kill()
        engine.stdout.close()


_NO_GUARD_SCRIPT = """
import functools
from pagedllm.executor.multiproc import MultiprocExecutor
from pagedllm.runner.fake import FakeRunner
executor = MultiprocExecutor(functools.partial(FakeRunner, vocab_size=10), world_size=2)
print("pids", *executor.worker_pids, flush=True)
executor.shutdown()
"""


def test_a_script_without_a_main_guard_runs(tmp_path):
    """Workers run pagedllm's own entry module, never the user's script: a script that starts
    an engine at top level (no ``__main__`` guard, as vLLM users write them) just works."""
    import subprocess
    import sys

    script = tmp_path / "noguard.py"
    script.write_text(_NO_GUARD_SCRIPT)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    pids = [int(p) for p in proc.stdout.split()[1:]]
    assert len(pids) == 2 and not any(psutil.pid_exists(p) and psutil.Process(p).status()
                                      != psutil.STATUS_ZOMBIE for p in pids)


_MAIN_RUNNER_SCRIPT = """
import functools
from pagedllm.executor.multiproc import MultiprocExecutor
from pagedllm.runner.fake import FakeRunner

class MainRunner(FakeRunner):  # defined in __main__: the worker must import this script
    pass

def start():
    executor = MultiprocExecutor(functools.partial(MainRunner, vocab_size=10))
    executor.initialize(16, 4)  # a call the worker answers: it built the runner
    executor.shutdown()
{call}
"""


@pytest.mark.parametrize("guarded", [True, False])
def test_a_runner_defined_in_the_main_script(tmp_path, guarded):
    """A runner class from the user's script: the worker imports the script (as spawn did), its
    guarded part not run; unguarded, that import would start another engine: a clear error
    instead of endless processes."""
    import subprocess
    import sys

    call = 'if __name__ == "__main__":\n    start()' if guarded else "start()"
    script = tmp_path / "main_runner.py"
    script.write_text(_MAIN_RUNNER_SCRIPT.format(call=call))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    if guarded:
        assert proc.returncode == 0, proc.stderr
    else:
        assert proc.returncode != 0
        assert "before it was ready" in proc.stderr and '__name__ == "__main__"' in proc.stderr

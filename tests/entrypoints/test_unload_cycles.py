"""Load/unload cycles of one model in one process leave nothing behind per cycle: a compiled
engine's graph and dynamo state go with it, and with the engine core in a process of its own
each unload stops that process (no orphan)."""
from __future__ import annotations

import asyncio
import sys

import psutil
import pytest
from server_utils import CHAT_TEMPLATE

from pagedllm import SamplingParams
from pagedllm.config import default_model
from pagedllm.entrypoints.openai.model_router import make_pool
from pagedllm.entrypoints.openai.model_specs import ModelSpec
from pagedllm.entrypoints.openai.server_options import ServerOptions

ENGINE_ARGS = {"max_num_seqs": 4, "kv_cache_memory_bytes": 4 << 20}


async def _cycle(pool) -> None:
    served = await pool.acquire("a")
    try:
        async for _ in served.loaded.llm.generate("Once upon a time", SamplingParams(max_tokens=2, temperature=0),
                                                  request_id="r"):
            pass
    finally:
        await pool.release(served)
    await pool.unload("a")
    assert pool.models["a"].state == "unloaded"


def _compiled_globals() -> list[str]:
    """The compiled graphs dynamo has installed in the model module and not yet removed."""
    module = sys.modules["pagedllm.models.decoder"]
    return [name for name in vars(module) if name.startswith("__compiled_fn")]


@pytest.mark.slow  # a compile per load
def test_compiled_engine_leaves_no_graph_behind_per_cycle():
    import torch
    from torch._dynamo.utils import CleanupManager

    from pagedllm.runner.compile import compile_disabled_reason

    if compile_disabled_reason(False, torch.device("cpu")) is not None:
        pytest.skip("no compiler for torch.compile here")
    spec = ModelSpec("a", default_model(), {**ENGINE_ARGS, "enforce_eager": False}, chat_template=CHAT_TEMPLATE)

    async def scenario() -> list[tuple[int, int]]:
        pool = make_pool([spec], ServerOptions(), multiprocess=False)
        left = []
        try:
            for _ in range(2):
                await _cycle(pool)
                left.append((len(_compiled_globals()), CleanupManager.count))
        finally:
            await pool.shutdown()
        return left

    hooks_before = CleanupManager.count
    left = asyncio.run(scenario())
    # Each cycle's compiled graph is removed with its engine: none accumulate.
    assert left == [(0, hooks_before)] * 2, left


@pytest.mark.slow
def test_multiprocess_unload_leaves_no_engine_core_process():
    spec = ModelSpec("a", default_model(), {**ENGINE_ARGS, "enforce_eager": True}, chat_template=CHAT_TEMPLATE)
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}

    async def scenario() -> list[int]:
        pool = make_pool([spec], ServerOptions(), multiprocess=True)
        during, after = [], []
        try:
            for _ in range(2):
                served = await pool.acquire("a")
                during.append(len({p.pid for p in me.children(recursive=True)} - before))
                await pool.release(served)
                await pool.unload("a")
                alive = [p for p in me.children(recursive=True) if p.pid not in before]
                _, alive = psutil.wait_procs(alive, timeout=10)
                after.append(len(alive))
        finally:
            await pool.shutdown()
        assert all(n >= 1 for n in during), during  # the engine core ran in a process of its own
        return after

    assert asyncio.run(scenario()) == [0, 0]

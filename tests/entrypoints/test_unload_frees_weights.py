"""An unloaded model's weights and KV cache are freed by reference counting when its engine shuts
down: no garbage collection runs on the unload path, so none may be needed to free them."""
from __future__ import annotations

import asyncio
import gc
import weakref

from server_utils import CHAT_TEMPLATE

from pagedllm import SamplingParams
from pagedllm.config import default_model
from pagedllm.entrypoints.openai.model_pool import ModelPool
from pagedllm.entrypoints.openai.model_router import make_pool
from pagedllm.entrypoints.openai.model_specs import ModelSpec
from pagedllm.entrypoints.openai.server_options import ServerOptions

ENGINE_ARGS = {"max_num_seqs": 4, "kv_cache_memory_bytes": 4 << 20, "enforce_eager": True}


async def _load_and_step(pool: ModelPool) -> list[weakref.ref]:
    """Load the model, run one request through it; weak references to its weights and KV cache."""
    served = await pool.acquire("a")
    try:
        llm = served.loaded.llm
        out = None
        async for out in llm.generate("Once upon a time", SamplingParams(max_tokens=4, temperature=0),
                                      request_id="r"):
            pass
        assert out is not None and out.finished  # a step ran: the loop task and the runner's caches are live
        runner = llm.engine.engine_core.executor.runner
        return [weakref.ref(runner.model), weakref.ref(next(runner.model.parameters())),
                weakref.ref(runner.kv_caches[0])]
    finally:
        await pool.release(served)


def test_each_unload_frees_the_weights_and_kv_cache_without_a_collection():
    spec = ModelSpec("a", default_model(), dict(ENGINE_ARGS), chat_template=CHAT_TEMPLATE)

    async def scenario() -> None:
        pool = make_pool([spec], ServerOptions(), multiprocess=False)
        try:
            for cycle in range(3):
                refs = await _load_and_step(pool)
                gc.collect()  # what is garbage already goes now, so only the unload is left to free the model
                gc.disable()  # no collection may run, not even an automatic one
                try:
                    await pool.unload("a")
                    assert pool.models["a"].state == "unloaded"
                    alive = [name for name, ref in zip(("model", "weight", "kv cache"), refs) if ref() is not None]
                    assert not alive, f"cycle {cycle}: the unloaded model's {alive} are still alive"
                finally:
                    gc.enable()
            assert pool.models["a"].num_loads == 3
        finally:
            await pool.shutdown()

    asyncio.run(scenario())

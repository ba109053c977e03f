"""An unloaded model's weights and KV cache are freed by reference counting when its engine shuts
down: no garbage collection runs on the unload path, so none may be needed to free them."""
from __future__ import annotations

import asyncio
import gc
import weakref

from server_utils import CHAT_TEMPLATE

from pagedllm import SamplingParams
from pagedllm.config import default_model
from pagedllm.entrypoints.openai.model_router import make_pool
from pagedllm.entrypoints.openai.model_specs import ModelSpec
from pagedllm.entrypoints.openai.server_options import ServerOptions

ENGINE_ARGS = {"max_num_seqs": 4, "kv_cache_memory_bytes": 4 << 20, "enforce_eager": True}


def test_unload_frees_the_weights_without_a_collection():
    spec = ModelSpec("a", default_model(), dict(ENGINE_ARGS), chat_template=CHAT_TEMPLATE)

    async def scenario() -> None:
        pool = make_pool([spec], ServerOptions(), multiprocess=False)
        try:
            a = await pool.acquire("a")
            llm = a.loaded.llm
            out = None
            greedy = SamplingParams(max_tokens=4, temperature=0)
            async for out in llm.generate("Once upon a time", greedy, request_id="r"):
                pass
            assert out is not None and out.finished  # a step ran: the loop task and the runner's caches are live
            runner = llm.engine.engine_core.executor.runner
            weight = weakref.ref(next(runner.model.parameters()))
            model = weakref.ref(runner.model)
            del llm, runner, out, a
            await pool.release(pool.models["a"])
            gc.collect()  # what is garbage already goes now, so only the unload is left to free the model
            gc.disable()  # no collection may run, not even an automatic one
            try:
                await pool.unload("a")
                assert pool.models["a"].state == "unloaded"
                assert model() is None and weight() is None, "the unloaded model's weights are still alive"
            finally:
                gc.enable()
        finally:
            await pool.shutdown()

    asyncio.run(scenario())


"""EngineCoreClient: the one interface LLMEngine drives, met by the in-process core, the core
process's client and the data-parallel client alike."""
from __future__ import annotations

import inspect

from pagedllm.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pagedllm.engine.core_client import EngineCoreClient, MPEngineCoreClient
from pagedllm.engine.dp_client import DPEngineCoreClient
from pagedllm.engine.engine_core import EngineCore
from pagedllm.engine.llm_engine import make_engine_core
from pagedllm.runner.fake import FakeRunner

METHODS = sorted(name for name, value in vars(EngineCoreClient).items()
                 if callable(value) and not name.startswith("_"))


def test_the_protocol_names_what_the_front_end_calls():
    assert METHODS == ["abort_requests", "add_request", "finish_requests", "get_metrics",
                       "has_unfinished_requests", "reset_prefix_cache", "shutdown", "step"]


def test_every_client_has_each_method_with_its_parameters():
    for cls in (EngineCore, MPEngineCoreClient, DPEngineCoreClient):
        for name in METHODS:
            want = list(inspect.signature(getattr(EngineCoreClient, name)).parameters)
            got = list(inspect.signature(getattr(cls, name)).parameters)
            assert got == want, (cls.__name__, name)


def test_the_in_process_core_is_an_engine_core_client():
    config = EngineConfig(ModelConfig(model="unused", max_model_len=32),
                          CacheConfig(block_size=4, num_gpu_blocks_override=8),
                          SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=2))
    core = make_engine_core(config, 32, FakeRunner(vocab_size=20), multiprocess=False)
    try:
        assert isinstance(core, EngineCore) and isinstance(core, EngineCoreClient)
        assert core.num_blocks == 8
    finally:
        core.shutdown()
    assert not isinstance(object(), EngineCoreClient)

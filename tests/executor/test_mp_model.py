"""The mp executor runs the real ModelRunner (the demo model, stories260K) in its worker and
samples the same greedy ids as the same runner in this process."""
from __future__ import annotations

import functools

import pytest

from pagedllm.config import DEFAULT_MODEL_DIR as DEMO
from pagedllm.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pagedllm.core.request import Request
from pagedllm.core.scheduler import Scheduler
from pagedllm.engine.model_info import ModelInfo
from pagedllm.executor import Executor
from pagedllm.executor.abstract import build_model_runner
from pagedllm.executor.multiproc import MultiprocExecutor
from pagedllm.executor.uniproc import UniProcExecutor
from pagedllm.sampling_params import SamplingParams

NUM_BLOCKS, BLOCK_SIZE = 48, 16
# Token ids of the demo vocabulary (512): prompts sharing a prefix, one long enough to chunk.
PROMPTS = [[1, 403, 261, 370, 300], [1, 403, 261, 370, 300, 320, 405], [1, 291, 330, 269] * 8,
           [1, 86, 440]]


def _greedy(executor: Executor, config: EngineConfig, info: ModelInfo) -> dict[str, list[int]]:
    executor.initialize(NUM_BLOCKS, BLOCK_SIZE)
    sched = Scheduler(config.scheduler_config, NUM_BLOCKS, BLOCK_SIZE, 256, True)
    for i, prompt in enumerate(PROMPTS):
        sched.add_request(Request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=24),
                                  info.eos_token_ids, arrival_time=float(i)))
    tokens: dict[str, list[int]] = {}
    while sched.has_unfinished_requests():
        so = sched.schedule()
        for out in sched.update_from_output(so, executor.execute_model(so)):
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens


@pytest.mark.slow  # two model loads (torch import and weights in the worker): 8-20 s here
def test_mp_matches_uniproc_greedy_on_the_demo_model():
    if not (DEMO / "config.json").is_file():
        pytest.fail(f"demo model missing at {DEMO}")
    config = EngineConfig(ModelConfig(model=str(DEMO), dtype="float32", device="cpu"),
                          CacheConfig(block_size=BLOCK_SIZE, num_gpu_blocks_override=NUM_BLOCKS),
                          SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=3))
    info = ModelInfo.from_folder(DEMO)
    factory = functools.partial(build_model_runner, config, 256)
    want = _greedy(UniProcExecutor(factory()), config, info)
    with MultiprocExecutor(factory) as executor:
        got = _greedy(executor, config, info)
    assert got == want
    assert all(len(ids) > 0 for ids in got.values()) and len(got) == len(PROMPTS)

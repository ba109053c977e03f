"""A generator that pools too (a pooler_config on a generate runner): generation and embedding
requests in the same steps and token budget, each with the result it gets alone; the server
answers /v1/completions and /v1/embeddings from one engine."""
from __future__ import annotations

import httpx
import pytest
import torch

from pagedllm import LLM
from pagedllm.config import DEFAULT_MODEL_DIR
from pagedllm.pooling_outputs import PoolingRequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import RequestOutputKind, SamplingParams
from tests.pooling.st_models import save_tiny_qwen3

pytestmark = pytest.mark.skipif(not DEFAULT_MODEL_DIR.is_dir(), reason="demo model not present")

PROMPTS = ["Once upon a time", "The little dog", "Lily and Ben went to the park"]
TEXTS = ["Once upon a time there was a little girl named Lily. She loved to play outside in the "
         "sun with her friends and her dog.", "Hi", "The cat sat on the mat and looked at the big red ball."]
POOLER = {"pooling_type": "MEAN", "normalize": False}
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)
CAP = 5  # max_pooling_tokens_while_decoding


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3")
    save_tiny_qwen3(folder, initializer_range=0.1)
    return folder


@pytest.fixture(params=["demo", "qwen3"])
def model(request) -> str:
    return str(DEFAULT_MODEL_DIR if request.param == "demo" else request.getfixturevalue("qwen3"))


def _interleaved(engine) -> tuple[dict[str, list[int]], dict[str, list[float]], list[dict[str, int]]]:
    """Generation requests first, an embedding request joining every other step: the tokens,
    the vectors, and each step's scheduled tokens."""
    schedules: list[dict[str, int]] = []
    engine.step_observers.append(lambda so, outs, timings: schedules.append(dict(so.num_scheduled_tokens)))
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"g{i}", prompt, GREEDY)
    pending = list(enumerate(TEXTS))
    tokens, vectors = {}, {}
    while pending or engine.has_unfinished_requests():
        if pending and len(schedules) % 2 == 1:
            i, text = pending.pop(0)
            engine.add_pooling_request(f"e{i}", text, PoolingParams(task="embed"))
        for out in engine.step():
            if isinstance(out, PoolingRequestOutput):
                vectors[out.request_id] = out.outputs.data
            elif out.finished:
                tokens[out.request_id] = out.outputs[0].token_ids
    return tokens, vectors, schedules


@pytest.mark.slow
def test_generation_and_embeddings_share_steps_with_their_own_results(model):
    mixed = LLM(model, pooler_config=POOLER, max_num_batched_tokens=16, max_pooling_tokens_while_decoding=CAP)
    engine = mixed.llm_engine
    tokens, vectors, schedules = _interleaved(engine)

    alone = LLM(model).generate(PROMPTS, GREEDY, use_tqdm=False)
    assert tokens == {f"g{i}": list(o.outputs[0].token_ids) for i, o in enumerate(alone)}
    pooled = LLM(model, runner="pooling", pooler_config=POOLER).embed(TEXTS)
    assert set(vectors) == {f"e{i}" for i in range(len(TEXTS))}
    for i, out in enumerate(pooled):
        assert torch.allclose(torch.tensor(vectors[f"e{i}"]), torch.tensor(out.outputs.embedding), atol=1e-5)

    from transformers import AutoModel

    reference = AutoModel.from_pretrained(model, dtype=torch.float32).eval()
    for i, out in enumerate(pooled):
        with torch.no_grad():
            want = reference(torch.tensor([out.prompt_token_ids])).last_hidden_state[0].mean(dim=0)
        assert torch.allclose(torch.tensor(vectors[f"e{i}"]), want, atol=1e-5)

    # The long text ran in chunks, and a step that decoded held at most CAP pooling tokens.
    assert len(pooled[0].prompt_token_ids) > 16
    assert sum("e0" in s for s in schedules) > 1
    decoding = [s for s in schedules if any(r.startswith("g") and n == 1 for r, n in s.items())]
    assert all(sum(n for r, n in s.items() if r.startswith("e")) <= CAP for s in decoding)
    assert any(r.startswith("e") for s in decoding for r in s)

    # Nothing left behind once idle.
    sched = engine.scheduler
    sched.check_integrity()
    assert not sched.requests and not sched.running and not engine.pooling.pending
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == sched.kv_cache_manager.num_blocks
    assert not engine.has_unfinished_requests()


@pytest.mark.slow
def test_server_answers_completions_and_embeddings_from_one_engine():
    from pagedllm.engine.async_engine import AsyncLLM
    from pagedllm.entrypoints.openai.server import build_app
    from tests.entrypoints.server_utils import ServerThread

    model = str(DEFAULT_MODEL_DIR)
    srv = ServerThread(build_app(AsyncLLM.from_engine_args(model, pooler_config=POOLER), ["m"])).start()
    try:
        with httpx.Client(timeout=60) as http:
            done = http.post(f"{srv.url}/v1/completions", json={
                "model": "m", "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0.0}).json()
            emb = http.post(f"{srv.url}/v1/embeddings", json={"model": "m", "input": TEXTS[:2]}).json()
    finally:
        srv.stop()
    want = LLM(model, runner="pooling", pooler_config=POOLER).embed(TEXTS[:2])
    assert done["usage"]["completion_tokens"] == 8 and done["choices"][0]["text"]
    assert [d["index"] for d in emb["data"]] == [0, 1]
    for d, w in zip(emb["data"], want):
        assert torch.allclose(torch.tensor(d["embedding"]), torch.tensor(w.outputs.embedding), atol=1e-5)


def test_without_the_opt_in_a_generator_still_refuses_to_embed():
    from pagedllm.errors import ValidationError

    with pytest.raises(ValidationError, match="generates text.*or with a pooler_config to serve both"):
        LLM(str(DEFAULT_MODEL_DIR)).embed("Once")


def test_pooler_config_refuses_speculative_decoding():
    from pagedllm.config import EngineConfig
    from pagedllm.errors import ValidationError

    with pytest.raises(ValidationError, match="pooler_config does not combine with speculative_config"):
        EngineConfig.from_kwargs(str(DEFAULT_MODEL_DIR), pooler_config={},
                                 speculative_config={"method": "ngram", "num_speculative_tokens": 2})

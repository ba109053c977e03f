"""The pooling routes on a live server over tiny random models: the openai client's
embeddings.create, vLLM's /pooling, /classify, /score, Jina- and Cohere-shape rerank, 400s."""
from __future__ import annotations

import base64

import httpx
import openai
import pytest
import torch

from pagedllm import LLM
from tests.entrypoints.server_utils import ServerThread, scrape
from tests.pooling.st_models import save_st_bert
from tests.pooling.test_cross_encoder import DOCS, _save

HTTP = httpx.Client(timeout=60)


def _serve(folder, **engine_args):
    from pagedllm.engine.async_engine import AsyncLLM
    from pagedllm.entrypoints.openai.server import build_app

    return ServerThread(build_app(AsyncLLM.from_engine_args(str(folder), **engine_args), ["m"])).start()


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    folder = save_st_bert(tmp_path_factory.mktemp("emb"), matryoshka=True)
    srv = _serve(folder, max_model_len=32)
    yield srv, LLM(str(folder))
    srv.stop()


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    folder = _save(tmp_path_factory.mktemp("rr"), "bert", num_labels=1)
    srv = _serve(folder)
    yield srv, LLM(str(folder))
    srv.stop()


def test_openai_client_embeddings(embedder):
    srv, llm = embedder
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)
    texts = ["the cat sat", "a dog ran far"]
    want = [o.outputs.embedding for o in llm.embed(texts)]
    for fmt in ({}, {"encoding_format": "float"}):  # unset: the client asks base64 and decodes it
        resp = client.embeddings.create(model="m", input=texts, **fmt)
        assert [d.index for d in resp.data] == [0, 1]
        for d, w in zip(resp.data, want):
            assert torch.allclose(torch.tensor(d.embedding), torch.tensor(w), atol=1e-6)
        assert resp.usage.prompt_tokens == resp.usage.total_tokens > 0
    raw = client.embeddings.create(model="m", input=texts[0], encoding_format="base64").data[0].embedding
    decoded = torch.frombuffer(bytearray(base64.b64decode(raw)), dtype=torch.float32)
    assert torch.allclose(decoded, torch.tensor(want[0]), atol=1e-6)
    one = client.embeddings.create(model="m", input=[2, 33, 3], dimensions=8)  # token ids
    assert len(one.data[0].embedding) == 8
    assert abs(sum(x * x for x in one.data[0].embedding) - 1) < 1e-5


@pytest.mark.parametrize("body, needle", [
    ({"input": []}, "input is empty"),
    ({"input": ""}, "empty string"),
    ({"input": "cat " * 40}, "maximum length is 32"),
    ({"input": "cat", "dimensions": 99}, "exceeds the model's embedding size 16"),
])
def test_embedding_bad_input_is_400(embedder, body, needle):
    srv, _ = embedder
    r = HTTP.post(f"{srv.url}/v1/embeddings", json={"model": "m", **body})
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text


def test_pooling_model_refuses_to_generate(embedder):
    srv, _ = embedder
    r = HTTP.post(f"{srv.url}/v1/completions", json={"model": "m", "prompt": "the cat"})
    assert r.status_code == 400 and "/v1/embeddings" in r.json()["error"]["message"]
    r = HTTP.post(f"{srv.url}/pooling", json={"model": "m", "input": "the cat"})
    assert r.status_code == 200 and r.json()["data"][0]["object"] == "pooling"


def test_score_and_rerank_shapes(reranker):
    srv, llm = reranker
    want = [o.outputs.score for o in llm.score("the cat", DOCS)]
    for path in ("/score", "/v1/score"):
        r = HTTP.post(f"{srv.url}{path}", json={"model": "m", "text_1": "the cat", "text_2": DOCS}).json()
        assert [d["index"] for d in r["data"]] == list(range(len(DOCS)))
        assert max(abs(d["score"] - w) for d, w in zip(r["data"], want)) < 1e-6
    order = sorted(range(len(DOCS)), key=lambda i: -want[i])
    for path in ("/rerank", "/v1/rerank"):  # Jina: usage, documents by default
        r = HTTP.post(f"{srv.url}{path}", json={"model": "m", "query": "the cat", "documents": DOCS,
                                                "top_n": 2}).json()
        assert [x["index"] for x in r["results"]] == order[:2]
        assert r["results"][0]["document"] == {"text": DOCS[order[0]]} and r["usage"]["total_tokens"] > 0
    r = HTTP.post(f"{srv.url}/v2/rerank", json={"model": "m", "query": "the cat",
                                                "documents": [{"text": d} for d in DOCS]}).json()
    assert [x["index"] for x in r["results"]] == order  # Cohere: meta, no documents by default
    assert "document" not in r["results"][0] and r["meta"]["billed_units"] == {"search_units": 1}
    r = HTTP.post(f"{srv.url}/classify", json={"model": "m", "input": ["the cat"]}).json()
    assert r["data"][0]["num_classes"] == 1 and r["data"][0]["label"] == "LABEL_0"
    metrics = scrape(srv.url)
    assert metrics["pagedllm:pooling_requests_total"] >= 15
    assert metrics["pagedllm:pooling_input_tokens_total"] > 0
    assert metrics.get("vllm:request_success_total", 0) == 0  # generation's count is its own


def test_generator_on_embeddings_is_400():
    from pagedllm.config import default_model

    srv = _serve(default_model())
    try:
        r = HTTP.post(f"{srv.url}/v1/embeddings", json={"model": "m", "input": "Once"})
        assert r.status_code == 400 and "/v1/chat/completions" in r.json()["error"]["message"]
    finally:
        srv.stop()

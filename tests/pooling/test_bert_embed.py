"""BERT embedders against sentence-transformers on the same folder (float32)."""
from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, PoolingParams
from pagedllm.errors import ValidationError
from tests.pooling.st_models import save_st_bert

TEXTS = ["the cat sat on the mat", "a dog", "red cats ran far on a blue mat the end", "s"]


def _cos(a, b):
    a, b = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    return float(a @ b / (a.norm() * b.norm()))


@pytest.fixture(scope="module")
def cls_dense(tmp_path_factory):
    return save_st_bert(tmp_path_factory.mktemp("bert"), pooling="cls", dense=16, matryoshka=True,
                        prompts={"query": "the ", "doc": ""})


def _reference(folder, texts, **kw):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(folder), device="cpu").encode(texts, convert_to_numpy=True, **kw)


@pytest.mark.parametrize("pooling", ["cls", "mean", "lasttoken"])
def test_embed_matches_sentence_transformers(tmp_path, pooling):
    folder = save_st_bert(tmp_path, pooling=pooling, dense=16 if pooling == "cls" else None,
                          normalize=pooling != "mean")
    llm = LLM(str(folder))
    assert llm.llm_engine.runner_type == "pooling"  # detected from modules.json
    outs = llm.embed(TEXTS)
    ref = _reference(folder, TEXTS)
    for out, want in zip(outs, ref):
        got = out.outputs.embedding
        assert len(got) == len(want)
        assert _cos(got, want) >= 0.99999
        assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-4


def test_xlm_roberta_embedder_matches_sentence_transformers(tmp_path):
    folder = save_st_bert(tmp_path, pooling="mean", dense=None, arch="xlm-roberta")
    # No [UNK]: its id is XLM-R's padding id, whose position transformers does not count.
    texts = ["the cat sat on the mat", "a dog", "red cats ran far on a blue mat"]
    llm = LLM(str(folder))
    assert llm.llm_engine.max_model_len == 64  # 66 positions, counted from padding id 1 + 1
    outs = llm.embed(texts)
    assert all(1 not in o.prompt_token_ids for o in outs)
    for out, want in zip(outs, _reference(folder, texts)):
        assert _cos(out.outputs.embedding, want) >= 0.99999
        assert max(abs(a - b) for a, b in zip(out.outputs.embedding, want)) <= 1e-4


def test_modernbert_embedder_matches_sentence_transformers(tmp_path):
    folder = save_st_bert(tmp_path, pooling="mean", dense=None, arch="modernbert")
    texts = TEXTS + ["the cat sat on the red mat and the dog ran far on a blue mat"]  # past the window
    outs = LLM(str(folder), max_num_batched_tokens=64).embed(texts)
    assert len(outs[-1].prompt_token_ids) > 8
    for out, want in zip(outs, _reference(folder, texts)):
        assert _cos(out.outputs.embedding, want) >= 0.99999
        assert max(abs(a - b) for a, b in zip(out.outputs.embedding, want)) <= 1e-4


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_mixed_batch_gives_each_input_its_solo_vector(cls_dense, async_scheduling):
    llm = LLM(str(cls_dense), max_num_batched_tokens=24, async_scheduling=async_scheduling)
    assert llm.llm_engine.executor.runner.kv_caches == []  # an encoder keeps no KV
    batch = [o.outputs.embedding for o in llm.embed(TEXTS)]
    for text, vec in zip(TEXTS, batch):
        solo = llm.embed(text)[0].outputs.embedding
        assert max(abs(a - b) for a, b in zip(vec, solo)) <= 1e-6


def test_matryoshka_dimensions_truncate_then_renormalize(cls_dense):
    llm = LLM(str(cls_dense))
    full = llm.embed(TEXTS[0])[0].outputs.embedding
    cut = llm.embed(TEXTS[0], PoolingParams(dimensions=8))[0].outputs.embedding
    want = torch.nn.functional.normalize(torch.tensor(full[:8]), dim=0)
    assert len(cut) == 8 and torch.allclose(torch.tensor(cut), want, atol=1e-6)
    with pytest.raises(ValidationError, match="exceeds the model's embedding size 16"):
        llm.embed(TEXTS[0], PoolingParams(dimensions=17))


def test_prompts_from_sentence_transformers(cls_dense):
    llm = LLM(str(cls_dense))
    got = llm.embed(["cat sat"], prompt_name="query")[0].outputs.embedding
    want = _reference(cls_dense, ["cat sat"], prompt_name="query")[0]
    assert _cos(got, want) >= 0.99999


def test_bad_inputs_are_validation_errors(cls_dense):
    llm = LLM(str(cls_dense), max_model_len=16)
    with pytest.raises(ValidationError, match="empty"):
        llm.embed([])
    with pytest.raises(ValidationError, match="empty string"):
        llm.embed([""])
    with pytest.raises(ValidationError, match="has 23 tokens .* maximum length is 16"):
        llm.embed(" ".join(["cat"] * 21))
    # Asked to truncate, it keeps the first 16 tokens with [CLS] and [SEP] (the tokenizer's side).
    out = llm.embed(" ".join(["cat"] * 21), truncate_prompt_tokens=16)[0]
    assert len(out.prompt_token_ids) == 16 and out.prompt_token_ids[-1] == 3
    with pytest.raises(ValidationError, match="pooling model"):
        llm.generate("the cat")


def test_model_without_matryoshka_refuses_dimensions(tmp_path):
    folder = save_st_bert(tmp_path, dense=None)
    with pytest.raises(ValidationError, match="matryoshka"):
        LLM(str(folder)).embed("a cat", PoolingParams(dimensions=4))


def test_engine_core_in_its_own_process(cls_dense, monkeypatch):
    inproc = LLM(str(cls_dense)).embed(TEXTS)
    monkeypatch.setenv("PAGEDLLM_ENABLE_MULTIPROCESSING", "1")  # PoolingParams and vectors on the wire
    llm = LLM(str(cls_dense))
    try:
        assert type(llm.llm_engine.engine_core).__name__ == "MPEngineCoreClient"
        for got, want in zip(llm.embed(TEXTS), inproc):
            # Another process may run other thread counts: sums in another order.
            assert max(abs(a - b) for a, b in zip(got.outputs.embedding, want.outputs.embedding)) <= 1e-6
    finally:
        llm.llm_engine.shutdown()


def test_bfloat16_weights_stay_close_to_float32(cls_dense):
    want = [o.outputs.embedding for o in LLM(str(cls_dense)).embed(TEXTS)]
    got = [o.outputs.embedding for o in LLM(str(cls_dense), dtype="bfloat16").embed(TEXTS)]
    assert all(_cos(a, b) >= 0.999 for a, b in zip(got, want))


@pytest.mark.slow
def test_data_parallel_replicas_pool_too(cls_dense):
    want = [o.outputs.embedding for o in LLM(str(cls_dense)).embed(TEXTS)]
    llm = LLM(str(cls_dense), data_parallel_size=2)
    try:
        got = [o.outputs.embedding for o in llm.embed(TEXTS)]
    finally:
        llm.llm_engine.shutdown()
    assert all(max(abs(a - b) for a, b in zip(g, w)) <= 1e-6 for g, w in zip(got, want))

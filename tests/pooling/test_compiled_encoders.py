"""Encoders (no layer keeps KV) run the compiled forward by default, as generators do: compiled
and eager engines on the same folder give the same vectors and scores within 1e-5, over steps of
different lengths, with and without a text pair's token types, and no graph is compiled after
startup. A compiled/eager difference is a bug, not a tolerance to widen.

Each compiled case compiles one tiny model (seconds with a warm inductor cache): marked slow.
"""
from __future__ import annotations

import pytest
import torch
import torch._dynamo.utils

from pagedllm import LLM
from pagedllm.layers.forward_context import set_forward_context
from pagedllm.layers.token_type_ids import token_type_ids_op
from pagedllm.runner.compile import compile_disabled_reason
from tests.pooling import test_cross_encoder, test_embedding_gemma, test_nomic_bert
from tests.pooling.st_models import save_st_bert

TEXTS = ["the cat sat on the mat", "a dog", "red cats ran far on a blue mat the end", "s",
         "the cat sat on the red mat and the dog ran far on a blue mat"]  # past the local windows
QUERIES, DOCS = test_cross_encoder.QUERIES, test_cross_encoder.DOCS
TOL = 1e-5
CPU = torch.device("cpu")


def _folder(name: str, tmp_path) -> str:
    if name == "bert":
        return str(save_st_bert(tmp_path, pooling="cls", dense=16))
    if name == "modernbert":
        return str(save_st_bert(tmp_path, pooling="mean", dense=None, arch="modernbert"))
    if name == "nomic-bert":
        test_nomic_bert._save(tmp_path)
        return str(tmp_path)
    if name == "embedding-gemma":
        return str(test_embedding_gemma._save(tmp_path))
    return str(test_cross_encoder._save(tmp_path, name.removesuffix("-cross"), num_labels=1))


def _workload(llm: LLM, cross: bool) -> list[list[float]]:
    """Every output vector (or score) of: the whole batch in one step, then each input alone
    (steps of other lengths); a cross-encoder also scores pairs (token types) beside single texts."""
    if not cross:
        outs = llm.embed(TEXTS) + [o for t in TEXTS for o in llm.embed(t)]
        return [o.outputs.embedding for o in outs]
    scores = [o.outputs.score for q in QUERIES for o in llm.score(q, DOCS)]
    scores += [o.outputs.score for o in llm.score(QUERIES[1], DOCS[2])]
    probs = [o.outputs.probs for o in llm.classify(DOCS)] + [o.outputs.probs for o in llm.classify(TEXTS[3])]
    return [scores] + probs


@pytest.mark.slow
@pytest.mark.parametrize("name", ["bert", "bert-cross", "xlm-roberta-cross", "modernbert", "nomic-bert",
                                  "embedding-gemma"])
def test_compiled_encoder_matches_eager_without_recompiling(tmp_path, name):
    reason = compile_disabled_reason(False, CPU)
    if reason is not None:
        from ci_support import skip_unless_ci
        skip_unless_ci(f"no compiled mode here: {reason}")
    folder = _folder(name, tmp_path)
    kwargs = dict(device="cpu", dtype="float32", max_num_batched_tokens=96)
    want = _workload(LLM(folder, enforce_eager=True, **kwargs), name.endswith("-cross"))
    llm = LLM(folder, **{**kwargs, "enforce_eager": False})
    assert llm.llm_engine.executor.runner.compiled is not None
    assert llm.llm_engine.executor.runner.kv_caches == []  # an encoder: no KV, still compiled
    counters = torch._dynamo.utils.counters
    frames, graphs = counters["frames"]["total"], counters["stats"]["unique_graphs"]
    got = _workload(llm, name.endswith("-cross"))
    # Steady state: the one graph served every step (no frame converted, no new graph).
    assert counters["frames"]["total"] == frames and counters["stats"]["unique_graphs"] == graphs
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert len(g) == len(w)
        assert max(abs(a - b) for a, b in zip(g, w)) <= TOL
    runner = llm.llm_engine.executor.runner
    if getattr(runner.model, "supports_token_types", False):
        _check_token_types_reach_the_graph(runner)
        assert counters["stats"]["unique_graphs"] == graphs


@torch.inference_mode()
def _check_token_types_reach_the_graph(runner) -> None:
    """The tiny cross-encoders' scores barely move with their inputs, so the step's hidden
    states themselves: a pair's types, compiled, give the eager rows, not the rows without types."""
    ids = torch.arange(5, 17)
    positions = torch.arange(12)
    types = (positions >= 5).long()
    with set_forward_context(None, types):
        eager, compiled = runner.model(ids, positions), runner.compiled(ids, positions)
    assert (compiled - eager).abs().max() <= TOL
    assert (compiled - runner.model(ids, positions)).abs().max() > 1e-2


def test_token_type_op_reads_the_forward_context():
    ids = torch.tensor([5, 6, 7, 8])
    types = torch.tensor([0, 0, 1, 1])
    assert torch.equal(token_type_ids_op(ids), torch.zeros(4, dtype=torch.long))  # no step: all 0
    with set_forward_context(None, types):
        got = token_type_ids_op(ids)
    assert torch.equal(got, types) and got.data_ptr() != types.data_ptr()
    assert torch.equal(torch.ops.pagedllm.token_type_ids(ids), torch.zeros(4, dtype=torch.long))

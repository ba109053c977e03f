"""A decoder as a Qwen3-Reranker-style yes/no reranker: the score is the softmax of the logits
of two tokens at the last position, against transformers' logits."""
from __future__ import annotations

import pytest
import torch

from pagedllm import LLM
from pagedllm.config import DEFAULT_MODEL_DIR
from tests.pooling.st_models import save_tiny_qwen3

pytestmark = pytest.mark.skipif(not DEFAULT_MODEL_DIR.is_dir(), reason="demo model (its tokenizer) not present")


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3")
    return folder, save_tiny_qwen3(folder)


def test_yes_no_scores_match_transformers(qwen3):
    folder, model = qwen3
    no, yes = 100, 200
    llm = LLM(str(folder), runner="pooling", pooler_config={"classifier_from_token": [no, yes]})
    texts = ["Query: a cat\nDocument: the cat sat\nRelevant:", "Query: a cat\nDocument: dogs\nRelevant:", "Hi"]
    outs = llm.classify(texts)
    for out in outs:
        with torch.no_grad():
            logits = model(torch.tensor([out.prompt_token_ids])).logits[0, -1]
        want = torch.softmax(logits[[no, yes]], dim=0)[1]
        assert len(out.outputs.probs) == 1
        assert abs(out.outputs.probs[0] - float(want)) <= 1e-5
    ranked = [o.outputs.score for o in llm.score("Query: a cat", ["the cat sat", "dogs", "a red mat"])]
    assert len(ranked) == 3 and all(0.0 < s < 1.0 for s in ranked)


def test_token_strings_resolve_in_the_vocabulary(qwen3):
    from transformers import AutoTokenizer

    folder, _ = qwen3
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    no_tok, yes_tok = tokenizer.convert_ids_to_tokens([100, 200])
    by_name = LLM(str(folder), runner="pooling", pooler_config={"classifier_from_token": [no_tok, yes_tok]})
    by_id = LLM(str(folder), runner="pooling", pooler_config={"classifier_from_token": [100, 200]})
    assert by_name.classify("Hi")[0].outputs.probs == by_id.classify("Hi")[0].outputs.probs

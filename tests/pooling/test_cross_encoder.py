"""Cross-encoders (BERT and XLM-R with a classification head) against sentence-transformers'
CrossEncoder and transformers on the same folder."""
from __future__ import annotations

import pytest
import torch

from pagedllm import LLM
from pagedllm.errors import ValidationError
from tests.pooling.st_models import bert_config, one_token_type, write_bert_tokenizer

QUERIES = ["the cat", "a red dog ran"]
DOCS = ["the cat sat on the mat", "a dog ran far", "blue mats", "the red cat sat on a dog"]


def _save(folder, arch: str, num_labels: int):
    from transformers import BertForSequenceClassification, XLMRobertaConfig, XLMRobertaForSequenceClassification

    torch.manual_seed(1)
    tokenizer, vocab_size = write_bert_tokenizer(folder / "tok")
    if arch == "bert":
        model = BertForSequenceClassification(bert_config(vocab_size, num_labels=num_labels))
    else:
        cfg = XLMRobertaConfig(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                               intermediate_size=64, max_position_embeddings=66, type_vocab_size=1,
                               pad_token_id=1, num_labels=num_labels)
        model = XLMRobertaForSequenceClassification(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "LayerNorm" in name or "bias" in name or "token_type" in name:  # make each count
                p.add_(torch.randn_like(p) * 0.5)
    out = folder / "model"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if arch == "xlm-roberta":
        one_token_type(out)
    return out


@pytest.mark.parametrize("arch", ["bert", "xlm-roberta"])
def test_score_matches_cross_encoder(tmp_path, arch):
    from sentence_transformers import CrossEncoder

    folder = _save(tmp_path, arch, num_labels=1)
    reference = CrossEncoder(str(folder), device="cpu")
    llm = LLM(str(folder))
    assert llm.llm_engine.runner_type == "pooling"
    assert_scores_match(llm, reference)


def assert_scores_match(llm: LLM, reference) -> None:
    """Every query's scores within 1e-4 of ``reference`` (a CrossEncoder), in the same order."""
    for query in QUERIES:
        want = reference.predict([(query, d) for d in DOCS])
        got = [o.outputs.score for o in llm.score(query, DOCS)]
        assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-4
        assert sorted(range(len(DOCS)), key=lambda i: -got[i]) == sorted(range(len(DOCS)), key=lambda i: -want[i])


def test_classify_softmax_over_labels(tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    folder = _save(tmp_path, "bert", num_labels=3)
    model = AutoModelForSequenceClassification.from_pretrained(str(folder)).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    llm = LLM(str(folder))
    outs = llm.classify(DOCS)
    for text, out in zip(DOCS, outs):
        with torch.no_grad():
            want = torch.softmax(model(**tokenizer(text, return_tensors="pt")).logits[0], dim=-1)
        assert len(out.outputs.probs) == 3
        assert torch.allclose(torch.tensor(out.outputs.probs), want, atol=1e-5)


def test_pair_truncation_keeps_special_tokens(tmp_path):
    folder = _save(tmp_path, "bert", num_labels=1)
    llm = LLM(str(folder))
    long_doc = " ".join(["cat"] * 100)
    with pytest.raises(ValidationError, match="has 105 tokens but this model's maximum length is 64"):
        llm.score("the cat", long_doc)
    scores = llm.score("the cat", [long_doc, DOCS[0]], truncate_prompt_tokens=20)
    assert len(scores) == 2 and all(0 < s.outputs.score < 1 for s in scores)
    ids = scores[0].prompt_token_ids
    assert len(ids) == 20 and ids[0] == 2 and ids[-1] == 3 and ids.count(3) == 2  # [CLS] a [SEP] b [SEP]

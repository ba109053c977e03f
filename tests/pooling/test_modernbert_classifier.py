"""ModernBERT's sequence classifier against transformers' ModernBertForSequenceClassification on
the same folder (float32): softmax over three labels, CLS and mean pooling of the head's input,
inputs longer than the local window, several inputs per step."""
from __future__ import annotations

import pytest
import torch

from pagedllm import LLM
from tests.pooling.st_models import write_bert_tokenizer

TEXTS = ["the cat sat on the mat", "a dog", "the cat sat on the red mat and the dog ran far on a blue mat"]


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_modernbert_classifier_matches_transformers(tmp_path, pooling):
    from transformers import ModernBertConfig, ModernBertForSequenceClassification

    torch.manual_seed(0)
    tokenizer, vocab_size = write_bert_tokenizer(tmp_path)
    config = ModernBertConfig(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
        local_attention=8, global_attn_every_n_layers=3, max_position_embeddings=128, pad_token_id=0,
        bos_token_id=2, eos_token_id=3, cls_token_id=2, sep_token_id=3, classifier_pooling=pooling,
        id2label={0: "neg", 1: "neu", 2: "pos"}, label2id={"neg": 0, "neu": 1, "pos": 2})
    model = ModernBertForSequenceClassification(config).eval()
    with torch.no_grad():  # a random init's norms are identities: make them count
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), max_num_batched_tokens=40)
    assert llm.llm_engine.runner_type == "pooling"
    outs = llm.classify(TEXTS)
    assert len(outs[-1].prompt_token_ids) > 8
    for out in outs:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([out.prompt_token_ids])).logits[0]
        want = torch.softmax(logits.double(), dim=-1)
        got = torch.tensor(out.outputs.probs, dtype=torch.float64)
        assert len(got) == 3 and float((got - want).abs().max()) <= 1e-4

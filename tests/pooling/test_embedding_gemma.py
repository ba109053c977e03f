"""EmbeddingGemma (Gemma 3's text model with bidirectional attention, local layers windowed
both ways) against sentence-transformers on the same folder, in float32: mean pooling, a Dense
and Normalize, as the real checkpoint's modules. Inputs are longer than the local window."""
from __future__ import annotations

import warnings

import torch

from pagedllm import LLM
from tests.pooling.st_models import write_bert_tokenizer

TEXTS = ["the cat sat on the mat", "a dog", "red cats ran far on a blue mat the end",
         "the cat sat on the red mat and the dog ran far on a blue mat"]


def _save(folder):
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Dense, Normalize, Pooling, Transformer
    from transformers import Gemma3TextConfig, Gemma3TextModel

    warnings.filterwarnings("ignore", category=DeprecationWarning)
    torch.manual_seed(0)
    tokenizer, vocab_size = write_bert_tokenizer(folder / "tok")
    config = Gemma3TextConfig(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, sliding_window=8, max_position_embeddings=128,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        use_bidirectional_attention=True, pad_token_id=0, bos_token_id=2, eos_token_id=3)
    model = Gemma3TextModel(config)
    with torch.no_grad():  # a random init's norms are identities: make them count
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    hf = folder / "hf"
    model.save_pretrained(hf)
    tokenizer.save_pretrained(hf)
    st = SentenceTransformer(modules=[Transformer(str(hf)), Pooling(32, "mean"), Dense(32, 16, bias=False,
                                      activation_function=torch.nn.Identity()), Normalize()])
    st.save(str(folder / "st"))
    return folder / "st"


def test_embedding_gemma_matches_sentence_transformers(tmp_path):
    from sentence_transformers import SentenceTransformer

    folder = _save(tmp_path)
    llm = LLM(str(folder), max_num_batched_tokens=40)  # the inputs share steps
    assert llm.llm_engine.executor.runner.kv_caches == []  # bidirectional: no layer keeps KV
    outs = llm.embed(TEXTS)
    assert len(outs[-1].prompt_token_ids) > 8  # past the window's reach on each side
    ref = SentenceTransformer(str(folder), device="cpu").encode(TEXTS, convert_to_numpy=True)
    for out, want in zip(outs, ref):
        got, want = torch.tensor(out.outputs.embedding, dtype=torch.float64), torch.tensor(want, dtype=torch.float64)
        assert float(got @ want / (got.norm() * want.norm())) >= 0.99999
        assert float((got - want).abs().max()) <= 1e-4

"""XLM-RoBERTa GGUF files written by llama.cpp's own converter from tiny random folders with a
SentencePiece Unigram tokenizer (trained here, as bge-m3's ships): a cross-encoder (RoBERTa's
classification head: bge-reranker-v2-m3's shape) against sentence-transformers' CrossEncoder on
the folder, served on the score and rerank routes; an embedder against SentenceTransformer. The
tokenizer and the model kind come from the file."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import httpx
import pytest
import torch

from benchmarks.llama_cpp_convert import LLAMA_CPP, converter_missing
from benchmarks.llama_cpp_convert import convert_to_gguf as convert
from pagedllm import LLM
from tests.pooling.test_cross_encoder import DOCS, QUERIES, assert_scores_match

TEXTS = ["the cat sat on the mat", "a dog", "red cats ran far on a blue mat the end", "s",
         "The Cats, SAT on a MAT!  xyz"]
CORPUS = [*DOCS, *QUERIES, "red cats ran far on a blue mat", "the dog sat far"]

pytestmark = [pytest.mark.skipif(converter_missing() is not None, reason=str(converter_missing())),
              pytest.mark.slow]


_TRAIN = """
import shutil, sys
from pathlib import Path
import sentencepiece as spm
from transformers import XLMRobertaTokenizer
folder, corpus = Path(sys.argv[1]), sys.argv[2].split("|")
spm.SentencePieceTrainer.train(sentence_iterator=iter(corpus * 10), model_prefix=str(folder / "sp"),
                               vocab_size=40, model_type="unigram", hard_vocab_limit=False, minloglevel=2)
shutil.move(folder / "sp.model", folder / "sentencepiece.bpe.model")
XLMRobertaTokenizer.from_pretrained(str(folder)).save_pretrained(str(folder))
"""


def _tokenizer(folder):
    """An XLM-R tokenizer on a Unigram SentencePiece model trained on CORPUS, saved with its
    tokenizer.json (in a child process: sentencepiece is the converter's own dependency,
    installed beside it, and transformers looks for it once, at import)."""
    from transformers import AutoTokenizer

    folder.mkdir(parents=True)
    env = dict(os.environ, PYTHONPATH=str(LLAMA_CPP.parent / "convert-deps"))
    subprocess.run([sys.executable, "-c", _TRAIN, str(folder), "|".join(CORPUS)], check=True, env=env,
                   capture_output=True)
    return AutoTokenizer.from_pretrained(str(folder))


def _save(root, head: bool):
    """A random XLM-R folder: with a one-label classification head, or as a sentence-transformers
    mean-pooling embedder."""
    from transformers import XLMRobertaConfig, XLMRobertaForSequenceClassification, XLMRobertaModel

    tokenizer = _tokenizer(root / "tok")
    torch.manual_seed(2)
    cfg = XLMRobertaConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=64, max_position_embeddings=66, type_vocab_size=1, pad_token_id=1,
                           num_labels=1)
    model = (XLMRobertaForSequenceClassification if head else XLMRobertaModel)(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "LayerNorm" in name or "bias" in name:  # a random init's are zeros and ones
                p.add_(torch.randn_like(p) * 0.5)
    out = root / "hf"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    shutil.copy(root / "tok" / "sentencepiece.bpe.model", out)  # what the converter reads
    if head:
        return out
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    SentenceTransformer(modules=[Transformer(str(out)), Pooling(32, "mean"), Normalize()]).save(str(root / "st"))
    shutil.copy(out / "sentencepiece.bpe.model", root / "st")
    return root / "st"


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf_xlmr_ce")
    folder = _save(root, head=True)
    return folder, convert(folder, root / "ce.gguf")


def test_xlm_roberta_cross_encoder_gguf_matches_cross_encoder(reranker):
    from sentence_transformers import CrossEncoder

    folder, path = reranker
    reference = CrossEncoder(str(folder), device="cpu")
    llm = LLM(str(path))
    assert llm.llm_engine.runner_type == "pooling"
    tok = llm.get_tokenizer()  # the Unigram tokenizer rebuilt from the file's pieces
    for text in TEXTS:
        assert tok(text)["input_ids"] == reference.tokenizer(text)["input_ids"], text
    assert tok("a dog", "the cat")["input_ids"] == reference.tokenizer("a dog", "the cat")["input_ids"]
    assert_scores_match(llm, reference)


def test_xlm_roberta_cross_encoder_gguf_serves_rerank(reranker):
    from pagedllm.engine.async_engine import AsyncLLM
    from pagedllm.entrypoints.openai.server import build_app
    from tests.entrypoints.server_utils import ServerThread

    folder, path = reranker
    want = [o.outputs.score for o in LLM(str(folder)).score("the cat", DOCS)]  # the folder, not the file
    order = sorted(range(len(DOCS)), key=lambda i: -want[i])
    srv = ServerThread(build_app(AsyncLLM.from_engine_args(str(path)), ["m"])).start()
    try:
        r = httpx.post(f"{srv.url}/v1/score", json={"model": "m", "text_1": "the cat", "text_2": DOCS}).json()
        assert max(abs(d["score"] - w) for d, w in zip(r["data"], want)) <= 1e-4
        r = httpx.post(f"{srv.url}/v1/rerank", json={"model": "m", "query": "the cat", "documents": DOCS}).json()
        assert [x["index"] for x in r["results"]] == order
        r = httpx.post(f"{srv.url}/v1/completions", json={"model": "m", "prompt": "a", "max_tokens": 2})
        assert r.status_code == 400 and "/rerank" in r.text
    finally:
        srv.stop()


def test_xlm_roberta_embedder_gguf_matches_sentence_transformers(tmp_path):
    from sentence_transformers import SentenceTransformer

    folder = _save(tmp_path, head=False)
    llm = LLM(str(convert(folder, tmp_path / "emb.gguf")))
    assert llm.llm_engine.runner_type == "pooling"
    ref = SentenceTransformer(str(folder), device="cpu").encode(TEXTS, convert_to_numpy=True)
    for out, want in zip(llm.embed(TEXTS), ref):
        got, want = torch.tensor(out.outputs.embedding, dtype=torch.float64), torch.tensor(want, dtype=torch.float64)
        assert torch.nn.functional.cosine_similarity(got, want, dim=0) >= 0.99999
        assert (got - want).abs().max() <= 1e-4

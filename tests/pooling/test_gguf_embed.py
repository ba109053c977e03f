"""GGUF embedders written by llama.cpp's own converter (benchmarks/llama_cpp_convert.py) from
a tiny random folder: a ``bert`` file against sentence-transformers on that folder, a
``nomic-bert`` file against pagedllm on the folder (tested against a float64 computation in
test_nomic_bert.py), a decoder with ``pooling_type`` in its metadata; the runner type, the pooling
and the WordPiece tokenizer all come from the file."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks.llama_cpp_convert import convert_to_gguf as convert
from benchmarks.llama_cpp_convert import converter_missing
from pagedllm import LLM
from tests.pooling import test_nomic_bert as nomic
from tests.pooling.st_models import save_st_bert

REPO = Path(__file__).resolve().parents[2]
STORIES = REPO.parent / "shared" / "models" / "stories260K" / "hf"
TEXTS = ["the cat sat on the mat", "a dog", "red cats ran far on a blue mat the end", "s",
         "The Cats, SAT on a MAT! xyz"]
# F16 rounds each weight to 2^-11 of itself, Q8_0 to 1/254 of its block's largest: a unit vector
# after 2 layers moves by about that much times a few, per coordinate (bounds with 3x headroom).
LOOSE = {"f16": (0.99999, 2e-4), "q8_0": (0.9999, 5e-3)}

pytestmark = pytest.mark.skipif(converter_missing() is not None, reason=str(converter_missing()))


def _cos(a, b) -> float:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return float(a @ b / (a.norm() * b.norm()))


def _max_diff(a, b) -> float:
    return float((torch.as_tensor(a, dtype=torch.float64) - torch.as_tensor(b, dtype=torch.float64)).abs().max())


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    """(sentence-transformers folder, {outtype: GGUF file})."""
    root = tmp_path_factory.mktemp("gguf_bert")
    folder = save_st_bert(root, pooling="mean", dense=None, normalize=True)
    return folder, {t: convert(folder, root / f"bert-{t}.gguf", t) for t in ("f32", "f16", "q8_0")}


def test_bert_gguf_matches_sentence_transformers(bert):
    from sentence_transformers import SentenceTransformer

    folder, files = bert
    st = SentenceTransformer(str(folder), device="cpu")
    llm = LLM(str(files["f32"]))
    assert llm.llm_engine.runner_type == "pooling"  # detected from the file's architecture
    tok = llm.get_tokenizer()
    for text in TEXTS:  # the WordPiece tokenizer rebuilt from the file's vocabulary
        assert tok(text)["input_ids"] == st.tokenizer(text)["input_ids"], text
    assert tok("a dog", "the cat")["token_type_ids"] == st.tokenizer("a dog", "the cat")["token_type_ids"]
    ref = st.encode(TEXTS, convert_to_numpy=True)
    for out, want in zip(llm.embed(TEXTS), ref):
        assert _cos(out.outputs.embedding, want) >= 0.99999
        assert _max_diff(out.outputs.embedding, want) <= 1e-4


@pytest.mark.parametrize("outtype", ["f16", "q8_0"])
def test_bert_gguf_half_and_q8_0_stay_close(bert, outtype):
    from sentence_transformers import SentenceTransformer

    folder, files = bert
    ref = SentenceTransformer(str(folder), device="cpu").encode(TEXTS, convert_to_numpy=True)
    cos_min, diff_max = LOOSE[outtype]
    for out, want in zip(LLM(str(files[outtype])).embed(TEXTS), ref):
        assert _cos(out.outputs.embedding, want) >= cos_min
        assert _max_diff(out.outputs.embedding, want) <= diff_max


def test_nomic_bert_gguf_matches_an_independent_computation(tmp_path):
    # llama.cpp's converter takes nomic-embed-text's own position fields only (8192, trained 2048),
    # and reads the sizes through transformers' NomicBertConfig, which knows its own names only
    native = {"hidden_size": nomic.HIDDEN, "num_hidden_layers": nomic.LAYERS, "num_attention_heads": nomic.HEADS,
              "intermediate_size": nomic.INNER, "max_position_embeddings": 2048}
    weights = nomic._save(tmp_path / "hf", n_positions=8192, max_trained_positions=2048, rotary_emb_scale_base=None,
                          **native)
    llm = LLM(str(convert(tmp_path / "hf", tmp_path / "nomic.gguf")), max_num_batched_tokens=24)
    assert llm.llm_engine.runner_type == "pooling" and llm.llm_engine.max_model_len == 2048
    for out in llm.embed(TEXTS):
        got = torch.tensor(out.outputs.embedding, dtype=torch.float64)
        want = nomic._reference(weights, out.prompt_token_ids)
        want = want / want.norm()  # llama.cpp's default: normalized (the folder has no Normalize)
        assert _cos(got, want) >= 0.99999
        assert _max_diff(got, want) <= 1e-4


def _with_pooling_type(src: Path, dst: Path, value: int) -> Path:
    """``src`` with ``<arch>.pooling_type`` added, copied by the gguf package's own metadata
    editor (what a Qwen3-Embedding file carries; llama.cpp's Llama converter writes none)."""
    import gguf
    from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata

    reader = gguf.GGUFReader(str(src))
    arch = reader.get_field("general.architecture").contents()
    writer = gguf.GGUFWriter(str(dst), arch=arch, endianess=reader.endianess)
    copy_with_new_metadata(reader, writer, {f"{arch}.pooling_type": MetadataDetails(
        gguf.GGUFValueType.UINT32, value)}, [])
    return dst


@pytest.fixture(scope="module")
def stories(tmp_path_factory):
    """The demo model (Llama) as llama.cpp's converter writes it: no pooling_type."""
    return convert(STORIES, tmp_path_factory.mktemp("gguf_stories") / "stories.gguf")


@pytest.mark.parametrize("pooling_type, name", [(1, "MEAN"), (3, "LAST")])
def test_decoder_gguf_with_pooling_type_is_an_embedder(tmp_path, stories, pooling_type, name):
    plain = stories
    assert LLM(str(plain)).llm_engine.runner_type == "generate"  # no pooling_type: a generator
    llm = LLM(str(_with_pooling_type(plain, tmp_path / "embed.gguf", pooling_type)))
    assert llm.llm_engine.runner_type == "pooling"
    folder = LLM(str(STORIES), runner="pooling", pooler_config={"pooling_type": name})
    texts = ["Once upon a time", "the cat sat on the mat and looked at the dog"]
    for got, want in zip(llm.embed(texts), folder.embed(texts)):
        assert got.prompt_token_ids == want.prompt_token_ids
        assert _cos(got.outputs.embedding, want.outputs.embedding) >= 0.99999
        assert _max_diff(got.outputs.embedding, want.outputs.embedding) <= 1e-4


def test_rank_pooling_is_refused_by_name(tmp_path, stories):
    from pagedllm.errors import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match="pooling type rank"):
        LLM(str(_with_pooling_type(stories, tmp_path / "rank.gguf", 4)))


def test_bert_cross_encoder_gguf_is_refused_by_name(tmp_path):
    """llama.cpp's converter keeps a BERT cross-encoder's classifier but drops the pooler it reads
    (XLM-R's head is whole: test_gguf_xlm_roberta.py)."""
    from pagedllm.checkpoint.gguf.reader import open_gguf
    from pagedllm.errors import UnsupportedModelError
    from tests.pooling.test_cross_encoder import _save

    path = convert(_save(tmp_path, "bert", num_labels=1), tmp_path / "ce.gguf")
    tensors = open_gguf(path).tensors
    assert "cls.output.weight" in tensors and not any("pooler" in n or n.startswith("cls.weight") for n in tensors)
    with pytest.raises(UnsupportedModelError, match="BERT cross-encoder without the pooler"):
        LLM(str(path))


def test_bert_gguf_serves_embeddings(bert):
    """``pagedllm serve FILE.gguf``: /v1/embeddings answers with sentence-transformers' vectors,
    and the generation routes say which routes the file's model serves."""
    import httpx
    import openai
    from sentence_transformers import SentenceTransformer

    from pagedllm.engine.async_engine import AsyncLLM
    from pagedllm.entrypoints.openai.server import build_app
    from tests.entrypoints.server_utils import ServerThread

    folder, files = bert
    srv = ServerThread(build_app(AsyncLLM.from_engine_args(str(files["f32"])), ["m"])).start()
    try:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)
        resp = client.embeddings.create(model="m", input=TEXTS[:2], encoding_format="float")
        ref = SentenceTransformer(str(folder), device="cpu").encode(TEXTS[:2], convert_to_numpy=True)
        for d, want in zip(resp.data, ref):
            assert _cos(d.embedding, want) >= 0.99999 and _max_diff(d.embedding, want) <= 1e-4
        r = httpx.post(f"{srv.url}/v1/completions", json={"model": "m", "prompt": "a", "max_tokens": 2})
        assert r.status_code == 400 and "/v1/embeddings" in r.text
    finally:
        srv.stop()

"""One interface over checkpoint kinds (pagedllm/checkpoint/source.py): a safetensors folder, an
AWQ/GPTQ folder and a GGUF file each give their config, tokenizer path and named tensors; an
engine start reads config.json once; the models package never opens a file."""
from __future__ import annotations

import builtins
import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from pagedllm.checkpoint.gguf.quant_types import GroupQuant
from pagedllm.checkpoint.loader import load_model
from pagedllm.checkpoint.source import GGUFFile, QuantizedFolder, is_gguf_path, open_checkpoint
from pagedllm.checkpoint.tokenizer import load_hf_tokenizer
from pagedllm.errors import ModelLoadError
from tests.checkpoint.gguf.gguf_helpers import write_gguf

STORIES_HF = Path(__file__).resolve().parents[2].parent / "shared" / "models" / "stories260K" / "hf"
AWQ_FIXTURE = Path(__file__).resolve().parents[1] / "models" / "fixtures" / "awq_tiny"  # AutoAWQ's own packing
CPU = torch.device("cpu")


@pytest.fixture
def folder(tmp_path) -> Path:
    """The demo model's folder, copied (a fresh path: nothing of it is cached yet)."""
    return Path(shutil.copytree(STORIES_HF, tmp_path / "stories"))


@pytest.fixture
def config_opens(monkeypatch) -> list[str]:
    """Every open of a file named config.json for reading from now on, by path."""
    opened: list[str] = []
    real = io.open

    def counting_open(file, mode="r", *args, **kwargs):
        if isinstance(file, (str, Path)) and Path(file).name == "config.json" and "r" in mode:
            opened.append(str(file))
        return real(file, mode, *args, **kwargs)

    monkeypatch.setattr(io, "open", counting_open)
    monkeypatch.setattr(builtins, "open", counting_open)
    return opened


def test_engine_start_reads_config_json_once(folder, config_opens):
    from pagedllm import LLM, SamplingParams

    llm = LLM(str(folder), max_model_len=64, kv_cache_memory_bytes=1 << 20)
    out = llm.generate(["Once upon a time"], SamplingParams(max_tokens=4, temperature=0.0))
    assert len(out[0].outputs[0].token_ids) == 4
    # ModelInfo, the runner type, the executor's check and the loader all asked the one opened
    # checkpoint.
    assert config_opens == [str(folder / "config.json")]


def test_a_pooling_model_start_reads_config_json_once(tmp_path, config_opens):
    """The pooler's config, ModelInfo, the runner type and the loader ask the one opened checkpoint
    (sentence-transformers' own Pooling and Dense folders have config.json files of their own)."""
    from pagedllm import LLM
    from tests.pooling.st_models import save_st_bert

    folder = save_st_bert(tmp_path, pooling="mean", dense=16)
    config_opens.clear()
    llm = LLM(str(folder), max_model_len=32, kv_cache_memory_bytes=1 << 20)
    assert llm.llm_engine.runner_type == "pooling"
    assert len(llm.embed(["the cat sat"])[0].outputs.embedding) == 16
    assert config_opens.count(str(folder / "config.json")) == 1


def test_a_rewritten_config_is_read_again(folder, config_opens):
    first = open_checkpoint(folder)
    assert open_checkpoint(folder).config is first.config
    config = dict(first.config, vocab_size=first.config["vocab_size"] + 1, extra_field="x" * 10)
    (folder / "config.json").write_text(json.dumps(config))
    assert open_checkpoint(folder).config["extra_field"] == "x" * 10
    assert len(config_opens) == 2


def test_safetensors_folder_through_the_interface(folder):
    ckpt = open_checkpoint(folder)
    assert ckpt.kind == "safetensors" and not is_gguf_path(folder)
    assert ckpt.config["architectures"] == json.loads((folder / "config.json").read_text())["architectures"]
    assert load_hf_tokenizer(ckpt.tokenizer_path)("Once").input_ids
    tensors = dict(ckpt.tensors())
    model, config = load_model(str(folder), torch.float32, CPU)
    assert config is ckpt.config
    embed = tensors["model.embed_tokens.weight"]
    assert torch.equal(model.model.embed_tokens.weight, embed.float())


def test_gguf_file_through_the_interface(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, tie_word_embeddings=False))
    path = write_gguf(tmp_path / "m.gguf", hf, "llama", lambda name, shape: 8 if len(shape) == 2 else 0)
    ckpt = open_checkpoint(path)
    assert isinstance(ckpt, GGUFFile) and ckpt.kind == "gguf" and is_gguf_path(path)
    assert ckpt.config["num_hidden_layers"] == 1 and ckpt.config["hidden_size"] == 64
    assert ckpt.tokenizer_path == str(path)
    assert load_hf_tokenizer(ckpt.tokenizer_path)("Once").input_ids
    tensors = dict(ckpt.tensors())
    assert isinstance(tensors["blk.0.attn_output.weight"], GroupQuant)  # Q8_0 blocks, unpacked
    assert isinstance(tensors["output_norm.weight"], np.ndarray)
    model, config = load_model(str(path), torch.float32, CPU)
    assert config is ckpt.config
    assert torch.allclose(model.model.norm.weight, torch.from_numpy(tensors["output_norm.weight"]).float())


def test_awq_folder_through_the_interface():
    folder = AWQ_FIXTURE
    ckpt = open_checkpoint(folder)
    assert isinstance(ckpt, QuantizedFolder) and ckpt.kind == "awq"
    assert ckpt.config["quantization_config"]["quant_method"] == "awq"
    assert ckpt.tokenizer_path == str(folder)
    names = {name for name, _ in ckpt.tensors()}
    assert "model.layers.0.self_attn.q_proj.qweight" in names
    assert "model.layers.0.self_attn.q_proj.weight" not in names
    model, _ = load_model(str(folder), torch.float32, CPU)
    assert model.model.layers[0].self_attn.qkv_proj.weight is None  # stays 4-bit


def test_a_folder_without_config_says_so(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        open_checkpoint(tmp_path).config

"""Models by name: Hub ids resolved through huggingface_hub against a Hub served by the test
(HF_ENDPOINT), downloaded once into HF_HOME, then served offline from that cache."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from ci_support import free_port
from fake_hub import FakeHub, FakeRepo

from pagedllm.checkpoint.hub import parse_hub_id, resolve_engine_args, resolve_model, select_files
from pagedllm.errors import ModelLoadError, ValidationError

DEMO = Path(__file__).resolve().parents[2].parent / "shared" / "models" / "stories260K" / "hf"
GGUF_NAMES = ["model-Q4_K_M.gguf", "model-Q8_0.gguf", "model-IQ2_XXS.gguf", "mmproj-model-F16.gguf",
              "big-Q6_K-00001-of-00002.gguf", "big-Q6_K-00002-of-00002.gguf"]


def _demo_repo() -> FakeRepo:
    files = {p.name: p.read_bytes() for p in DEMO.iterdir() if p.is_file()}
    # Files the engine never reads: they must never be fetched.
    files.update({"README.md": b"# demo", "pytorch_model.bin": b"x" * 64, "original/consolidated.pth": b"y"})
    return FakeRepo(files, revisions={"main": "a" * 40, "v1": "b" * 40})


@pytest.fixture
def hub(tmp_path, monkeypatch):
    repos = {"demo/stories260K": _demo_repo(),
             "demo/gguf": FakeRepo({**{n: n.encode() for n in GGUF_NAMES}, "README.md": b"-"}),
             "demo/gguf2": FakeRepo({"m-Q8_0.gguf": b"8", "m-BF16.gguf": b"16"}),
             "demo/sharded": FakeRepo({"config.json": b"{}", "consolidated.safetensors": b"c",
                                       "model.safetensors.index.json": json.dumps({"weight_map": {
                                           "a": "model-00001-of-00002.safetensors",
                                           "b": "model-00002-of-00002.safetensors"}}).encode(),
                                       "model-00001-of-00002.safetensors": b"1",
                                       "model-00002-of-00002.safetensors": b"2"}),
             "demo/mistral": FakeRepo({"config.json": b"{}", "consolidated.safetensors": b"c",
                                       "model.safetensors": b"m"}),
             "demo/gated": FakeRepo({"config.json": b"{}", "model.safetensors": b"0"}, gated=True,
                                   token="hf_granted")}
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    for name in ("HF_HUB_OFFLINE", "HF_HUB_CACHE", "HF_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    with FakeHub(repos) as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        yield server


def test_parse_hub_id(tmp_path):
    assert parse_hub_id("Qwen/Qwen2.5-0.5B-Instruct") == ("Qwen/Qwen2.5-0.5B-Instruct", None)
    assert parse_hub_id("unsloth/Qwen3-8B-GGUF:Q4_K_M") == ("unsloth/Qwen3-8B-GGUF", "Q4_K_M")
    assert parse_hub_id("/abs/path") is None and parse_hub_id("./a/b") is None and parse_hub_id("one") is None
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "model").mkdir()
    assert parse_hub_id(str(tmp_path / "org" / "model")) is None  # an existing path is a path


def test_download_once_only_engine_files_then_offline(hub, monkeypatch, tmp_path):
    folder = resolve_model("demo/stories260K")
    assert Path(folder).is_relative_to(tmp_path / "hf" / "hub")
    want = sorted(p.name for p in DEMO.iterdir() if p.is_file())
    assert sorted(hub.file_gets()) == want  # no README, no .bin, no subfolder
    for name in want:
        assert (Path(folder) / name).read_bytes() == (DEMO / name).read_bytes()
    assert resolve_model("demo/stories260K") == folder
    assert sorted(hub.file_gets()) == want  # the second time, nothing is fetched again
    hub.server.shutdown()  # the Hub gone: the cache serves what it holds
    hub.server.server_close()
    assert resolve_model("demo/stories260K") == folder
    with pytest.raises(ModelLoadError, match="the Hub cannot be reached .* demo/gguf is not in the cache"):
        resolve_model("demo/gguf:Q4_K_M")
    seen = len(hub.requests)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_model("demo/stories260K") == folder
    assert len(hub.requests) == seen
    with pytest.raises(ModelLoadError, match="HF_HUB_OFFLINE=1 and demo/gguf is not in the cache"):
        resolve_model("demo/gguf:Q4_K_M")


def test_offline_gguf_from_the_cache(hub, monkeypatch):
    assert Path(resolve_model("demo/gguf:Q4_K_M")).name == "model-Q4_K_M.gguf"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert Path(resolve_model("demo/gguf:Q4_K_M")).name == "model-Q4_K_M.gguf"
    with pytest.raises(ModelLoadError, match=r"HF_HUB_OFFLINE=1, and in the cache: demo/gguf has no GGUF file "
                                             r"of quantization Q8_0; it has: Q4_K_M: run once online"):
        resolve_model("demo/gguf:Q8_0")


def test_llm_and_tokenizer_by_hub_id(hub):
    from pagedllm import LLM, SamplingParams

    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    args = dict(max_model_len=64, kv_cache_memory_bytes=1 << 20, enforce_eager=True)
    by_id = LLM("demo/stories260K", revision="v1", tokenizer="demo/stories260K", **args)
    got = by_id.generate(["Once upon a time"], params, use_tqdm=False)[0].outputs[0].token_ids
    del by_id
    local = LLM(str(DEMO), **args).generate(["Once upon a time"], params, use_tqdm=False)[0].outputs[0].token_ids
    assert list(got) == list(local)
    assert any("/resolve/v1/" in path for _, path in hub.requests)


def test_gguf_by_quantization_and_by_name(hub):
    path = resolve_model("demo/gguf:q4_k_m")
    assert Path(path).name == "model-Q4_K_M.gguf" and Path(path).read_bytes() == b"model-Q4_K_M.gguf"
    assert Path(resolve_model("demo/gguf", gguf_file="model-Q8_0.gguf")).name == "model-Q8_0.gguf"
    assert Path(resolve_model("demo/gguf:Q6_K")).name == "big-Q6_K-00001-of-00002.gguf"
    assert Path(resolve_model("demo/gguf")).name == "model-Q4_K_M.gguf"  # llama.cpp's default
    assert Path(resolve_model("demo/gguf2:bf16")).name == "m-BF16.gguf"
    assert sorted(hub.file_gets()) == sorted(["model-Q4_K_M.gguf", "model-Q8_0.gguf", *GGUF_NAMES[4:],
                                              "m-BF16.gguf"])


def test_only_the_weights_the_loader_reads(hub, monkeypatch):
    """An index's shards, or model.safetensors: never consolidated.safetensors beside them."""
    sharded = resolve_model("demo/sharded")
    assert sorted(hub.file_gets()) == ["config.json", "model-00001-of-00002.safetensors",
                                       "model-00002-of-00002.safetensors", "model.safetensors.index.json"]
    resolve_model("demo/mistral")
    assert "consolidated.safetensors" not in hub.file_gets() and "model.safetensors" in hub.file_gets()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_model("demo/sharded") == sharded


def test_errors(hub):
    with pytest.raises(ValidationError, match="no GGUF file of quantization Q5_K_M; it has: IQ2_XXS, "
                                              "Q4_K_M, Q6_K, Q8_0"):
        resolve_model("demo/gguf:Q5_K_M")
    with pytest.raises(ValidationError, match="several GGUF files: name one as demo/gguf2:QUANT"):
        resolve_model("demo/gguf2")
    with pytest.raises(ValidationError, match="has no file 'nope.gguf'"):
        resolve_model("demo/gguf", gguf_file="nope.gguf")
    with pytest.raises(ValidationError, match="nobody/nothing is neither a local path nor a Hub repository"):
        resolve_model("nobody/nothing")
    with pytest.raises(ValidationError, match="demo/stories260K has no revision 'v9'"):
        resolve_model("demo/stories260K", revision="v9")
    with pytest.raises(ModelLoadError, match="demo/gated is gated: .* set HF_TOKEN"):
        resolve_model("demo/gated")
    with pytest.raises(ValidationError, match="names a quantization and gguf_file"):
        resolve_model("demo/gguf:Q8_0", gguf_file="model-Q8_0.gguf")
    assert hub.file_gets() == []


def test_hf_token_opens_a_gated_repository(hub, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_granted")
    assert (Path(resolve_model("demo/gated")) / "model.safetensors").read_bytes() == b"0"


def test_local_paths_untouched(tmp_path):
    assert resolve_model(str(DEMO)) == str(DEMO)
    assert resolve_model(str(tmp_path), gguf_file="m.gguf") == str(tmp_path / "m.gguf")
    model, args = resolve_engine_args(str(DEMO), {"revision": None, "gguf_file": None, "max_num_seqs": 2})
    assert model == str(DEMO) and args == {"max_num_seqs": 2}


def test_select_files_tokenizer_only():
    names = ["config.json", "tokenizer.json", "model.safetensors", "quant_config.json", "chat_template.jinja"]
    assert select_files("a/b", names, None, None, tokenizer_only=True) == [
        "config.json", "tokenizer.json", "chat_template.jinja"]
    with pytest.raises(ModelLoadError, match="neither safetensors weights nor a GGUF file"):
        select_files("a/b", ["config.json", "pytorch_model.bin"], None, None)


def test_cli_generate_by_hub_id(hub, capsys):
    from pagedllm.entrypoints.cli import main

    assert main(["generate", "Once upon a time", "--model", "demo/stories260K", "--revision", "v1",
                 "--max-tokens", "4", "--temperature", "0", "--max-model-len", "64",
                 "--kv-cache-memory-bytes", str(1 << 20), "--enforce-eager"]) == 0
    assert capsys.readouterr().out.startswith("Once upon a time")
    assert {p.split("/resolve/")[1].split("/")[0] for _, p in hub.requests if "/resolve/" in p} == {"v1"}


def test_serve_a_hub_id(hub, tmp_path):
    """`pagedllm serve user/repo`: downloaded through HF_ENDPOINT, served under the Hub id."""
    port = free_port()
    log = (tmp_path / "serve.log").open("w+")
    proc = subprocess.Popen([sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "demo/stories260K",
                             "--revision", "v1", "--port", str(port), "--log-level", "warning",
                             "--max-num-seqs", "4", "--shutdown-timeout", "1", "--enforce-eager"],
                            stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "PAGEDLLM_ENABLE_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, log.seek(0) or log.read()
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        assert [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]] == ["demo/stories260K"]
        r = httpx.post(f"{url}/v1/completions", json={"model": "demo/stories260K", "prompt": "Once upon",
                                                       "max_tokens": 4}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        assert "v1" in {p.split("/resolve/")[1].split("/")[0] for _, p in hub.requests if "/resolve/" in p}
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def test_draft_model_and_lora_adapter_by_hub_id(hub, tmp_path):
    """A draft model and a LoRA adapter are named by Hub id as a model is, fetched the same way."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from pagedllm import LLM, LoRARequest, SamplingParams

    _, args = resolve_engine_args(None, {"speculative_config": {
        "method": "draft_model", "model": "demo/stories260K", "num_speculative_tokens": 2}})
    draft = Path(args["speculative_config"]["model"])
    assert draft.is_dir() and (draft / "config.json").is_file() and str(hub.url) not in str(draft)

    peft = get_peft_model(AutoModelForCausalLM.from_pretrained(DEMO, dtype=torch.float32),
                          LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.5)
    peft.save_pretrained(tmp_path / "adapter")
    hub.repos["demo/adapter"] = FakeRepo({p.name: p.read_bytes() for p in (tmp_path / "adapter").iterdir()}
                                         | {"README.md": b"-"})
    llm = LLM(str(DEMO), enable_lora=True, max_lora_rank=8, max_model_len=64, kv_cache_memory_bytes=1 << 20)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    by_id, local = (llm.generate(["Once upon a time"], params, use_tqdm=False,
                                 lora_request=LoRARequest("a", i, path))[0].outputs[0].token_ids
                    for i, path in ((1, "demo/adapter"), (2, str(tmp_path / "adapter"))))
    assert list(by_id) == list(local)
    assert any("adapter_model.safetensors" in path for _, path in hub.requests)

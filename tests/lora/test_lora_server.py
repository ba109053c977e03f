"""Serving adapters: --lora-modules by name, /v1/models with the base as parent, the request's
model picking the adapter (an unknown one a 404), the runtime load/unload routes behind the API
key and off by default, and an adapter in use refused for unloading."""
from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from pagedllm import LLM, LoRARequest, SamplingParams
from pagedllm.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.openai.server import build_app
from pagedllm.entrypoints.openai.server_options import ServerOptions
from pagedllm.errors import ValidationError

KEY = "lora-key"
PROMPT = [1, 17, 99, 230, 45, 8, 301]
ENGINE_ARGS = dict(device="cpu", dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=64)


@pytest.fixture(scope="module")
def family(lora_family):
    arch, base, adapters = lora_family
    if arch != "llama":
        pytest.skip("one family suffices for the HTTP surface")
    return base, [str(folder) for folder, _ in adapters]


def _offline_texts(base, paths) -> list[str]:
    llm = LLM(str(base), **ENGINE_ARGS)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    loras = [None] + [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(paths)]
    return [llm.generate([PROMPT], params, use_tqdm=False, lora_request=lora)[0].outputs[0].text
            for lora in loras]


CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def _app(base, options: ServerOptions):
    engine = LLMEngine(EngineConfig.from_kwargs(str(base), **ENGINE_ARGS))
    return build_app(engine, served_model_names=["base"], options=options, chat_template=CHAT_TEMPLATE)


def _complete(client, model: str, headers=None):
    return client.post("/v1/completions", headers=headers, json={
        "model": model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0.0, "ignore_eos": True})


def test_served_adapters_and_runtime_updates(family):
    base, paths = family
    want = _offline_texts(base, paths[:2])
    assert want[1] != want[0]  # the adapter changes the text: the checks below can fail
    options = ServerOptions(api_keys=(KEY,), lora_modules=(f"a0={paths[0]}",),
                            allow_runtime_lora_updating=True)
    auth = {"Authorization": f"Bearer {KEY}"}
    with TestClient(_app(base, options)) as client:
        cards = {c["id"]: c for c in client.get("/v1/models", headers=auth).json()["data"]}
        assert set(cards) == {"base", "a0"} and cards["a0"]["parent"] == "base"
        assert _complete(client, "base", auth).json()["choices"][0]["text"] == want[0]
        adapted = _complete(client, "a0", auth).json()
        assert adapted["choices"][0]["text"] == want[1]
        # A response names the adapter it ran with (as vLLM), the base when none was asked.
        assert adapted["model"] == "a0" and _complete(client, "base", auth).json()["model"] == "base"
        chat = {"messages": [{"role": "user", "content": "a b"}], "max_tokens": 2}  # ids in the tiny vocabulary
        answer = client.post("/v1/chat/completions", headers=auth, json={**chat, "model": "a0"})
        assert answer.json().get("model") == "a0", answer.text
        chunks = client.post("/v1/chat/completions", headers=auth,
                             json={**chat, "model": "a0", "stream": True}).text.split("data: ")[1:-1]
        assert chunks and all('"model":"a0"' in c.replace(" ", "") for c in chunks)
        streamed = client.post("/v1/completions", headers=auth, json={
            "model": "a0", "prompt": PROMPT, "max_tokens": 2, "stream": True}).text.split("data: ")[1:-1]
        assert streamed and all('"model":"a0"' in c.replace(" ", "") for c in streamed)
        missing = _complete(client, "nope", auth)
        assert missing.status_code == 404 and "nope" in missing.text

        body = {"lora_name": "a1", "lora_path": paths[1]}
        assert client.post("/v1/load_lora_adapter", json=body).status_code == 401
        assert client.post("/v1/load_lora_adapter", json=body, headers=auth).status_code == 200
        assert client.post("/v1/load_lora_adapter", json=body, headers=auth).status_code == 400
        assert _complete(client, "a1", auth).json()["choices"][0]["text"] == want[2]
        bad = client.post("/v1/load_lora_adapter", headers=auth,
                          json={"lora_name": "bad", "lora_path": str(base / "nowhere")})
        assert bad.status_code == 400 and "adapter_config.json" in bad.text
        names = {c["id"] for c in client.get("/v1/models", headers=auth).json()["data"]}
        assert names == {"base", "a0", "a1"}

        gone = client.post("/v1/unload_lora_adapter", json={"lora_name": "a1"}, headers=auth)
        assert gone.status_code == 200
        assert _complete(client, "a1", auth).status_code == 404
        assert client.post("/v1/unload_lora_adapter", json={"lora_name": "a1"},
                           headers=auth).status_code == 404
        assert _complete(client, "a0", auth).json()["choices"][0]["text"] == want[1]


def test_runtime_routes_off_by_default(family):
    base, paths = family
    with TestClient(_app(base, ServerOptions())) as client:
        body = {"lora_name": "a1", "lora_path": paths[1]}
        assert client.post("/v1/load_lora_adapter", json=body).status_code == 404


def test_unloading_an_adapter_in_use_is_refused(family):
    base, paths = family
    llm = LLM(str(base), **ENGINE_ARGS)
    engine = llm.llm_engine
    lora = LoRARequest("a0", 1, paths[0])
    engine.add_request("r", {"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=4), lora_request=lora)
    engine.step()
    with pytest.raises(ValidationError, match="in use"):
        engine.remove_lora(1)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.remove_lora(1) and engine.list_loras() == []

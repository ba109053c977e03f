"""The model's generation_config.json gives the same sampling defaults everywhere: the engine's
(ModelInfo), the server's --generation-config folder, and a request's per-field fallback."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from pagedllm.engine.model_info import ModelInfo
from pagedllm.entrypoints.openai.protocol import CompletionRequest
from pagedllm.entrypoints.openai.server_options import ServerOptions
from pagedllm.sampling_params import GENERATION_DEFAULT_KEYS

DEMO = Path(__file__).resolve().parents[2].parent / "shared" / "models" / "stories260K" / "hf"
GEN = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1,
       "eos_token_id": 2, "max_length": 99, "do_sample": True}


def test_one_set_of_keys_from_a_generation_config(tmp_path):
    shutil.copy(DEMO / "config.json", tmp_path / "config.json")
    (tmp_path / "generation_config.json").write_text(json.dumps(GEN))
    want = {k: GEN[k] for k in GENERATION_DEFAULT_KEYS}
    assert set(want) == {"temperature", "top_p", "top_k", "min_p", "repetition_penalty"}
    assert ModelInfo.from_folder(tmp_path).generation_defaults == want
    assert ServerOptions(generation_config=str(tmp_path)).generation_defaults({}) == want
    assert ServerOptions(generation_config="vllm").generation_defaults(want) == {}
    params = CompletionRequest(model="m", prompt="x", top_k=5).to_sampling_params(want)
    assert (params.temperature, params.top_p, params.top_k, params.min_p,
            params.repetition_penalty) == (0.6, 0.9, 5, 0.05, 1.1)  # the request's own top_k wins

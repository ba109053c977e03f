"""bfloat16 and float16 are selectable and still tell the demo model's story."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedllm import LLM, SamplingParams

DEMO = Path(__file__).resolve().parents[2].parent / "shared" / "models" / "stories260K" / "hf"


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_and_agrees_early(dtype):
    case = json.loads((DEMO.parent / "golden_greedy.json").read_text())["cases"][1]
    llm = LLM(str(DEMO), dtype=dtype, block_size=4)
    assert llm.llm_engine.executor.runner.kv_caches[0].dtype.__repr__().endswith(dtype)
    out = llm.generate({"prompt_token_ids": case["prompt_ids"]}, SamplingParams(temperature=0, max_tokens=12),
                       use_tqdm=False)[0]
    # Half precision may drift eventually; the first tokens of a confident story must agree.
    assert out.outputs[0].token_ids[:8] == case["greedy_ids"][:8]
    assert llm.get_metrics()["pagedllm:kv_cache_usage_perc"] == 0.0


def test_every_dtype_name_the_config_accepts_means_one_torch_dtype():
    import torch

    from pagedllm.config import DTYPE_ALIASES, ModelConfig
    from pagedllm.errors import ValidationError
    from pagedllm.runner.model_runner import resolve_dtype

    want = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
            "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
            "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}
    assert set(DTYPE_ALIASES) == set(want)
    for name, dtype in want.items():
        assert ModelConfig(model=str(DEMO), dtype=name).dtype == name
        assert resolve_dtype(name, torch.device("cpu")) == dtype
    with pytest.raises(ValidationError, match="dtype must be one of"):
        ModelConfig(model=str(DEMO), dtype="float64")

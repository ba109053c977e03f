"""Shared fixtures of the end-to-end engine tests.

* the demo model (stories260K, a real trained Llama) and its golden greedy continuations;
* transformers references: greedy ``generate`` and full-sequence log-softmax;
* builders of tiny random models (Llama with GQA, Qwen2, Qwen3) saved with ``save_pretrained``;
* ``assert_engine_idle``: after every scenario no request is left and every KV block is free.

The demo model lives in the shared folder beside the repository; it is never copied into the repo.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
SHARED_MODELS = REPO_ROOT.parent / "shared" / "models"
DEMO_MODEL_DIR = SHARED_MODELS / "stories260K" / "hf"
GOLDEN_GREEDY = SHARED_MODELS / "stories260K" / "golden_greedy.json"
SYNTHETIC_TOKENIZER_DIR = SHARED_MODELS / "synthetic-tokenizer-32k"

DEMO_EOS_IDS = frozenset({1, 2})  # generation_config.json: eos_token_id [1, 2]
TINY_ARCHS = ("llama_gqa", "qwen2", "qwen3")

# Varied stories-like prompts (short to long), for the demo model.
EXTRA_PROMPTS = [
    "Tom",
    "The cat sat on the mat.",
    "One day, a little boy named Tim went to the park with his mom.",
    "Sue had a red ball. She liked to throw it high in the sky. One day, the ball",
    ("There was a big tree in the garden. Every morning the birds sang in it, and the sun "
     "was warm. A small dog lived under the tree and he was happy."),
    ("Lily and Ben were friends. They liked to play with blocks and cars. One day they "
     "found a shiny box in the sand. Lily said, \"Let's open it!\" Ben was scared, but he "
     "wanted to see what was inside. They opened the box and"),
    "Once upon a time there was a fish",
    ("The sun was hot and the sky was blue. Max wanted to go swimming in the lake with his "
     "dad, but his dad was busy."),
]


# ----------------------------------------------------------------------------------------------
# Small helpers (plain functions; tests import them from conftest)
# ----------------------------------------------------------------------------------------------
def truncate_at_eos(ids: list[int], eos_ids=DEMO_EOS_IDS) -> list[int]:
    """``ids`` up to and including the first EOS (pagedllm stops there and keeps the EOS)."""
    out = []
    for t in ids:
        out.append(int(t))
        if t in eos_ids:
            break
    return out


def assert_engine_idle(llm) -> None:
    """No request left anywhere, every KV block free, block accounting consistent."""
    m = llm.get_metrics()
    assert m["pagedllm:num_requests_running"] == 0, m
    assert m["pagedllm:num_requests_waiting"] == 0, m
    assert m["pagedllm:kv_cache_usage_perc"] == 0, m
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert engine.get_num_unfinished_requests() == 0
    engine.scheduler.kv_cache_manager.check_integrity()


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, eos_ids=DEMO_EOS_IDS,
              **generate_kwargs) -> list[int]:
    """transformers' greedy continuation of one prompt, up to and including the first EOS."""
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]),
                             attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                             do_sample=False, max_new_tokens=max_new_tokens,
                             eos_token_id=sorted(eos_ids) if eos_ids else None,
                             pad_token_id=0, **generate_kwargs)
    return truncate_at_eos(out[0, len(prompt_ids):].tolist(), eos_ids)


def hf_log_softmax(model, token_ids: list[int]):
    """[len(token_ids), V] float64 log-softmax of transformers' logits at every position."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0]
    return torch.log_softmax(logits.double(), dim=-1)


@pytest.fixture(scope="session")
def e2e() -> SimpleNamespace:
    """The helpers and constants above, as a fixture (test modules cannot import ``conftest``
    reliably: several test folders have one)."""
    return SimpleNamespace(
        DEMO_EOS_IDS=DEMO_EOS_IDS, EXTRA_PROMPTS=EXTRA_PROMPTS, TINY_ARCHS=TINY_ARCHS,
        truncate_at_eos=truncate_at_eos, assert_engine_idle=assert_engine_idle,
        hf_greedy=hf_greedy, hf_log_softmax=hf_log_softmax, build_tiny_model=build_tiny_model,
    )


# ----------------------------------------------------------------------------------------------
# The demo model
# ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def demo_model_path() -> str:
    if not (DEMO_MODEL_DIR / "config.json").is_file():
        pytest.fail(f"demo model missing at {DEMO_MODEL_DIR}")
    return str(DEMO_MODEL_DIR)


@pytest.fixture(scope="session")
def golden_cases() -> list[dict]:
    return json.loads(GOLDEN_GREEDY.read_text())["cases"]


@pytest.fixture(scope="session")
def demo_tokenizer(demo_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_model_path)


@pytest.fixture(scope="session")
def hf_demo_model(demo_model_path):
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(demo_model_path, dtype=torch.float32)
    return model.eval()


# ----------------------------------------------------------------------------------------------
# Tiny random models
# ----------------------------------------------------------------------------------------------


def _tiny_config(arch: str):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = {"vocab_size": 32000, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 256,
              "rms_norm_eps": 1e-6, "bos_token_id": 1, "eos_token_id": 2,
              "initializer_range": 0.1}
    if arch == "llama_gqa":
        # GQA (4 query heads share 2 KV heads) and an lm_head of its own.
        return LlamaConfig(num_key_value_heads=2, tie_word_embeddings=False, rope_theta=10000.0,
                           **common)
    if arch == "qwen2":
        # q/k/v projections carry biases (randomised below, transformers inits them to zero).
        return Qwen2Config(num_key_value_heads=2, tie_word_embeddings=True, rope_theta=1000000.0,
                           **common)
    if arch == "qwen3":
        # q/k RMSNorm per head; head_dim set explicitly and != hidden_size / num_heads.
        return Qwen3Config(num_key_value_heads=1, head_dim=32, tie_word_embeddings=False,
                           rope_theta=1000000.0, **common)
    if arch == "mistral_swa":
        # A sliding window far shorter than the context (not in TINY_ARCHS: pagedllm caps its
        # context at the window; tests/engine/test_sliding_window.py).
        return MistralConfig(num_key_value_heads=2, tie_word_embeddings=False, rope_theta=10000.0,
                             sliding_window=8, **common)
    raise ValueError(arch)


def build_tiny_model(arch: str, folder: Path, seed: int = 0) -> Path:
    """Build a random float32 model of ``arch`` with torch.manual_seed(seed), randomise biases and
    norm weights (so a missing bias or norm shows), save_pretrained it into ``folder`` with the
    synthetic 32k tokenizer next to it, and return the folder."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_tiny_config(arch), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.2)
            elif "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(SYNTHETIC_TOKENIZER_DIR / name, folder / name)
    return folder


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_models")
    return {arch: build_tiny_model(arch, root / arch) for arch in TINY_ARCHS}

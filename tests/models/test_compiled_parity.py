"""The model tests' parity scenarios through the whole engine, compiled (the CPU default) and
eager, with the same assertions: every family and weight format gives transformers' greedy ids
and log-probs on the same weights (a rounded KV cache: a float32 cache's ids but at near-ties,
as test_kv_cache_dtype.py holds it) in a batch of chunked prefills (16-token steps, so chunks
cross every sliding window), with a prefix-cache hit and preemptions (a cache of about one and a
half of the longest request) asserted, and no graph compiled after startup. A compiled/eager
difference is a bug, not a tolerance to widen.

The compiled variants compile one model each (seconds with a warm inductor cache, tens cold):
marked slow. The eager ones run in the quick suite.
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch._dynamo.utils
from paged_helpers import STORIES_DIR, SYNTHETIC_TOKENIZER_DIR, check_greedy_logprobs
from test_families import CONFIGS as FAMILIES
from test_families import make_model

from pagedllm import LLM, SamplingParams
from pagedllm.checkpoint.loader import load_model
from pagedllm.core.kv_cache_manager import max_blocks_per_request
from pagedllm.layers import Attention
from pagedllm.runner.compile import compile_disabled_reason
from pagedllm.runner.kv_cache_groups import group_layers

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "checkpoint" / "gguf"))  # gguf_helpers, test_gguf

TOL = 1e-4  # the eager parity tests' tolerance on log-probs
BLOCK_SIZE = 4
STEP_TOKENS = 16  # max_num_batched_tokens: longer prompts are chunked
MAX_MODEL_LEN = 128
SHARED_PREFIX = 16  # tokens (4 blocks) the second prompt shares with the first
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny matmuls gain nothing from threads; on a busy small machine every parallel region
    waits for a descheduled worker."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _cases(names: list, compiled: list | None = None) -> list:
    """(name, enforce_eager) for every name eagerly and for ``compiled`` (default: every name)
    compiled, the compiled ones marked slow."""
    params = [pytest.param(n, True, id=f"{n}-eager") for n in names]
    return params + [pytest.param(n, False, id=f"{n}-compiled", marks=pytest.mark.slow)
                     for n in (names if compiled is None else compiled)]


def _workload(vocab_size: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """The first prompt runs alone (it caches its 16-token prefix), then all five in one batch
    (the first again, last): the second shares that prefix and is admitted first (a hit), the
    23-token one is chunked over a window's edge, decodes grow into preemptions."""
    gen = torch.Generator().manual_seed(6)
    high = min(vocab_size, 512)

    def rand(n: int) -> list[int]:
        return torch.randint(3, high, (n,), generator=gen).tolist()

    shared = rand(SHARED_PREFIX)
    prompts = [shared + rand(5), shared + rand(9), rand(23), rand(3), rand(12)]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=2)
              for n in (10, 8, 10, 12, 6)]
    return prompts, params


def _num_blocks(path: str, longest: int, **llm_kwargs) -> int:
    """One and a half times what the longest request holds at once in every KV cache group
    together: each request fits alone, the batch does not (it preempts)."""
    model, _ = load_model(path, torch.float32, CPU, llm_kwargs.get("quantization"))
    windows = [m.sliding_window for m in model.modules() if isinstance(m, Attention)]
    groups = group_layers(windows, MAX_MODEL_LEN)
    need = max_blocks_per_request([g.sliding_window for g in groups], longest, STEP_TOKENS,
                                  BLOCK_SIZE)
    return need + need // 2


def run_engine(path: str, vocab_size: int, enforce_eager: bool, **llm_kwargs):
    """The workload on one engine: (the batch's prompts, their outputs)."""
    if not enforce_eager:
        reason = compile_disabled_reason(False, CPU)
        if reason is not None:
            from ci_support import skip_unless_ci
            skip_unless_ci(f"no compiled mode here: {reason}")
    prompts, params = _workload(vocab_size)
    longest = max(len(p) + sp.max_tokens for p, sp in zip(prompts, params))
    llm = LLM(path, device="cpu", dtype="float32", enforce_eager=enforce_eager,
              block_size=BLOCK_SIZE, max_num_batched_tokens=STEP_TOKENS, max_num_seqs=8,
              max_model_len=MAX_MODEL_LEN, enable_prefix_caching=True,
              num_gpu_blocks_override=_num_blocks(path, longest, **llm_kwargs), **llm_kwargs)
    runner = llm.llm_engine.executor.runner
    assert (runner.compiled is None) == enforce_eager
    counters = torch._dynamo.utils.counters
    frames, graphs = counters["frames"]["total"], counters["stats"]["unique_graphs"]
    llm.generate([{"prompt_token_ids": prompts[0]}], params[0], use_tqdm=False)
    batch = prompts[1:] + prompts[:1]
    outputs = llm.generate([{"prompt_token_ids": p} for p in batch], params[1:] + params[:1],
                           use_tqdm=False)
    # Steady state: the one graph served every step (no frame converted, no new graph).
    assert counters["frames"]["total"] == frames and counters["stats"]["unique_graphs"] == graphs
    metrics = llm.get_metrics()
    assert outputs[0].num_cached_tokens >= SHARED_PREFIX, outputs[0].num_cached_tokens
    assert metrics["pagedllm:num_preemptions"] > 0, metrics
    return batch, outputs


def check_against_transformers(hf_model, path: str, enforce_eager: bool, atol: float = TOL,
                               **llm_kwargs) -> None:
    prompts, outputs = run_engine(path, hf_model.config.vocab_size, enforce_eager, **llm_kwargs)
    check_greedy_logprobs(hf_model, prompts, outputs, atol=atol)


def _with_tokenizer(folder: Path) -> str:
    if not (folder / "tokenizer.json").exists() and not (folder / "tokenizer.model").exists():
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(SYNTHETIC_TOKENIZER_DIR / name, folder / name)
    return str(folder)


def _saved(hf_model, folder: Path) -> str:
    hf_model.save_pretrained(folder, safe_serialization=True)
    return _with_tokenizer(folder)


# -- dense families (test_families.py, test_model_parity.py) -------------------------------------
# One per architecture and attention feature: windows on every layer (Mistral, Phi-3), mixed
# window/full layers (hybrid KV groups: Ministral, Gemma 2/3), soft caps (Gemma 2), per-layer
# rope (Gemma 3), partial longrope (Phi-3), NoPE layers, q/k norms, multipliers, biases.
FAMILY_NAMES = ["gemma2", "gemma3_text", "granite", "ministral_mixed_windows", "mistral_window",
                "olmo2", "phi3_longrope_partial", "phi3_window", "smollm3_nope"]
# Phi-3's window is the attention op Mistral's and Ministral's windows compile.
COMPILED_FAMILY_NAMES = [n for n in FAMILY_NAMES if n != "phi3_window"]


@pytest.mark.parametrize("name,enforce_eager", _cases(FAMILY_NAMES, COMPILED_FAMILY_NAMES))
def test_family(name, enforce_eager, tmp_path):
    config, architecture = FAMILIES[name]()
    hf_model = make_model(config, architecture)
    check_against_transformers(hf_model, _saved(hf_model, tmp_path / name), enforce_eager)


# Llama compiles in tests/runner/test_compile.py and on the demo model below; llama3 rope
# scaling only changes the rotary tables, which the graph reads as they are.
@pytest.mark.parametrize("name,enforce_eager", _cases(
    ["llama3_rope", "qwen2_bias", "qwen3_qknorm_tied"], ["qwen2_bias", "qwen3_qknorm_tied"]))
def test_dense(name, enforce_eager, tmp_path):
    from test_model_parity import CONFIGS, make_hf_model

    hf_model = make_hf_model(CONFIGS[name]())
    check_against_transformers(hf_model, _saved(hf_model, tmp_path / name), enforce_eager)


# -- mixture of experts (test_moe.py, test_gpt_oss.py) -------------------------------------------
@pytest.mark.parametrize("name,enforce_eager", _cases(["qwen2_moe", "qwen3_moe"]))
def test_moe(name, enforce_eager, tmp_path):
    from test_moe import make_moe_model

    hf_model = make_moe_model(name)
    check_against_transformers(hf_model, _saved(hf_model, tmp_path / name), enforce_eager)


@pytest.mark.parametrize("name,enforce_eager", _cases(["gpt_oss"]))
def test_gpt_oss_sinks_window_and_experts(name, enforce_eager, tmp_path):
    from test_gpt_oss import make_gpt_oss

    hf_model = make_gpt_oss()
    check_against_transformers(hf_model, _saved(hf_model, tmp_path / "gpt_oss"), enforce_eager)


# -- weight formats: GGUF blocks, AWQ/GPTQ groups (test_gguf.py, test_awq_gptq.py) --------------
@pytest.mark.parametrize("case,enforce_eager", _cases(["llama-k_quants", "qwen2-q4_0_q4_1"]))
def test_gguf(case, enforce_eager, tmp_path):
    from gguf_helpers import write_gguf
    from test_gguf import _hf_model, _reference, _types

    arch, spec = case.split("-")
    hf_model = _hf_model(arch)
    path = write_gguf(tmp_path / "model.gguf", hf_model, arch, _types(spec))
    # float32 activations: the exact mode, against transformers on the dequantized weights
    # (the default, int8 activations, is llama.cpp's numerics: tests/models/test_int8_activations.py).
    check_against_transformers(_reference(hf_model, path), str(path), enforce_eager,
                               quantization_activations="float32")


# AWQ and GPTQ differ in their files only: both load into the same q4 layers (one graph).
@pytest.mark.parametrize("method,enforce_eager", _cases(["awq", "gptq"], ["awq"]))
def test_awq_gptq(method, enforce_eager, tmp_path):
    from test_awq_gptq import build_quantized

    hf_model, folder = build_quantized(method, 32, tmp_path / method, seed=1)
    check_against_transformers(hf_model, _with_tokenizer(folder), enforce_eager)


# -- KV cache dtypes (test_kv_cache_dtype.py) -----------------------------------------------------
@pytest.fixture(scope="module")
def float32_cache_outputs():
    return run_engine(str(STORIES_DIR / "hf"), 512, True)[1]


@pytest.mark.parametrize("kv_cache_dtype,enforce_eager", _cases(["bfloat16", "fp8"]))
def test_kv_cache_dtype(kv_cache_dtype, enforce_eager, float32_cache_outputs):
    """On the demo model (a trained Llama), as test_kv_cache_dtype.py holds it: greedy ids as
    with a float32 cache (transformers'), parting only at float32's near-ties."""
    from test_kv_cache_dtype import assert_parts_only_at_near_ties

    _, outputs = run_engine(str(STORIES_DIR / "hf"), 512, enforce_eager,
                               kv_cache_dtype=kv_cache_dtype)
    assert_parts_only_at_near_ties(float32_cache_outputs, outputs, kv_cache_dtype)

"""torch.compile of the model (runner/compile.py): the compiled engine gives the eager engine's
greedy ids and logprobs, compiles once, and never compiles with enforce_eager=True.

The parity tests compile two models (~15-60 s each on 2 cores): marked slow. The rest of the
suite runs eagerly: tests/conftest.py sets PAGEDLLM_ENFORCE_EAGER=1, so an unset enforce_eager
does not compile.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch._dynamo.utils

from pagedllm import LLM, SamplingParams
from pagedllm.layers.linear import Linear
from pagedllm.layers.weight_format import Panels, Quantized
from pagedllm.runner import compile as compile_mod
from pagedllm.runner.compile import compile_disabled_reason
from pagedllm.runner.graph_call import GraphCall

SHARED_MODELS = Path(__file__).resolve().parents[2].parent / "shared" / "models"
DEMO_MODEL = SHARED_MODELS / "stories260K" / "hf"
TOKENIZER = SHARED_MODELS / "synthetic-tokenizer-32k"
TOL = 1e-4
CPU = torch.device("cpu")


# What the tiny random models share: 2 layers of 4 query heads on 2 kv heads (GQA).
_TINY = dict(vocab_size=32000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
             tie_word_embeddings=False, initializer_range=0.1)


def _saved(model, folder: Path) -> Path:
    """``model`` saved as a Hugging Face folder with the synthetic 32K tokenizer."""
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER / name, folder / name)
    return folder


def _tiny_llama(folder: Path) -> Path:
    """A random 2-layer Llama with GQA (4 query heads on 2 kv heads), randomised norm weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**_TINY, intermediate_size=128))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    return _saved(model, folder)


def _tiny_qwen3_moe(folder: Path) -> Path:
    """A random 2-layer Qwen3-MoE (layer 0 dense, layer 1 top-2 of 8 experts), router weights
    scaled up so that no expert choice rests on a rounding difference."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(
        **_TINY, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0], head_dim=16))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.mul_(8.0)
    return _saved(model, folder)


# -- when it compiles ---------------------------------------------------------------------------
def test_compile_decision(monkeypatch):
    assert compile_disabled_reason(True, CPU) == "enforce_eager is set"
    monkeypatch.setenv(compile_mod.ENV_ENFORCE_EAGER, "1")  # as this suite runs (conftest.py)
    assert compile_mod.ENV_ENFORCE_EAGER in compile_disabled_reason(None, CPU)
    monkeypatch.delenv(compile_mod.ENV_ENFORCE_EAGER)
    monkeypatch.setenv("CXX", "no-such-compiler-anywhere")
    assert "C++ compiler" in compile_disabled_reason(False, CPU)
    assert "C++ compiler" in compile_disabled_reason(None, CPU)  # auto falls back too
    monkeypatch.delenv("CXX")
    if shutil.which("c++"):
        assert compile_disabled_reason(False, CPU) is None
        assert compile_disabled_reason(None, CPU) is None  # auto compiles on CPU too


@pytest.mark.parametrize("enforce_eager", [True, None])
def test_eager_never_calls_torch_compile(monkeypatch, enforce_eager):
    def refuse(*args, **kwargs):
        raise AssertionError("torch.compile was called")

    monkeypatch.setattr(torch, "compile", refuse)
    monkeypatch.setenv(compile_mod.ENV_ENFORCE_EAGER, "1")  # unset then means eager
    llm = LLM(str(DEMO_MODEL), device="cpu", enforce_eager=enforce_eager)
    assert llm.llm_engine.executor.runner.compiled is None
    out = llm.generate(["Once upon a time"], SamplingParams(temperature=0.0, max_tokens=4),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


# -- compiled == eager ---------------------------------------------------------------------------
def _workload(vocab_size: int) -> tuple[list[dict], list[SamplingParams]]:
    """Prompts of 3..60 tokens (one repeated: a prefix-cache hit) and outputs of 1..24 tokens:
    with a 16-token step budget, long prompts are chunked and every step mixes a prefill chunk
    with decodes, at a batch size that grows and shrinks."""
    import random

    rng = random.Random(0)
    prompts = [[1] + [rng.randrange(3, vocab_size) for _ in range(n - 1)]
               for n in (3, 17, 60, 8, 33, 5, 41, 12)]
    prompts.append(list(prompts[2]))
    lens = [24, 1, 10, 20, 6, 16, 3, 12, 8]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=3)
              for n in lens]
    return [{"prompt_token_ids": p} for p in prompts], params


def _engines(model: str) -> tuple[LLM, LLM]:
    kwargs = dict(device="cpu", block_size=4, max_num_batched_tokens=16, max_num_seqs=6)
    # Every layer packed (the startup measurement may keep a tiny model's layers on torch's
    # matmul), so that the graph's opaque linears can be counted.
    with mock.patch.dict(os.environ, {"PAGEDLLM_CPU_KERNELS": "pagedllm"}):
        return LLM(model, enforce_eager=False, **kwargs), LLM(model, enforce_eager=True, **kwargs)


def _recording(runner, sizes: set[int]) -> None:
    """Record the token count of every compiled call (still through the compiled code: the warm
    forward calls the graph directly, runner/graph_call.py)."""
    inner = runner.compiled._call
    assert inner is not None

    def call(input_ids, positions):
        sizes.add(int(input_ids.shape[0]))
        return inner(input_ids, positions)

    runner.compiled._call = call


def _compare_outputs(compiled: LLM, eager: LLM, vocab_size: int) -> set[int]:
    """The compiled engine's greedy ids and logprobs against the eager one's, over two passes
    of the workload (the second hits the prefix cache); no frame converted and no new graph in
    the steady state."""
    runner = compiled.llm_engine.executor.runner
    sizes: set[int] = set()
    _recording(runner, sizes)
    counters = torch._dynamo.utils.counters
    frames, graphs = counters["frames"]["total"], counters["stats"]["unique_graphs"]

    prompts, params = _workload(vocab_size)
    for second in (False, True):  # the second hits the prefix cache (attention over cached blocks)
        got = compiled.generate(prompts, params, use_tqdm=False)
        want = eager.generate(prompts, params, use_tqdm=False)
        if second:  # every prompt longer than a 4-token block finds its blocks cached
            for out in (*got, *want):
                if len(out.prompt_token_ids) > 4:
                    assert out.num_cached_tokens >= 4, (out.prompt_token_ids, out.num_cached_tokens)
        for g, w in zip(got, want):
            g, w = g.outputs[0], w.outputs[0]
            assert list(g.token_ids) == list(w.token_ids)
            for pos, (tok, g_lp, w_lp) in enumerate(zip(g.token_ids, g.logprobs, w.logprobs)):
                assert abs(g_lp[tok].logprob - w_lp[tok].logprob) < TOL, pos
                for t, lp in w_lp.items():
                    if t in g_lp:
                        assert abs(g_lp[t].logprob - lp.logprob) < TOL, (pos, t)

    # Steady state: many steps of many sizes (1 included) and no frame converted, no new graph.
    assert len(sizes) >= 6 and 1 in sizes and max(sizes) == 16, sorted(sizes)
    assert counters["frames"]["total"] == frames
    assert counters["stats"]["unique_graphs"] == graphs


def _compare(model: str, vocab_size: int) -> None:
    compiled, eager = _engines(model)
    runner = compiled.llm_engine.executor.runner
    assert runner.compiled is not None and runner.compiled.compile_seconds > 0
    assert eager.llm_engine.executor.runner.compiled is None
    # The compiled forward multiplies through the packed weights, as eager does: every linear
    # of the decoder is packed (_engines forces it), and the graph calls each as the opaque op
    # (counted below).
    assert isinstance(runner.compiled._call, GraphCall)  # the warm forward calls the graph itself
    linears = [m for m in runner.model.model.modules() if isinstance(m, Linear)]
    assert linears and all(isinstance(m.weight_format, Panels) and m.weight is None for m in linears)
    _compare_outputs(compiled, eager, vocab_size)
    with torch.inference_mode(), torch.profiler.profile() as prof:  # one forward, no step: no cache
        runner.compiled(torch.zeros(3, dtype=torch.long), torch.arange(3))
    assert sum(e.count for e in prof.key_averages() if e.key == "pagedllm::packed_linear") == len(linears)


@pytest.mark.slow
def test_compiled_matches_eager_quantized_moe(tmp_path):
    """Weights quantized at load (q4_0 codes and scales, tensors the layers hold outside
    nn.Parameters, which the graph takes as inputs) and a MoE layer's fused experts: the
    compiled engine gives the eager engine's ids and logprobs."""
    model = str(_tiny_qwen3_moe(tmp_path / "tiny-qwen3-moe"))
    kwargs = dict(device="cpu", block_size=4, max_num_batched_tokens=16, max_num_seqs=6,
                  quantization="q4_0")
    compiled, eager = LLM(model, enforce_eager=False, **kwargs), LLM(model, enforce_eager=True, **kwargs)
    runner = compiled.llm_engine.executor.runner
    assert runner.compiled is not None
    assert any(isinstance(getattr(m, "weight_format", None), Quantized)
               for m in runner.model.modules())
    assert isinstance(runner.compiled._call, GraphCall)  # its codes and scales found where the layers hold them
    _compare_outputs(compiled, eager, 32000)


@pytest.mark.slow
def test_compiled_matches_eager_tiny_llama(tmp_path):
    _compare(str(_tiny_llama(tmp_path / "tiny-llama")), 32000)


@pytest.mark.slow
def test_compiled_matches_eager_demo_model():
    _compare(str(DEMO_MODEL), 512)


@pytest.mark.slow
def test_every_model_compiles_its_own_forward():
    """dynamo keeps its graphs per code object: two models of one class each compile their own
    forward, so a process's engines never add up to dynamo's recompile limit (here 1)."""
    from pagedllm.checkpoint.loader import load_model
    from pagedllm.runner.compile import CompiledForward

    models = [load_model(str(DEMO_MODEL), torch.float32, CPU)[0] for _ in range(2)]
    ids, positions = torch.tensor([1, 365, 264]), torch.arange(3)
    with torch._dynamo.config.patch(recompile_limit=1):
        for model in models:
            compiled = CompiledForward(model, CPU)
            compiled.warmup(4, CPU)
            assert compiled._call is not None  # one graph for every token count, called directly
            with torch.inference_mode():
                torch.testing.assert_close(compiled(ids, positions), model(ids, positions),
                                           rtol=TOL, atol=TOL)


def test_paged_attention_kernel_is_opaque_to_dynamo():
    """The C++ kernel has a fake implementation: a compiled graph holds it as one node (no graph
    break, fullgraph) and gives the kernel's own output."""
    from pagedllm.kernels.cpu_extension import load_paged_attention_op

    op = load_paged_attention_op()
    if op is None:
        pytest.skip("no C++ compiler: the cpu_paged kernel cannot be built")
    gen = torch.Generator().manual_seed(0)
    kv_cache = torch.randn(2, 12, 4, 2, 8, generator=gen)  # 12 blocks of 4, 2 kv heads x 8
    q = torch.randn(5, 4, 8, generator=gen)  # a decode + a 4-token chunk over a cached prefix
    block_tables = torch.tensor([[3, 7, 0], [5, 1, 9]])
    qsl, seq_lens = torch.tensor([0, 1, 5]), torch.tensor([6, 11])

    def attend(q, kv_cache, block_tables, qsl, seq_lens):
        return torch.ops.pagedllm.paged_attention(q, kv_cache, block_tables, qsl, seq_lens, 0.35) * 2

    want = attend(q, kv_cache, block_tables, qsl, seq_lens)
    torch._dynamo.reset()
    got = torch.compile(attend, fullgraph=True, backend="aot_eager")(q, kv_cache, block_tables,
                                                                      qsl, seq_lens)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1


def test_inductor_cache_is_a_folder_per_kernel_build(monkeypatch, tmp_path):
    """Inductor's graph cache does not key on the custom ops' schemas: a graph cached by another
    version of the kernels must never be hit (its code may call an op by old argument names)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from pagedllm.kernels.cpu_extension import build_tag

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    default = os.path.abspath(default_cache_dir())
    assert compile_mod.use_own_inductor_cache() == os.path.join(default, f"pagedllm-{build_tag()}")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default)  # torch's own default: replaced too
    assert compile_mod.use_own_inductor_cache().startswith(os.path.join(default, "pagedllm-"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # the user's choice: kept
    assert compile_mod.use_own_inductor_cache() == str(tmp_path)

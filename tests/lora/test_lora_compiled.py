"""Adapters in the compiled forward (the default wherever a compiler exists): one graph compiled at
startup serves batches mixing adapters and base rows, a change of the resident adapters (more
adapters than slots: evictions) and a step with no adapter, without a new graph; the greedy ids
and log-probs are the eager engine's (within 1e-5) and PEFT's (on a Q8_0 Qwen2 base: the eager
engine's, whose numbers test_lora_generate.py holds to PEFT's on the dequantized base). An adapter
with a trained embedding runs its steps eagerly, with PEFT's numbers too.

Compiling takes seconds to tens of seconds: marked slow."""
from __future__ import annotations

import pytest
import torch
import torch._dynamo.utils
from lora_helpers import ADAPTER_SPECS, build_adapter, build_base
from test_lora_generate import _check, _params, _prompts

from pagedllm import LLM, LoRARequest
from pagedllm.runner.compile import compile_disabled_reason
from pagedllm.runner.graph_call import GraphCall

pytestmark = pytest.mark.slow
EAGER_TOL = 1e-5


@pytest.fixture(scope="module", params=[("llama", None), ("qwen2", "q8_0")], ids=["llama", "qwen2-q8_0"])
def adapters(request, tmp_path_factory):
    """(base, its quantization, [(request, PEFT model)] of six adapters and one training the embedding)."""
    reason = compile_disabled_reason(False, torch.device("cpu"))
    if reason is not None:
        from ci_support import skip_unless_ci
        skip_unless_ci(f"no compiled mode here: {reason}")
    arch, quantization = request.param
    root = tmp_path_factory.mktemp(f"lora_compiled_{arch}")
    base = build_base(arch, root / "base")
    out = []
    for i in (0, 1, 2, 3, 6, 7):
        r, alpha, targets, rslora = ADAPTER_SPECS[i]
        out.append((LoRARequest(f"a{i}", i + 1, str(root / f"a{i}")),
                    build_adapter(base, root / f"a{i}", r, alpha, targets, rslora, seed=i + 1)))
    out.append((LoRARequest("embed", 99, str(root / "embed")),
                build_adapter(base, root / "embed", 8, 16, ["q_proj", "down_proj"], seed=9,
                              modules_to_save=["embed_tokens"])))
    return base, quantization, out


def _engine(base, quantization: str | None, enforce_eager: bool) -> LLM:
    quantized = {} if quantization is None else {"quantization": quantization,
                                                 "quantization_activations": "float32"}
    return LLM(str(base), device="cpu", dtype="float32", enable_lora=True, max_loras=4, max_lora_rank=64,
               max_num_batched_tokens=64, block_size=8, enforce_eager=enforce_eager, **quantized)


def _batches(adapters):
    """(prompts, one adapter or None each): four adapters and base rows, then other adapters (two
    slots refilled), then the base alone."""
    requests = [r for r, _ in adapters[:6]]
    first = [None, requests[0], requests[3], requests[1], None, requests[2], requests[0]]
    second = [requests[4], requests[5], None, requests[3], requests[4]]
    return [(_prompts(10, [9 + 2 * i for i in range(len(first))]), first),
            (_prompts(11, [12 + i for i in range(len(second))]), second),
            (_prompts(12, [10, 7]), [None, None])]


def _run(llm, prompts, loras):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], _params(), use_tqdm=False,
                        lora_request=loras)


def test_compiled_matches_eager_and_peft_without_recompiling(adapters):
    base, quantization, adapters = adapters
    compiled = _engine(base, quantization, enforce_eager=False)
    runner = compiled.llm_engine.executor.runner
    # The graph called on the slots' tensors it reads, found once: filling a slot writes into them.
    assert isinstance(runner.compiled._call, GraphCall) and isinstance(runner.compiled_base._call, GraphCall)
    if quantization is not None:  # the wrapped layers' base is quantized
        assert {fmt.name for fmt in runner.lora_manager.layers.values()} == {quantization[:2]}
    counters = torch._dynamo.utils.counters
    frames, graphs = counters["frames"]["total"], counters["stats"]["unique_graphs"]
    results = [(prompts, loras, _run(compiled, prompts, loras)) for prompts, loras in _batches(adapters)]
    # One graph for every batch and set of resident adapters: nothing converted or compiled since startup.
    assert counters["frames"]["total"] == frames and counters["stats"]["unique_graphs"] == graphs
    # Base-only steps run the graph without the adapters' term: NaN slots reach no row there.
    for fmt in runner.lora_manager.layers.values():
        fmt.graph.lora_a.fill_(float("nan"))
    prompts, loras, _ = results[-1]
    assert loras == [None, None] and runner.compiled_base is not None
    results[-1] = (prompts, loras, _run(compiled, prompts, loras))
    del compiled
    eager = _engine(base, quantization, enforce_eager=True)
    peft_of = {r.lora_int_id: m for r, m in adapters}
    for prompts, loras, outs in results:
        for prompt, lora, got, want in zip(prompts, loras, outs, _run(eager, prompts, loras)):
            what = f"{lora.lora_name if lora else 'base'} {len(prompt)}"
            assert got.outputs[0].token_ids == want.outputs[0].token_ids, what
            for pos in range(1, len(prompt)):
                a = got.prompt_logprobs[pos][prompt[pos]].logprob
                b = want.prompt_logprobs[pos][prompt[pos]].logprob
                assert abs(a - b) <= EAGER_TOL, f"{what} pos {pos}: {a} {b}"
            if quantization is None:
                _check(got, prompt, peft_of[(lora or adapters[0][0]).lora_int_id], lora is None,
                       f"compiled {what}")


def test_trained_embedding_runs_its_steps_eagerly(adapters):
    base, quantization, adapters = adapters
    if quantization is not None:
        pytest.skip("the float base suffices for the embedding's eager steps")
    llm = _engine(base, quantization, enforce_eager=False)
    (embed, embed_peft), (plain, plain_peft) = adapters[6], adapters[0]
    prompts = _prompts(13, [11, 9, 13])
    loras = [embed, None, plain]
    for prompt, lora, out in zip(prompts, loras, _run(llm, prompts, loras)):
        _check(out, prompt, embed_peft if lora is embed else plain_peft, lora is None, f"compiled {lora}")

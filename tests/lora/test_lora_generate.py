"""Adapters applied against PEFT's model in float32, on tiny random Llama and Qwen2 bases: each
adapter alone and all eight mixed in one batch with base rows among them (prompt logprobs within
1e-4, greedy ids the reference's argmax), a row's tokens the same whatever shares its step, the
prefix cache never shared across adapters, fewer slots than adapters (LRU), preemption, the
worker-process executor, quantized bases and two tensor-parallel ranks."""
from __future__ import annotations

import contextlib
import random

import pytest
import torch
from lora_helpers import VOCAB

from pagedllm import LLM, LoRARequest, SamplingParams

TOL = 1e-4
NEAR_TIE = 1e-3


def _prompts(seed: int, lengths) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, VOCAB) for _ in range(n - 1)] for n in lengths]


def _reference_rows(peft_model, token_ids: list[int], base: bool):
    """[len, V] float64 log-softmax of PEFT's model (its base with ``base``)."""
    with torch.no_grad(), (peft_model.disable_adapter() if base else contextlib.nullcontext()):
        logits = peft_model(torch.tensor([token_ids])).logits[0]
    return torch.log_softmax(logits.double(), dim=-1)


def _check(out, prompt, peft_model, base: bool, what: str) -> None:
    """Prompt logprobs within TOL of the reference; each greedy token its argmax (or a near tie)."""
    tokens = list(out.outputs[0].token_ids)
    rows = _reference_rows(peft_model, prompt + tokens, base)
    for pos in range(1, len(prompt)):
        got = out.prompt_logprobs[pos][prompt[pos]].logprob
        assert abs(got - float(rows[pos - 1, prompt[pos]])) <= TOL, f"{what} pos {pos}"
    for i, tok in enumerate(tokens):
        row = rows[len(prompt) - 1 + i]
        top2 = row.topk(2)
        if float(top2.values[0] - top2.values[1]) > NEAR_TIE:
            assert tok == int(top2.indices[0]), f"{what} token {i}"


def _params(max_tokens: int = 6) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, prompt_logprobs=0, ignore_eos=True)


def _requests(adapters) -> list[LoRARequest]:
    return [LoRARequest(f"adapter{i}", i + 1, str(folder)) for i, (folder, _) in enumerate(adapters)]


@pytest.fixture(scope="module")
def engine(lora_family):
    arch, base, adapters = lora_family
    llm = LLM(str(base), device="cpu", dtype="float32", enable_lora=True, max_loras=8,
              max_lora_rank=64, max_num_batched_tokens=64, block_size=8)
    yield arch, llm, adapters
    del llm


def test_each_adapter_alone(engine):
    arch, llm, adapters = engine
    prompts = _prompts(1, [13, 21])
    for request, (_, peft_model) in zip(_requests(adapters), adapters):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _params(), use_tqdm=False,
                            lora_request=request)
        for prompt, out in zip(prompts, outs):
            _check(out, prompt, peft_model, False, f"{arch} {request.lora_name}")


@pytest.mark.parametrize("dense_max_rows", [256, 0], ids=["grouped_op", "per_adapter"])
def test_eight_adapters_mixed_with_base_rows(engine, monkeypatch, dense_max_rows):
    """Both ways of applying several adapters in a step: one grouped op (few rows) and torch's
    products per adapter (many rows)."""
    monkeypatch.setattr("pagedllm.lora.mapping.DENSE_MAX_ROWS", dense_max_rows)
    arch, llm, adapters = engine
    requests = _requests(adapters)
    loras = [None, *requests[:4], None, *requests[4:]]
    prompts = _prompts(2, [9 + 3 * i for i in range(len(loras))])
    mixed = llm.generate([{"prompt_token_ids": p} for p in prompts], _params(), use_tqdm=False,
                         lora_request=loras)
    peft_of = {r.lora_int_id: m for r, (_, m) in zip(requests, adapters)}
    for prompt, lora, out in zip(prompts, loras, mixed):
        peft_model = peft_of[lora.lora_int_id] if lora else adapters[0][1]
        _check(out, prompt, peft_model, lora is None, f"{arch} mixed {lora}")
    # A row's result does not depend on which adapters share its step.
    for prompt, lora, out in zip(prompts, loras, mixed):
        alone = llm.generate([{"prompt_token_ids": prompt}], _params(), use_tqdm=False,
                             lora_request=lora)[0]
        assert alone.outputs[0].token_ids == out.outputs[0].token_ids


def test_prefix_cache_is_keyed_by_adapter(engine):
    _, llm, adapters = engine
    first, second = _requests(adapters)[:2]
    prompt = {"prompt_token_ids": _prompts(3, [40])[0]}
    params = SamplingParams(temperature=0.0, max_tokens=2)
    cached = [llm.generate([prompt], params, use_tqdm=False, lora_request=lora)[0].num_cached_tokens
              for lora in (first, first, second, None, second)]
    assert cached[0] == 0 and cached[1] > 0  # the same adapter hits its own blocks
    assert cached[2] == 0 and cached[3] == 0  # another adapter, or the base, never does
    assert cached[4] > 0


def test_fewer_slots_than_adapters_and_preemption(lora_family):
    """Two slots for eight adapters (the scheduler admits two at a time, the worker evicts the
    least recently used), and a cache so small that requests are preempted and recomputed."""
    arch, base, adapters = lora_family
    llm = LLM(str(base), device="cpu", dtype="float32", enable_lora=True, max_loras=2,
              max_cpu_loras=3, max_lora_rank=64, block_size=4, num_gpu_blocks_override=24,
              max_num_seqs=4, max_num_batched_tokens=16)
    requests = _requests(adapters)
    loras = [requests[i % 8] if i % 3 else None for i in range(10)]
    prompts = _prompts(4, [14 + i for i in range(10)])
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _params(16), use_tqdm=False,
                        lora_request=loras)
    assert llm.get_metrics()["pagedllm:num_preemptions"] > 0
    peft_of = {r.lora_int_id: m for r, (_, m) in zip(requests, adapters)}
    for prompt, lora, out in zip(prompts, loras, outs):
        peft_model = peft_of[lora.lora_int_id] if lora else adapters[0][1]
        _check(out, prompt, peft_model, lora is None, f"{arch} small {lora}")
    manager = llm.llm_engine.executor.runner.lora_manager
    assert len(manager.slot_of) <= 2 and len(manager.loaded) <= 3


def test_worker_process_executor(lora_family):
    arch, base, adapters = lora_family
    if arch != "llama":
        pytest.skip("one family suffices for the wire")
    llm = LLM(str(base), device="cpu", dtype="float32", enable_lora=True, max_loras=2,
              max_lora_rank=64, distributed_executor_backend="mp")
    requests = _requests(adapters)[:2]
    prompts = _prompts(5, [11, 17, 8])
    loras = [requests[0], None, requests[1]]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _params(), use_tqdm=False,
                        lora_request=loras)
    for prompt, lora, (_, peft_model), out in zip(prompts, loras, [adapters[0], adapters[0], adapters[1]],
                                                  outs):
        _check(out, prompt, peft_model, lora is None, f"mp {lora}")
    llm.llm_engine.shutdown()


def _peft_on_dequantized_base(base, adapter_folder, manager):
    """PEFT's model on the base whose linear weights are those the quantized layers hold,
    dequantized (the reference of every weight format)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                      adapter_folder).eval()
    with torch.no_grad():
        for name, target in manager.targets.items():
            fmt = manager.layers[target.layer_name]
            rows = torch.arange(target.out_offset, target.out_offset + target.out_size)
            module = model.base_model.model.get_submodule(name)
            getattr(module, "base_layer", module).weight.copy_(fmt.base.dequantize_rows(rows).float())
    return model


@pytest.mark.parametrize("quantization", ["q8_0", "q4_0"])
def test_quantized_base_against_peft_on_the_dequantized_base(lora_family, quantization):
    arch, base, adapters = lora_family
    llm = LLM(str(base), device="cpu", dtype="float32", enable_lora=True, max_loras=2,
              max_lora_rank=64, quantization=quantization, quantization_activations="float32")
    manager = llm.llm_engine.executor.runner.lora_manager
    assert {fmt.name for fmt in manager.layers.values()} == {quantization[:2]}  # the base is quantized
    requests = _requests(adapters)
    loras = [requests[3], None, requests[7]]
    prompts = _prompts(6, [12, 9, 15])
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _params(), use_tqdm=False,
                        lora_request=loras)
    folder = {r.lora_int_id: f for r, (f, _) in zip(requests, adapters)}
    for prompt, lora, out in zip(prompts, loras, outs):
        reference = _peft_on_dequantized_base(base, folder[(lora or requests[0]).lora_int_id], manager)
        _check(out, prompt, reference, lora is None, f"{arch} {quantization} {lora}")


@pytest.mark.slow  # two worker processes, each loading the model
def test_tensor_parallel_two_ranks(lora_family, monkeypatch):
    """A sharded like its base's input side, B like its output side: two ranks give PEFT's numbers."""
    arch, base, adapters = lora_family
    if arch != "llama":
        pytest.skip("one family suffices for the sharding")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    llm = LLM(str(base), device="cpu", dtype="float32", enable_lora=True, max_loras=4,
              max_lora_rank=64, tensor_parallel_size=2)
    try:
        requests = _requests(adapters)
        loras = [requests[3], None, requests[1], requests[7]]
        prompts = _prompts(7, [10, 13, 8, 12])
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _params(), use_tqdm=False,
                            lora_request=loras)
        peft_of = {r.lora_int_id: m for r, (_, m) in zip(requests, adapters)}
        for prompt, lora, out in zip(prompts, loras, outs):
            peft_model = peft_of[lora.lora_int_id] if lora else adapters[0][1]
            _check(out, prompt, peft_model, lora is None, f"tp=2 {lora}")
    finally:
        llm.llm_engine.shutdown()


def test_bfloat16_model(lora_family):
    """bf16 weights and activations: the adapter's update in bf16 too, PEFT's float32 numbers
    within bf16 rounding, far closer than the base's."""
    arch, base, adapters = lora_family
    llm = LLM(str(base), device="cpu", dtype="bfloat16", enable_lora=True, max_lora_rank=64)
    (folder, peft_model), prompt = adapters[3], _prompts(8, [20])[0]
    out = llm.generate([{"prompt_token_ids": prompt}], _params(1), use_tqdm=False,
                       lora_request=LoRARequest("a3", 4, str(folder)))[0]
    got = torch.tensor([out.prompt_logprobs[p][prompt[p]].logprob for p in range(1, len(prompt))])
    index = torch.tensor(prompt[1:])[:, None]
    want = _reference_rows(peft_model, prompt, False)[:-1].gather(1, index)[:, 0]
    base_rows = _reference_rows(peft_model, prompt, True)[:-1].gather(1, index)[:, 0]
    error, adapter_effect = (got - want).abs().max(), (want - base_rows).abs().max()
    assert error < 0.05 and error < adapter_effect / 20, (float(error), float(adapter_effect))

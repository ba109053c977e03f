"""End to end on the demo model (stories260K, a real trained Llama): pagedllm's greedy output must
equal the golden continuations and transformers' own ``generate(do_sample=False)`` token for token,
whatever the scheduler does with the batch: one big batch, every prompt chunked, shared prefixes
served from the prefix cache, a cache so small that requests are preempted, priority scheduling.
After every run the engine must be idle with every KV block free.
"""
from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams

# max_tokens for EXTRA_PROMPTS (24..64), in order.
EXTRA_MAX_TOKENS = [24, 64, 40, 56, 32, 64, 48, 30]
COMMON_PREFIX_LEN = 40


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


@pytest.fixture(scope="module")
def demo_cases(golden_cases, demo_tokenizer, hf_demo_model, e2e) -> list[dict]:
    """Every case: prompt_ids, max_tokens, expected (HF greedy up to and including the first
    EOS)."""
    cases = []
    for case in golden_cases:
        cases.append({"prompt_ids": list(case["prompt_ids"]), "max_tokens": case["max_new_tokens"],
                      "golden": e2e.truncate_at_eos(case["greedy_ids"])})
    for text, max_tokens in zip(e2e.EXTRA_PROMPTS, EXTRA_MAX_TOKENS, strict=True):
        cases.append({"prompt_ids": demo_tokenizer(text).input_ids, "max_tokens": max_tokens,
                      "text": text})
    for case in cases:
        case["expected"] = e2e.hf_greedy(hf_demo_model, case["prompt_ids"], case["max_tokens"])
    return cases


@pytest.fixture(scope="module")
def prefix_cases(demo_cases, hf_demo_model, e2e) -> list[dict]:
    """Prompts sharing a 40-token prefix, with suffixes of 0..20 tokens (one is the bare prefix)."""
    longest = max((c["prompt_ids"] for c in demo_cases), key=len)
    assert len(longest) > COMMON_PREFIX_LEN + 20
    prefix = longest[:COMMON_PREFIX_LEN]
    suffixes = [[], longest[COMMON_PREFIX_LEN:COMMON_PREFIX_LEN + 1],
                longest[COMMON_PREFIX_LEN:COMMON_PREFIX_LEN + 20]]
    for case in demo_cases[5:10]:  # other prompts' tokens (BOS dropped) as different suffixes
        suffixes.append(case["prompt_ids"][1:14])
    cases = []
    for i, suffix in enumerate(suffixes):
        ids = prefix + suffix
        max_tokens = 24 + 4 * i
        cases.append({"prompt_ids": ids, "max_tokens": max_tokens,
                      "expected": e2e.hf_greedy(hf_demo_model, ids, max_tokens)})
    return cases


def _run(llm: LLM, cases: list[dict], priority: list[int] | None = None):
    prompts = [{"prompt_token_ids": c["prompt_ids"]} for c in cases]
    params = [_greedy(c["max_tokens"]) for c in cases]
    outputs = llm.generate(prompts, params, use_tqdm=False, priority=priority)
    assert len(outputs) == len(cases)
    return outputs


def _assert_matches(outputs, cases, e2e) -> None:
    mismatches = []
    for i, (out, case) in enumerate(zip(outputs, cases)):
        assert out.finished
        assert out.prompt_token_ids == case["prompt_ids"]
        got = out.outputs[0].token_ids
        if got != case["expected"]:
            mismatches.append(f"case {i} (prompt of {len(case['prompt_ids'])} tokens): "
                              f"got {got}, expected {case['expected']}")
        expected = case["expected"]
        reason = "stop" if expected and expected[-1] in e2e.DEMO_EOS_IDS else "length"
        assert out.outputs[0].finish_reason == reason, (i, out.outputs[0])
    assert not mismatches, "\n".join(mismatches)


def test_hf_reference_equals_golden(demo_cases):
    """The transformers reference itself reproduces the stored golden continuations."""
    golden = [c for c in demo_cases if "golden" in c]
    assert golden
    for case in golden:
        assert case["expected"] == case["golden"]


def test_one_large_batch(demo_model_path, demo_cases, e2e):
    llm = LLM(demo_model_path, device="cpu")
    outputs = _run(llm, demo_cases)
    _assert_matches(outputs, demo_cases, e2e)
    for out, case in zip(outputs, demo_cases):
        if "golden" in case:
            assert out.outputs[0].token_ids == case["golden"]
    e2e.assert_engine_idle(llm)
    # The same batch again: the prefix cache changes nothing in the output.
    _assert_matches(_run(llm, demo_cases), demo_cases, e2e)
    e2e.assert_engine_idle(llm)


@pytest.mark.parametrize("budget,threshold,max_num_seqs", [(8, 4, 256), (5, 0, 256), (16, 0, 1)])
def test_every_prompt_chunked(demo_model_path, demo_cases, e2e, budget, threshold, max_num_seqs):
    llm = LLM(demo_model_path, device="cpu", max_num_batched_tokens=budget,
              long_prefill_token_threshold=threshold, enable_prefix_caching=False,
              max_num_seqs=max_num_seqs)
    _assert_matches(_run(llm, demo_cases), demo_cases, e2e)
    e2e.assert_engine_idle(llm)


@pytest.mark.parametrize("block_size", [4, 16])
def test_shared_prefixes_hit_the_prefix_cache(demo_model_path, prefix_cases, e2e, block_size):
    llm = LLM(demo_model_path, device="cpu", block_size=block_size, max_num_batched_tokens=64)
    first = _run(llm, prefix_cases)
    _assert_matches(first, prefix_cases, e2e)
    e2e.assert_engine_idle(llm)
    hits_after_first = llm.get_metrics()["pagedllm:prefix_cache_hits"]

    second = _run(llm, prefix_cases)  # warm: every prompt's full prefix blocks are cached
    _assert_matches(second, prefix_cases, e2e)
    e2e.assert_engine_idle(llm)
    for out in second:
        # The first run cached every full block; a hit never covers the last prompt token.
        n = len(out.prompt_token_ids)
        assert out.num_cached_tokens == ((n - 1) // block_size) * block_size > 0
    metrics = llm.get_metrics()
    assert metrics["pagedllm:prefix_cache_hits"] > hits_after_first > 0

    assert llm.reset_prefix_cache()
    third = _run(llm, prefix_cases[:1])
    assert third[0].num_cached_tokens == 0
    _assert_matches(third, prefix_cases[:1], e2e)
    e2e.assert_engine_idle(llm)


@pytest.mark.parametrize("block_size,budget", [(4, 2048), (16, 24)])
def test_identical_and_overlapping_prompts_in_one_step(demo_model_path, prefix_cases, e2e,
                                                        block_size, budget):
    """Blocks are published as soon as they are allocated: copies of a prompt admitted in the same
    step share them (their K/V is written in the same forward, before attention reads it),
    also while the prompts are being chunked."""
    llm = LLM(demo_model_path, device="cpu", block_size=block_size, max_num_batched_tokens=budget)
    long_case = prefix_cases[2]  # the 40-token prefix + 20 tokens
    cases = [long_case, long_case, prefix_cases[0], long_case, prefix_cases[1], long_case]
    outputs = _run(llm, cases)
    _assert_matches(outputs, cases, e2e)
    assert llm.get_metrics()["pagedllm:prefix_cache_hits"] > 0
    e2e.assert_engine_idle(llm)


def test_prefix_caching_computes_fewer_prompt_tokens(demo_model_path, prefix_cases, e2e):
    computed = {}
    for enabled in (True, False):
        llm = LLM(demo_model_path, device="cpu", block_size=4, enable_prefix_caching=enabled)
        for _ in range(2):
            _assert_matches(_run(llm, prefix_cases), prefix_cases, e2e)
            e2e.assert_engine_idle(llm)
        metrics = llm.get_metrics()
        computed[enabled] = metrics["pagedllm:prompt_tokens_computed"]
        num_prompt_tokens = sum(len(c["prompt_ids"]) for c in prefix_cases)
        assert metrics["pagedllm:prompt_tokens"] == 2 * num_prompt_tokens
        if not enabled:
            assert metrics["pagedllm:prefix_cache_hits"] == 0
            assert computed[False] == metrics["pagedllm:prompt_tokens"]
    assert computed[True] < computed[False]


def test_long_prompt_up_to_max_model_len(demo_model_path, demo_tokenizer, hf_demo_model, e2e):
    """Positions up to max_position_embeddings - 1 (511): a ~470-token prompt + 40 tokens."""
    text = " ".join(e2e.EXTRA_PROMPTS * 3)
    ids = demo_tokenizer(text).input_ids[:470]
    case = {"prompt_ids": ids, "max_tokens": 40, "expected": e2e.hf_greedy(hf_demo_model, ids, 40)}
    llm = LLM(demo_model_path, device="cpu", max_num_batched_tokens=64)  # chunked, 64 at a time
    _assert_matches(_run(llm, [case, case]), [case, case], e2e)
    e2e.assert_engine_idle(llm)


def test_kv_cache_memory_bytes_sizes_the_cache(demo_model_path, demo_cases, e2e):
    # stories260K: 5 layers x 4 KV heads x head_dim 8, float32 -> 2*5*4*8*4 bytes per token.
    bytes_per_block = 2 * 5 * 4 * 8 * 4 * 4
    llm = LLM(demo_model_path, device="cpu", block_size=4, max_num_seqs=8,
              kv_cache_memory_bytes=48 * bytes_per_block + 100)
    assert llm.get_metrics()["pagedllm:num_gpu_blocks"] == 48
    _assert_matches(_run(llm, demo_cases), demo_cases, e2e)
    assert llm.get_metrics()["pagedllm:num_preemptions"] > 0
    e2e.assert_engine_idle(llm)


def test_output_kind_does_not_truncate_generate(demo_model_path, demo_cases, e2e):
    """LLM.generate returns whole outputs whatever output_kind says (vLLM forces FINAL_ONLY
    there; DELTA/CUMULATIVE are for streaming)."""
    from pagedllm.sampling_params import RequestOutputKind

    llm = LLM(demo_model_path, device="cpu")
    case = demo_cases[1]
    whole = llm.generate({"prompt_token_ids": case["prompt_ids"]}, _greedy(case["max_tokens"]),
                         use_tqdm=False)[0].outputs[0]
    assert whole.token_ids == case["expected"]
    for kind in RequestOutputKind:
        sp = SamplingParams(temperature=0.0, max_tokens=case["max_tokens"], n=2, output_kind=kind)
        out = llm.generate({"prompt_token_ids": case["prompt_ids"]}, sp, use_tqdm=False)[0]
        assert out.finished
        assert [c.index for c in out.outputs] == [0, 1], kind
        for c in out.outputs:
            assert c.token_ids == whole.token_ids, kind
            assert c.text == whole.text, kind
    e2e.assert_engine_idle(llm)


def _small_cache_llm(path: str, **kwargs) -> LLM:
    # 48 blocks of 4 tokens: the longest case (94 + 64 tokens) alone needs 40 of them.
    return LLM(path, device="cpu", block_size=4, num_gpu_blocks_override=48, max_num_seqs=8,
               **kwargs)


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_preemption_keeps_output(demo_model_path, demo_cases, e2e, enable_prefix_caching):
    llm = _small_cache_llm(demo_model_path, enable_prefix_caching=enable_prefix_caching)
    _assert_matches(_run(llm, demo_cases), demo_cases, e2e)
    assert llm.get_metrics()["pagedllm:num_preemptions"] > 0
    e2e.assert_engine_idle(llm)


def test_priority_scheduling_keeps_output(demo_model_path, demo_cases, e2e):
    llm = _small_cache_llm(demo_model_path, scheduling_policy="priority",
                           max_num_batched_tokens=32)
    priority = [(7 * i) % 5 - 2 for i in range(len(demo_cases))]  # mixed, with ties
    outputs = _run(llm, demo_cases, priority=priority)
    _assert_matches(outputs, demo_cases, e2e)
    assert llm.get_metrics()["pagedllm:num_preemptions"] > 0
    e2e.assert_engine_idle(llm)


def test_string_prompts_return_text_in_input_order(demo_model_path, demo_tokenizer,
                                                   hf_demo_model, e2e):
    llm = LLM(demo_model_path, device="cpu", max_num_batched_tokens=16)
    # Longest first: the short ones finish first, yet the results come back in input order.
    prompts = sorted(e2e.EXTRA_PROMPTS, key=len, reverse=True)
    outputs = llm.generate(prompts, _greedy(24), use_tqdm=False)
    assert [o.prompt for o in outputs] == prompts
    for prompt, out in zip(prompts, outputs):
        prompt_ids = demo_tokenizer(prompt).input_ids
        assert out.prompt_token_ids == prompt_ids
        completion = out.outputs[0]
        assert completion.token_ids == e2e.hf_greedy(hf_demo_model, prompt_ids, 24)
        shown = [t for t in completion.token_ids if t not in e2e.DEMO_EOS_IDS]
        full = demo_tokenizer.decode(prompt_ids + shown, skip_special_tokens=True)
        head = demo_tokenizer.decode(prompt_ids, skip_special_tokens=True)
        assert completion.text and completion.text == full[len(head):]
    e2e.assert_engine_idle(llm)
    # A single string prompt works too and returns one output.
    single = llm.generate(prompts[0], _greedy(24), use_tqdm=False)
    assert len(single) == 1 and single[0].outputs[0].text == outputs[0].outputs[0].text


@pytest.mark.slow  # torch.compile at startup: 15-40 s on two cores
def test_compiled_model_matches_transformers_under_chunking_and_preemption(demo_model_path, demo_cases, e2e):
    """The suite runs eagerly (tests/conftest.py) while the CPU default is compiled: this runs
    the transformers parity compiled, with every long prompt chunked (16-token budget), a
    cache small enough to preempt, and prefix caching on."""
    import torch
    from ci_support import skip_unless_ci

    from pagedllm.runner.compile import compile_disabled_reason

    reason = compile_disabled_reason(False, torch.device("cpu"))
    if reason is not None:
        skip_unless_ci(f"no compiled mode here: {reason}")
    llm = _small_cache_llm(demo_model_path, enforce_eager=False, max_num_batched_tokens=16)
    assert llm.llm_engine.executor.runner.compiled is not None
    assert max(len(c["prompt_ids"]) for c in demo_cases) > 16  # so some prompts are chunked
    _assert_matches(_run(llm, demo_cases), demo_cases, e2e)
    assert llm.get_metrics()["pagedllm:num_preemptions"] > 0
    # The longest prompt again, alone: its blocks are still cached, and the compiled forward
    # resumes after the hit with the same ids.
    longest = [max(demo_cases, key=lambda c: len(c["prompt_ids"]))]
    hits = llm.get_metrics()["pagedllm:prefix_cache_hits"]
    _assert_matches(_run(llm, longest), longest, e2e)
    assert llm.get_metrics()["pagedllm:prefix_cache_hits"] > hits
    e2e.assert_engine_idle(llm)

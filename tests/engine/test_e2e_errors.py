"""Bad input gets a clear error (ValidationError or a subclass, naming the offending thing), and
the engine keeps serving: after every rejected request a normal prompt still gets its exact
greedy output, no request is left behind and every KV block is free."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.errors import ModelLoadError, UnsupportedModelError, ValidationError

ONCE = [1, 403, 407, 261, 378]  # "Once upon a time"
MAX_MODEL_LEN = 64
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json",
                   "special_tokens_map.json", "generation_config.json")


@pytest.fixture(scope="module")
def llm(demo_model_path):
    return LLM(demo_model_path, device="cpu", max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def reference(golden_cases) -> list[int]:
    case = next(c for c in golden_cases if c["prompt_ids"] == ONCE)
    return case["greedy_ids"][:16]


def _greedy(max_tokens: int = 16, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def _assert_still_serving(llm, reference, e2e) -> None:
    e2e.assert_engine_idle(llm)
    out = llm.generate({"prompt_token_ids": ONCE}, _greedy(), use_tqdm=False)
    assert len(out) == 1 and out[0].outputs[0].token_ids == reference
    e2e.assert_engine_idle(llm)


def _raises(llm, prompt, params, error=ValidationError, *fragments: str):
    with pytest.raises(error) as info:
        llm.generate(prompt, params, use_tqdm=False)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return info.value


# ----------------------------------------------------------------------------------------------
# Bad prompts
# ----------------------------------------------------------------------------------------------
def test_prompt_longer_than_max_model_len(llm, reference, e2e):
    err = _raises(llm, {"prompt_token_ids": [1] + [300] * MAX_MODEL_LEN}, _greedy(),
                  ValidationError, str(MAX_MODEL_LEN + 1), "max_model_len")
    assert err.param == "prompt"
    _assert_still_serving(llm, reference, e2e)
    # Prompt fits, prompt + max_tokens does not.
    err = _raises(llm, {"prompt_token_ids": [1] + [300] * 39}, _greedy(30), ValidationError,
                  "max_tokens", str(MAX_MODEL_LEN))
    assert err.param == "max_tokens"
    _assert_still_serving(llm, reference, e2e)
    # A long text prompt (tokenized by the engine) is rejected the same way.
    _raises(llm, "Once upon a time " * 40, _greedy(), ValidationError, "max_model_len")
    _assert_still_serving(llm, reference, e2e)


def test_empty_prompt(llm, reference, e2e):
    for prompt in ({"prompt_token_ids": []}, [[]], [{"prompt_token_ids": ()}]):
        err = _raises(llm, prompt, _greedy(), ValidationError, "empty")
        assert err.param == "prompt"
        _assert_still_serving(llm, reference, e2e)


@pytest.mark.parametrize("bad_id", [512, 100_000, -1])
def test_token_id_outside_vocabulary(llm, reference, e2e, bad_id):
    err = _raises(llm, {"prompt_token_ids": [1, 403, bad_id, 261]}, _greedy(), ValidationError,
                  str(bad_id), "vocabulary")
    assert err.param == "prompt"
    _assert_still_serving(llm, reference, e2e)


def test_token_ids_that_are_not_integers(llm, reference, e2e):
    _raises(llm, {"prompt_token_ids": [1, "403", 261]}, _greedy(), ValidationError, "integer")
    _raises(llm, {"prompt_token_ids": [1, 2.5]}, _greedy(), ValidationError, "integer")
    _raises(llm, {"text": "no prompt key"}, _greedy(), ValidationError, "prompt")
    _raises(llm, [3.5], _greedy(), ValidationError, "prompt")
    _assert_still_serving(llm, reference, e2e)


def test_prompt_of_a_wrong_type(llm, reference, e2e):
    # User input, so a ValidationError naming the prompt (not a TypeError from list(prompts)).
    for prompt in (12345, None, 3.5):
        _raises(llm, prompt, _greedy(), ValidationError, "prompt")
    _assert_still_serving(llm, reference, e2e)


def test_logit_bias_token_outside_vocabulary(llm, reference, e2e):
    _raises(llm, {"prompt_token_ids": ONCE}, _greedy(logit_bias={512: 5.0}), ValidationError,
            "logit_bias")
    _assert_still_serving(llm, reference, e2e)


# ----------------------------------------------------------------------------------------------
# Bad sampling values
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,param", [
    ({"temperature": -1.0}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -5}, "top_k"),
    ({"n": 0}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"min_tokens": 10, "max_tokens": 5}, "min_tokens"),
    ({"logprobs": 100}, "logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"min_p": 1.5}, "min_p"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"presence_penalty": 3.0}, "presence_penalty"),
    ({"stop": [""]}, "stop"),
    ({"logit_bias": {5: 1000.0}}, "logit_bias"),
])
def test_invalid_sampling_values(kwargs, param):
    """Refused where SamplingParams are made (the constructor and clone(), which LLM.generate
    uses to change output_kind), so no such value reaches an engine through them. (An engine
    check after this would prove nothing: the engine never saw the values.)"""
    with pytest.raises(ValidationError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param
    assert param in str(info.value)
    with pytest.raises(ValidationError) as info:
        _greedy().clone(**kwargs)
    assert info.value.param == param


def test_sampling_params_changed_after_construction_are_refused_by_the_engine(demo_model_path, reference, e2e):
    """vLLM users set fields on a SamplingParams they made (``params.max_tokens = ...``): a bad
    value set that way must be a ValidationError at add_request, and the engine keeps serving.
    Its own engine: while this fails, the module's engine is not left with a half-added request."""
    llm = LLM(demo_model_path, device="cpu", max_model_len=MAX_MODEL_LEN)
    params = _greedy()
    params.n = 0
    _raises(llm, {"prompt_token_ids": ONCE}, params, ValidationError, "n")
    _assert_still_serving(llm, reference, e2e)


def test_mismatched_sampling_params_and_priority_lists(llm, reference, e2e):
    prompts = [{"prompt_token_ids": ONCE}] * 3
    _raises(llm, prompts, [_greedy()] * 2, ValidationError, "SamplingParams")
    with pytest.raises(ValidationError, match="priority"):
        llm.generate(prompts, _greedy(), use_tqdm=False, priority=[0, 1])
    _raises(llm, prompts[0], "not params", ValidationError, "SamplingParams")
    _assert_still_serving(llm, reference, e2e)


# ----------------------------------------------------------------------------------------------
# One bad prompt in a batch
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad_index", [0, 2, 4])
def test_one_bad_prompt_in_a_batch_leaves_nothing_behind(llm, reference, e2e, bad_index):
    prompts = [{"prompt_token_ids": ONCE + [432] * i} for i in range(5)]
    prompts[bad_index] = {"prompt_token_ids": [1, 999_999]}
    params = [_greedy(8)] * 5
    n_before = llm.get_metrics()["pagedllm:request_success"]
    _raises(llm, prompts, params, ValidationError, "999999")
    e2e.assert_engine_idle(llm)
    _assert_still_serving(llm, reference, e2e)
    # The good prompts queued before the bad one were withdrawn, not run later.
    assert llm.get_metrics()["pagedllm:request_success"] == n_before + 1
    # A batch of copies after the failure: all good.
    outs = llm.generate([{"prompt_token_ids": ONCE}] * 3, _greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [reference] * 3
    e2e.assert_engine_idle(llm)


# ----------------------------------------------------------------------------------------------
# A request that could never fit in the KV cache
# ----------------------------------------------------------------------------------------------
def test_request_that_can_never_fit_in_the_kv_cache(demo_model_path, reference, e2e):
    small = LLM(demo_model_path, device="cpu", block_size=4, num_gpu_blocks_override=8)  # 32 tokens
    _raises(small, {"prompt_token_ids": ONCE}, _greedy(64), ValidationError, "KV")
    _raises(small, {"prompt_token_ids": [1] + [300] * 40}, _greedy(1), ValidationError, "KV")
    _assert_still_serving(small, reference, e2e)
    # 5 + 28 tokens need exactly 8 blocks (the last sampled token is never written): fits.
    out = small.generate({"prompt_token_ids": ONCE}, _greedy(28, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 28
    _raises(small, {"prompt_token_ids": ONCE}, _greedy(29), ValidationError, "KV")
    # max_tokens=None: as many as the cache can hold, never an error or a hang.
    out = small.generate({"prompt_token_ids": ONCE}, _greedy(None, ignore_eos=True), use_tqdm=False)
    assert 1 <= len(out[0].outputs[0].token_ids) <= 28
    assert out[0].outputs[0].finish_reason == "length"
    _assert_still_serving(small, reference, e2e)


# ----------------------------------------------------------------------------------------------
# Chat
# ----------------------------------------------------------------------------------------------
def test_chat_without_and_with_template(llm, hf_demo_model, e2e, reference, demo_dir, tmp_path):
    messages = [{"role": "user", "content": "Once upon a time"}]
    # The demo model answers with the demo's own template (beside its folder) ...
    assert llm.chat(messages, _greedy(), use_tqdm=False)[0].outputs[0].token_ids
    # ... a model without a template (the same weights elsewhere) keeps failing clearly.
    other = LLM(str(_model_copy(demo_dir, tmp_path / "notemplate")), device="cpu",
                max_model_len=MAX_MODEL_LEN, num_gpu_blocks_override=16)
    with pytest.raises(ValidationError, match="chat template") as info:
        other.chat(messages, _greedy(), use_tqdm=False)
    assert info.value.param == "messages"
    _assert_still_serving(llm, reference, e2e)

    template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    out = llm.chat(messages, _greedy(), use_tqdm=False, chat_template=template)
    assert len(out) == 1
    ids = out[0].prompt_token_ids
    assert ids[0] == 1 and ids.count(1) == 1  # the template's BOS, not doubled
    assert llm.get_tokenizer().decode(ids, skip_special_tokens=True).strip() == "Once upon a time"
    assert out[0].outputs[0].token_ids == e2e.hf_greedy(hf_demo_model, ids, 16)
    # A list of conversations.
    two = llm.chat([messages, [{"role": "user", "content": "Zoo"}]], _greedy(),
                   use_tqdm=False, chat_template=template)
    assert len(two) == 2 and two[0].outputs[0].token_ids == out[0].outputs[0].token_ids
    with pytest.raises(ValidationError):
        llm.chat([{"content": "no role"}], _greedy(), use_tqdm=False, chat_template=template)
    _assert_still_serving(llm, reference, e2e)


def test_chat_renders_tools_through_the_template(llm):
    """LLM.chat(tools=...) as vLLM's: the template sees the tools (here it lists their names)."""
    template = ("{% for t in tools or [] %}[{{ t['function']['name'] }}]{% endfor %}"
                "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    messages = [{"role": "user", "content": "Once"}]
    text = llm.get_tokenizer().decode
    with_tools = llm.chat(messages, _greedy(), use_tqdm=False, chat_template=template, tools=tools)
    without = llm.chat(messages, _greedy(), use_tqdm=False, chat_template=template)
    assert text(with_tools[0].prompt_token_ids).replace(" ", "").startswith("[get_weather]")
    assert "get_weather" not in text(without[0].prompt_token_ids)


# ----------------------------------------------------------------------------------------------
# Bad engine arguments and bad model folders
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,fragment", [
    ({"max_model_len": 1000}, "max_model_len"),  # above max_position_embeddings (512)
    ({"block_size": 0}, "block_size"),
    ({"scheduling_policy": "lifo"}, "scheduling_policy"),
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"dtype": "int3"}, "dtype"),
    ({"no_such_argument": 1}, "no_such_argument"),
])
def test_bad_engine_arguments(demo_model_path, kwargs, fragment):
    with pytest.raises(ValidationError, match=fragment):
        LLM(demo_model_path, device="cpu", **kwargs)


def _model_copy(demo_model_path, folder, *, weights: bool = True, **config_changes):
    folder.mkdir()
    config = json.loads((demo_model_path / "config.json").read_text())
    config.update(config_changes)
    (folder / "config.json").write_text(json.dumps(config))
    for name in TOKENIZER_FILES:
        if (demo_model_path / name).is_file():
            shutil.copy(demo_model_path / name, folder / name)
    if weights:
        os.symlink(demo_model_path / "model.safetensors", folder / "model.safetensors")
    return folder


@pytest.fixture
def demo_dir(demo_model_path):
    from pathlib import Path

    return Path(demo_model_path)


def test_unknown_architecture(demo_dir, tmp_path, llm, reference, e2e):
    folder = _model_copy(demo_dir, tmp_path / "foo", architectures=["FooForCausalLM"])
    with pytest.raises(UnsupportedModelError) as info:
        LLM(str(folder), device="cpu")
    message = str(info.value)
    assert "FooForCausalLM" in message
    for supported in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert supported in message
    assert isinstance(info.value, ValidationError)
    _assert_still_serving(llm, reference, e2e)


def test_missing_weight_files(demo_dir, tmp_path, llm, reference, e2e):
    folder = _model_copy(demo_dir, tmp_path / "noweights", weights=False)
    with pytest.raises(ModelLoadError, match="safetensors"):
        LLM(str(folder), device="cpu")
    _assert_still_serving(llm, reference, e2e)


def test_missing_config_and_missing_folder(tmp_path):
    with pytest.raises(ModelLoadError, match="config.json"):
        LLM(str(tmp_path), device="cpu")
    with pytest.raises(ModelLoadError, match="config.json"):
        LLM(str(tmp_path / "does-not-exist"), device="cpu")


def test_corrupt_and_incomplete_weights(demo_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    corrupt = _model_copy(demo_dir, tmp_path / "corrupt", weights=False)
    (corrupt / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json")
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        LLM(str(corrupt), device="cpu")

    incomplete = _model_copy(demo_dir, tmp_path / "incomplete", weights=False)
    tensors = load_file(str(demo_dir / "model.safetensors"))
    del tensors["model.norm.weight"]
    save_file(tensors, str(incomplete / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="model.norm.weight"):
        LLM(str(incomplete), device="cpu")

    wrong_shape = _model_copy(demo_dir, tmp_path / "wrong_shape", weights=False)
    tensors = load_file(str(demo_dir / "model.safetensors"))
    tensors["model.norm.weight"] = tensors["model.norm.weight"][:10].clone()
    save_file(tensors, str(wrong_shape / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="model.norm.weight"):
        LLM(str(wrong_shape), device="cpu")

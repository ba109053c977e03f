"""POST /v1/completions through the official openai client, on the demo model."""
from __future__ import annotations

import pytest

from pagedllm import SamplingParams

PROMPT = "Once upon a time"


def _stream_text(client, **kwargs) -> tuple[dict[int, str], dict[int, str], object]:
    """Concatenated text and finish reason per choice index, and the usage chunk."""
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    usage = None
    for chunk in client.completions.create(stream=True, **kwargs):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason is not None:
                reasons[c.index] = c.finish_reason
    return texts, reasons, usage


def test_greedy_stream_equals_whole_equals_llm_generate(client, reference_llm):
    kwargs = dict(model="demo", prompt=PROMPT, max_tokens=48, temperature=0)
    whole = client.completions.create(**kwargs)
    streamed, reasons, _ = _stream_text(client, **kwargs)
    offline = reference_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=48), use_tqdm=False)
    assert whole.choices[0].text == streamed[0] == offline[0].outputs[0].text
    assert whole.choices[0].text.startswith(", there was")
    assert whole.choices[0].finish_reason == reasons[0] == offline[0].outputs[0].finish_reason
    assert whole.object == "text_completion" and whole.model == "demo"


def test_usage_and_cached_tokens(client):
    prompt = "The sun was hot and the sky was blue. Max wanted to go swimming in the lake with his dad."
    first = client.completions.create(model="demo", prompt=prompt, max_tokens=5, temperature=0)
    u = first.usage
    assert u.completion_tokens == 5 and u.total_tokens == u.prompt_tokens + 5
    assert u.prompt_tokens > 16
    # The same prompt again: its full blocks come from the prefix cache.
    again = client.completions.create(model="demo", prompt=prompt, max_tokens=5, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens >= 16
    assert again.choices[0].text == first.choices[0].text


def test_stream_include_usage(client):
    texts, reasons, usage = _stream_text(client, model="demo", prompt=PROMPT, max_tokens=12,
                                         temperature=0, stream_options={"include_usage": True})
    assert usage is not None and usage.completion_tokens == 12
    assert usage.total_tokens == usage.prompt_tokens + 12
    assert reasons == {0: "length"}


def test_n2_and_token_id_prompts(client, demo_tokenizer):
    ids = [demo_tokenizer(PROMPT).input_ids, demo_tokenizer("The cat").input_ids]
    r = client.completions.create(model="demo", prompt=ids, n=2, max_tokens=8,
                                  temperature=1.0, seed=7)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert all(c.text for c in r.choices)
    assert 4 <= r.usage.completion_tokens <= 32
    texts, _, _ = _stream_text(client, model="demo", prompt=ids, n=2, max_tokens=8,
                               temperature=1.0, seed=7)
    # Seeded sampling: the stream gives the same four samples.
    assert texts == {c.index: c.text for c in r.choices}


def test_seed_reproducible(client):
    kwargs = dict(model="demo", prompt=PROMPT, max_tokens=24, temperature=1.0, top_p=0.95)
    a = client.completions.create(seed=1234, **kwargs).choices[0].text
    b = client.completions.create(seed=1234, **kwargs).choices[0].text
    others = {client.completions.create(seed=s, **kwargs).choices[0].text for s in range(3)}
    assert a == b
    assert len(others | {a}) > 1


def test_stop_strings(client):
    full = client.completions.create(model="demo", prompt=PROMPT, max_tokens=40, temperature=0).choices[0]
    assert "Lily" in full.text
    cut = client.completions.create(model="demo", prompt=PROMPT, max_tokens=40, temperature=0,
                                    stop=["Lily"]).choices[0]
    assert cut.text == full.text[:full.text.index("Lily")]
    assert cut.finish_reason == "stop"
    kept = client.completions.create(model="demo", prompt=PROMPT, max_tokens=40, temperature=0,
                                     stop=["Lily"], extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == full.text[:full.text.index("Lily") + 4]
    streamed, reasons, _ = _stream_text(client, model="demo", prompt=PROMPT, max_tokens=40,
                                        temperature=0, stop=["Lily"])
    assert streamed[0] == cut.text and reasons[0] == "stop"


def test_logprobs(client):
    r = client.completions.create(model="demo", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert all(x <= 0 for x in lp.token_logprobs)
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert 3 <= len(top) <= 4  # the top 3, plus the chosen token if it is not among them
        assert max(top.values()) == pytest.approx(chosen)  # greedy: the chosen is the best
    assert lp.text_offset == sorted(lp.text_offset)
    streamed = [c.choices[0].logprobs for c in client.completions.create(
        model="demo", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3, stream=True)
        if c.choices and c.choices[0].logprobs]
    assert [t for s in streamed for t in s.token_logprobs] == pytest.approx(lp.token_logprobs)


def test_echo_with_prompt_logprobs(client, demo_tokenizer):
    r = client.completions.create(model="demo", prompt=PROMPT, max_tokens=4, temperature=0,
                                  echo=True, logprobs=1)
    c = r.choices[0]
    num_prompt = len(demo_tokenizer(PROMPT).input_ids)
    assert c.text.startswith(PROMPT) and len(c.text) > len(PROMPT)
    assert len(c.logprobs.tokens) == num_prompt + 4
    assert c.logprobs.token_logprobs[0] is None and c.logprobs.top_logprobs[0] is None
    assert all(x is not None and x <= 0 for x in c.logprobs.token_logprobs[1:])
    streamed, _, _ = _stream_text(client, model="demo", prompt=PROMPT, max_tokens=4,
                                  temperature=0, echo=True)
    assert streamed[0] == c.text


def test_vllm_extras(client):
    r = client.completions.create(model="demo", prompt=PROMPT, max_tokens=10, temperature=0.8,
                                  presence_penalty=0.5, frequency_penalty=0.5,
                                  logit_bias={"403": -100}, user="me",
                                  extra_body={"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.1,
                                              "min_tokens": 10, "ignore_eos": True,
                                              "stop_token_ids": [2], "skip_special_tokens": True,
                                              "priority": 0, "cache_salt": "salt",
                                              "use_beam_search": False, "length_penalty": 1.0})
    assert r.usage.completion_tokens == 10 and r.choices[0].finish_reason == "length"


def test_beam_search_over_the_api(client, reference_llm):
    from pagedllm import BeamSearchParams

    out = client.completions.create(model="demo", prompt=PROMPT, max_tokens=12, n=3,
                                    extra_body={"use_beam_search": True, "length_penalty": 0.8})
    ref = reference_llm.beam_search([PROMPT], BeamSearchParams(beam_width=3, max_tokens=12,
                                                               length_penalty=0.8))[0]
    assert len(out.choices) == 3
    ref_texts = [reference_llm.get_tokenizer().decode(s.tokens[len(s.tokens) - 12:], skip_special_tokens=True)
                 for s in ref.sequences]
    assert [c.text for c in out.choices] == ref_texts
    assert out.usage.completion_tokens == 36


def test_beam_search_cannot_stream(client):
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="demo", prompt=PROMPT, max_tokens=4, n=2, stream=True,
                                  extra_body={"use_beam_search": True})
    assert "stream" in str(e.value)

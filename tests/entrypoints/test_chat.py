"""POST /v1/chat/completions through the official openai client, on the demo model (which has no
chat template of its own: the server is given a simple one)."""
from __future__ import annotations

import jinja2
import openai
import pytest
from server_utils import CHAT_TEMPLATE, HTTP

from pagedllm import SamplingParams

MESSAGES = [{"role": "system", "content": "You tell short stories."},
            {"role": "user", "content": "Once upon a time"}]


def _rendered(messages) -> str:
    return jinja2.Template(CHAT_TEMPLATE).render(messages=messages, add_generation_prompt=True)


def test_chat_whole_and_stream_match_llm(client, reference_llm, demo_tokenizer):
    kwargs = dict(model="demo", messages=MESSAGES, max_tokens=32, temperature=0)
    whole = client.chat.completions.create(**kwargs)
    msg = whole.choices[0].message
    assert msg.role == "assistant" and msg.content
    assert whole.object == "chat.completion"

    roles, text, reasons = [], "", []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        assert chunk.object == "chat.completion.chunk"
        for c in chunk.choices:
            if c.delta.role:
                roles.append(c.delta.role)
            text += c.delta.content or ""
            if c.finish_reason:
                reasons.append(c.finish_reason)
    assert roles == ["assistant"] and text == msg.content
    assert reasons == [whole.choices[0].finish_reason]

    # The same prompt offline: the template's text, tokenized without extra special tokens.
    ids = demo_tokenizer(_rendered(MESSAGES), add_special_tokens=False).input_ids
    offline = reference_llm.generate({"prompt_token_ids": ids},
                                     SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    assert offline[0].outputs[0].text == msg.content
    assert whole.usage.prompt_tokens == len(ids)


def test_chat_n2_stream_and_usage(client):
    seen: dict[int, str] = {}
    usage = None
    for chunk in client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=10,
                                                temperature=1.0, seed=3, n=2, stream=True,
                                                stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        for c in chunk.choices:
            seen[c.index] = seen.get(c.index, "") + (c.delta.content or "")
    whole = client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=10,
                                           temperature=1.0, seed=3, n=2)
    assert seen == {c.index: c.message.content for c in whole.choices}
    assert usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens


def test_chat_logprobs_and_max_completion_tokens(client):
    r = client.chat.completions.create(model="demo", messages=MESSAGES, max_completion_tokens=5,
                                       temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 5
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)  # greedy
        assert entry.bytes == list(entry.token.encode())
    assert "".join(e.token for e in content).replace(" ", "") == r.choices[0].message.content.replace(" ", "")


def test_chat_content_parts_and_stop(client):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Once upon a time"}]}]
    a = client.chat.completions.create(model="demo", messages=parts, max_tokens=12, temperature=0)
    b = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Once upon a time"}],
                                       max_tokens=12, temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content
    text = b.choices[0].message.content
    word = text.split()[1]
    cut = client.chat.completions.create(model="demo", messages=parts, max_tokens=12, temperature=0,
                                         stop=[word])
    assert cut.choices[0].message.content == text[:text.index(word)]
    assert cut.choices[0].finish_reason == "stop"


def test_chat_without_template_is_400(fake_server):
    srv = fake_server()  # no --chat-template, and the demo model has none
    c = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=4)
    body = e.value.body
    assert body["param"] == "messages" and "chat template" in body["message"]
    # Completions still work on that server.
    assert c.completions.create(model="demo", prompt="hi", max_tokens=4).choices[0].text is not None


def test_chat_bad_template_and_parts_are_400(client, server):
    r = HTTP.post(f"{server.url}/v1/chat/completions",
                   json={"messages": MESSAGES, "chat_template": "{% for %}"})
    # A request's own template is refused unless the server trusts requests with one.
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"
    r = HTTP.post(f"{server.url}/v1/chat/completions",
                   json={"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]})
    assert r.status_code == 400 and "image_url" in r.json()["error"]["message"]
    r = HTTP.post(f"{server.url}/v1/chat/completions",
                   json={"messages": MESSAGES, "top_logprobs": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
    r = HTTP.post(f"{server.url}/v1/chat/completions",
                   json={"messages": MESSAGES, "max_completion_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens"

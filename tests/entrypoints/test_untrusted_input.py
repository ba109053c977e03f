"""Untrusted input (issue 15): a request's own chat_template only with
--trust-request-chat-template; chat_template_kwargs reach the template only as the variables it
reads (never apply_chat_template's own arguments); the number of stop strings is bounded."""
from __future__ import annotations

from server_utils import CHAT_TEMPLATE, HTTP

from pagedllm.entrypoints.openai.server_options import ServerOptions
from pagedllm.entrypoints.openai.template_kwargs import template_variables_only

MESSAGES = [{"role": "user", "content": "Tell me a story"}]
GREETING_TEMPLATE = "{{ greeting }}{% for m in messages %}{{ m['content'] }}{% endfor %}"


def test_request_template_needs_the_operators_trust(fake_server):
    closed = fake_server(chat_template=CHAT_TEMPLATE)
    r = HTTP.post(f"{closed.url}/v1/chat/completions",
                  json={"messages": MESSAGES, "max_tokens": 2, "chat_template": GREETING_TEMPLATE})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"
    assert "--trust-request-chat-template" in r.json()["error"]["message"]
    trusting = fake_server(chat_template=CHAT_TEMPLATE, options=ServerOptions(trust_request_chat_template=True))
    r = HTTP.post(f"{trusting.url}/v1/chat/completions",
                  json={"messages": MESSAGES, "max_tokens": 2, "chat_template": GREETING_TEMPLATE,
                        "chat_template_kwargs": {"greeting": "Hello. "}})
    assert r.status_code == 200, r.text


def test_template_kwargs_keep_only_what_the_template_reads():
    given = {"greeting": "hi", "truncation": True, "padding": "max_length", "return_dict": True,
             "tokenize": True, "unused": 1, "continue_final_message": True}
    assert template_variables_only(given, GREETING_TEMPLATE) == {"greeting": "hi", "continue_final_message": True}
    # A template that names an argument of apply_chat_template still does not get it.
    assert template_variables_only({"tokenize": True}, "{{ tokenize }}") == {}
    assert template_variables_only(None, GREETING_TEMPLATE) == {}


def test_kwargs_that_change_tokenization_are_dropped_not_applied(fake_server):
    srv = fake_server(chat_template=CHAT_TEMPLATE)
    r = HTTP.post(f"{srv.url}/v1/chat/completions",
                  json={"messages": MESSAGES, "max_tokens": 2,
                        "chat_template_kwargs": {"return_dict": True, "truncation": True, "max_length": 1}})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] > 1  # not truncated to max_length=1


def test_stop_strings_are_bounded(fake_server):
    srv = fake_server(options=ServerOptions(max_num_stop_strings=4))
    ok = HTTP.post(f"{srv.url}/v1/completions",
                   json={"prompt": "Once", "max_tokens": 2, "stop": ["a", "b", "c", "d"]})
    assert ok.status_code == 200, ok.text
    r = HTTP.post(f"{srv.url}/v1/completions",
                  json={"prompt": "Once", "max_tokens": 2, "stop": [f"s{i}" for i in range(5)]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop"
    assert "--max-num-stop-strings" in r.json()["error"]["message"]
    r = HTTP.post(f"{srv.url}/v1/chat/completions",
                  json={"messages": MESSAGES, "max_tokens": 2, "stop": [f"s{i}" for i in range(5)]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop"

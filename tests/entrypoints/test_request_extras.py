"""vLLM's request extras over the demo model: truncation, special tokens, token bans, token ids
and prompt logprobs in the answer, chat echo and continue_final_message."""
from __future__ import annotations

import json

from server_utils import HTTP

PROMPT = "Once upon a time, there was a little girl named"
BASE = {"model": "demo", "prompt": PROMPT, "max_tokens": 6, "temperature": 0}
CHAT = {"model": "demo", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 6, "temperature": 0}


def _post(server, path: str, body: dict) -> dict:
    r = HTTP.post(f"{server.url}{path}", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _error_param(server, path: str, body: dict) -> str:
    r = HTTP.post(f"{server.url}{path}", json=body)
    assert r.status_code == 400, r.text
    return r.json()["error"]["param"]


def test_truncate_prompt_tokens_and_add_special_tokens(server, demo_tokenizer):
    with_bos = len(demo_tokenizer(PROMPT).input_ids)
    without = len(demo_tokenizer(PROMPT, add_special_tokens=False).input_ids)
    assert with_bos == without + 1  # the demo's tokenizer adds BOS
    assert _post(server, "/v1/completions", BASE)["usage"]["prompt_tokens"] == with_bos
    r = _post(server, "/v1/completions", {**BASE, "add_special_tokens": False})
    assert r["usage"]["prompt_tokens"] == without
    r = _post(server, "/v1/completions", {**BASE, "truncate_prompt_tokens": 3, "echo": True})
    assert r["usage"]["prompt_tokens"] == 3
    kept = demo_tokenizer.decode(demo_tokenizer(PROMPT).input_ids[-3:])
    assert r["choices"][0]["text"].startswith(kept)  # the echo is what the model saw
    assert _post(server, "/v1/chat/completions", {**CHAT, "truncate_prompt_tokens": 2})["usage"]["prompt_tokens"] == 2
    assert _error_param(server, "/v1/completions", {**BASE, "truncate_prompt_tokens": 0}) == "truncate_prompt_tokens"


def test_return_token_ids_whole_and_streamed(server, demo_tokenizer):
    plain = _post(server, "/v1/completions", BASE)["choices"][0]
    assert "token_ids" not in plain and "prompt_token_ids" not in plain  # only when asked for
    c = _post(server, "/v1/completions", {**BASE, "return_token_ids": True})["choices"][0]
    assert c["prompt_token_ids"] == demo_tokenizer(PROMPT).input_ids
    assert len(c["token_ids"]) == 6 and demo_tokenizer.decode(c["token_ids"]) .strip() == c["text"].strip()
    with HTTP.stream("POST", f"{server.url}/v1/completions",
                     json={**BASE, "return_token_ids": True, "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    assert [t for ch in chunks for t in ch["choices"][0]["token_ids"]] == c["token_ids"]
    assert chunks[0]["choices"][0]["prompt_token_ids"] == c["prompt_token_ids"]
    chat = _post(server, "/v1/chat/completions", {**CHAT, "return_token_ids": True})
    assert chat["prompt_token_ids"] and len(chat["choices"][0]["token_ids"]) == 6


def test_allowed_token_ids_and_bad_words(server, demo_tokenizer):
    free = _post(server, "/v1/completions", {**BASE, "return_token_ids": True})["choices"][0]["token_ids"]
    allowed = sorted(set(free[1:]) | {5, 6, 7})  # the greedy first token is not allowed
    ids = _post(server, "/v1/completions", {**BASE, "return_token_ids": True,
                                             "allowed_token_ids": allowed})["choices"][0]["token_ids"]
    assert set(ids) <= set(allowed) and ids != free
    word = demo_tokenizer.decode([free[0]]).strip()
    banned = _post(server, "/v1/completions", {**BASE, "return_token_ids": True,
                                                "bad_words": [word]})["choices"][0]["token_ids"]
    assert free[0] not in banned
    assert _error_param(server, "/v1/completions", {**BASE, "allowed_token_ids": [10 ** 6]}) == "allowed_token_ids"
    assert _error_param(server, "/v1/completions", {**BASE, "bad_words": ["there was a little girl"]}) == "bad_words"
    assert _error_param(server, "/v1/completions", {**BASE, "bad_words": ["x"], "use_beam_search": True}) == "bad_words"


def test_prompt_logprobs_in_completion_choices(server, demo_tokenizer):
    c = _post(server, "/v1/completions", {**BASE, "prompt_logprobs": 1})["choices"][0]
    lp = c["prompt_logprobs"]
    assert len(lp) == len(demo_tokenizer(PROMPT).input_ids) and lp[0] is None
    for entry in lp[1:]:
        assert entry and all(v["logprob"] <= 0 and "rank" in v and v["decoded_token"] is not None
                             for v in entry.values())


def test_chat_echo_and_continue_final_message(server):
    body = {**CHAT, "messages": [{"role": "user", "content": "Tell me a story."},
                                 {"role": "assistant", "content": "Once upon a time"}],
            "add_generation_prompt": False, "continue_final_message": True, "echo": True}
    r = _post(server, "/v1/chat/completions", body)
    content = r["choices"][0]["message"]["content"]
    assert content.startswith("Once upon a time") and len(content) > len("Once upon a time")
    assert _error_param(server, "/v1/chat/completions",
                        {**body, "add_generation_prompt": True}) == "continue_final_message"

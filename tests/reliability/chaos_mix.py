"""The chaos client mix of tests/reliability: many concurrent HTTP clients against one server,
mixing parallel sampling (n = 2..4), beam search, stop strings, streaming and not, clients that
disconnect mid-stream or give up before the answer, and bad requests; then the checks.

``make_actions(seed, count)`` draws a fixed workload; ``run_chaos(url, actions)`` plays it at once
(every action starts after a small random delay, so arrivals interleave with running work) and
returns one ``Outcome`` per action; ``check_outcomes`` replays every completed request alone
against the same server (temperature 0, or seeded sampling with the same seed) and returns the
figures of the run. Loopback only: ``url`` must be http://127.0.0.1:PORT.
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

PROMPTS = ["Once upon a time", "The cat sat on the mat.", "Tom", "Lily and Ben were friends.",
           "One day, a little boy named Tim", "There was a big tree in the garden.",
           "Sue had a red ball.", "The sun was hot and the sky was blue."]
STOPS = [".", " the", ",", "!", " and", "Lily"]

# Bad requests, as raw bodies (NaN and lone surrogates are not expressible through json.dumps),
# with the status OpenAI's API (and vLLM) answers.
BAD_BODIES: list[tuple[str, bytes, int]] = [
    ("nan temperature", b'{"prompt": "Once", "max_tokens": 4, "temperature": NaN}', 400),
    ("infinite top_p", b'{"prompt": "Once", "max_tokens": 4, "top_p": Infinity}', 400),
    ("nan length_penalty", b'{"prompt": "Once", "max_tokens": 4, "use_beam_search": true, "n": 2, '
                           b'"length_penalty": NaN}', 400),
    ("lone surrogate prompt", b'{"prompt": "Once \\ud800 upon", "max_tokens": 4}', 400),
    ("lone surrogate stop", b'{"prompt": "Once", "max_tokens": 4, "stop": ["\\udfff"]}', 400),
    ("oversized n", b'{"prompt": "Once", "max_tokens": 4, "n": 64}', 400),
    ("n zero", b'{"prompt": "Once", "max_tokens": 4, "n": 0}', 400),
    ("oversized beam", b'{"prompt": "Once", "max_tokens": 4, "use_beam_search": true, "n": 64}', 400),
    ("beam max_tokens 0", b'{"prompt": "Once", "max_tokens": 0, "use_beam_search": true, "n": 2}', 400),
    ("beam streamed", b'{"prompt": "Once", "max_tokens": 4, "use_beam_search": true, "n": 2, '
                      b'"stream": true}', 400),
    ("unknown model", b'{"model": "no-such-model", "prompt": "Once", "max_tokens": 4}', 404),
    ("negative max_tokens", b'{"prompt": "Once", "max_tokens": -1}', 400),
    ("top_p above 1", b'{"prompt": "Once", "max_tokens": 4, "top_p": 2.0}', 400),
    ("negative temperature", b'{"prompt": "Once", "max_tokens": 4, "temperature": -0.5}', 400),
    ("seed beyond int64", b'{"prompt": "Once", "max_tokens": 4, "seed": 36893488147419103232}', 400),
    ("logprobs over cap", b'{"prompt": "Once", "max_tokens": 4, "logprobs": 1000}', 400),
    ("prompt of wrong type", b'{"prompt": {"text": "Once"}, "max_tokens": 4}', 400),
    ("empty prompt list", b'{"prompt": [], "max_tokens": 4}', 400),
    ("token id out of vocab", b'{"prompt": [1, 99999999], "max_tokens": 4}', 400),
    ("stop of wrong type", b'{"prompt": "Once", "max_tokens": 4, "stop": 12}', 400),
    ("stream_options without stream", b'{"prompt": "Once", "max_tokens": 4, '
                                      b'"stream_options": {"include_usage": true}}', 400),
    ("tools", b'{"prompt": "Once", "max_tokens": 4, "tools": [{"type": "function", '
              b'"function": {"name": "f"}}]}', 400),
    ("truncated JSON", b'{"prompt": "Once", "max_tokens": ', 400),
    ("not an object", b'[1, 2, 3]', 400),
    ("chat: messages not a list", b'{"messages": "hi", "max_tokens": 4}', 400),
    ("chat: lone surrogate", b'{"messages": [{"role": "user", "content": "hi \\ud83d"}], '
                             b'"max_tokens": 4}', 400),
]


@dataclass
class Action:
    kind: str  # "ok" | "disconnect" | "abort" | "bad"
    path: str
    body: dict[str, Any] | None = None
    raw: bytes | None = None  # a bad request's body
    name: str = ""
    expect_status: int = 200
    delay_s: float = 0.0  # before it starts
    cut_after_chunks: int = 0  # disconnect: events read before the client leaves
    give_up_after_s: float = 0.0  # abort: the client's read timeout


@dataclass
class Outcome:
    action: Action
    status: int | None = None
    choices: dict[int, tuple[str, str | None]] = field(default_factory=dict)  # index -> (text, finish)
    error: dict[str, Any] | None = None  # a 4xx/5xx body, or an error event of a stream
    left: bool = False  # the client went away before the end (disconnect, abort)


def _ok_body(rng: random.Random) -> tuple[str, dict[str, Any]]:
    prompt = rng.choice(PROMPTS)
    roll = rng.random()
    if roll < 0.15:  # beam search: whole answers only
        return "/v1/completions", {"prompt": prompt, "use_beam_search": True, "n": rng.randint(2, 3),
                                   "max_tokens": rng.randint(4, 12), "temperature": 0}
    body: dict[str, Any] = {"max_tokens": rng.randint(4, 40), "stream": rng.random() < 0.5}
    if roll < 0.55:
        body["temperature"] = 0
        body["n"] = 1 if rng.random() < 0.7 else rng.randint(2, 4)
    else:  # parallel sampling, seeded: the replay alone must give the same choices
        body.update(n=rng.randint(2, 4), temperature=0.9, top_p=0.95, seed=rng.randrange(2**31))
    if rng.random() < 0.35:
        body["stop"] = rng.sample(STOPS, rng.randint(1, 2))
    if rng.random() < 0.15:
        body["messages"] = [{"role": "user", "content": prompt}]
        return "/v1/chat/completions", body
    body["prompt"] = prompt
    return "/v1/completions", body


def make_actions(seed: int, count: int, max_delay_s: float = 2.0) -> list[Action]:
    """A fixed mix: ~45% requests that complete, ~20% mid-stream disconnects, ~10% early aborts,
    ~25% bad requests."""
    rng = random.Random(seed)
    actions: list[Action] = []
    for i in range(count):
        roll = rng.random()
        delay = rng.uniform(0, max_delay_s)
        if roll < 0.25:
            name, raw, status = BAD_BODIES[i % len(BAD_BODIES)]
            path = "/v1/chat/completions" if name.startswith("chat") else "/v1/completions"
            actions.append(Action("bad", path, raw=raw, name=name, expect_status=status, delay_s=delay))
        elif roll < 0.45:  # streams n = 1..4 long enough to be cut
            body = {"prompt": rng.choice(PROMPTS), "n": rng.randint(1, 4), "stream": True,
                    "max_tokens": rng.randint(40, 120), "temperature": rng.choice([0, 0.8]),
                    "ignore_eos": True}
            actions.append(Action("disconnect", "/v1/completions", body=body, delay_s=delay,
                                  cut_after_chunks=rng.randint(0, 8)))
        elif roll < 0.55:  # a whole answer the client stops waiting for (queued or running)
            body = {"prompt": rng.choice(PROMPTS), "n": rng.randint(1, 4), "max_tokens": rng.randint(60, 120),
                    "ignore_eos": True, "stream": rng.random() < 0.3}
            actions.append(Action("abort", "/v1/completions", body=body, delay_s=delay,
                                  give_up_after_s=rng.uniform(0.02, 0.4)))
        else:
            path, body = _ok_body(rng)
            actions.append(Action("ok", path, body=body, delay_s=delay))
    return actions


def _add_delta(choices: dict[int, tuple[str, str | None]], chunk: dict[str, Any]) -> None:
    for c in chunk.get("choices", []):
        text = c.get("text")
        if text is None:  # chat
            text = (c.get("delta") or {}).get("content") or ""
        old, finish = choices.get(c["index"], ("", None))
        choices[c["index"]] = (old + text, c.get("finish_reason") or finish)


def _whole(choices: list[dict[str, Any]]) -> dict[int, tuple[str, str | None]]:
    out = {}
    for c in choices:
        text = c["text"] if "text" in c else c["message"]["content"]
        out[c["index"]] = (text, c.get("finish_reason"))
    return out


async def play(client: httpx.AsyncClient, url: str, action: Action) -> Outcome:
    """One client's action; never raises for what the server answers."""
    await asyncio.sleep(action.delay_s)
    out = Outcome(action)
    headers = {"Content-Type": "application/json"}
    content = action.raw if action.raw is not None else json.dumps(action.body).encode()
    timeout = httpx.Timeout(60.0, read=action.give_up_after_s) if action.kind == "abort" else None
    streamed = bool(action.body and action.body.get("stream"))
    kwargs: dict[str, Any] = {"content": content, "headers": headers}
    if timeout is not None:
        kwargs["timeout"] = timeout
    try:
        async with client.stream("POST", url + action.path, **kwargs) as r:
            out.status = r.status_code
            if r.status_code != 200 or not streamed:
                body = await r.aread()
                data = json.loads(body) if body else {}
                if r.status_code != 200:
                    out.error = data
                else:
                    out.choices = _whole(data["choices"])
                return out
            events = 0
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if action.kind == "disconnect" and events >= action.cut_after_chunks:
                    out.left = True
                    return out  # leaving the block closes the connection mid-stream
                events += 1
                if line == "data: [DONE]":
                    break
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    out.error = chunk
                else:
                    _add_delta(out.choices, chunk)
    except httpx.TimeoutException:
        if action.kind != "abort":
            raise
        out.left = True
    return out


async def run_chaos(url: str, actions: list[Action], max_connections: int = 64) -> list[Outcome]:
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=16)
    async with httpx.AsyncClient(timeout=60.0, limits=limits) as client:
        return list(await asyncio.gather(*(play(client, url, a) for a in actions)))


def _replay_body(action: Action) -> dict[str, Any]:
    body = dict(action.body or {})
    body["stream"] = False
    return body


@dataclass
class Figures:
    requests: int = 0
    completed: int = 0
    disconnects: int = 0
    aborts: int = 0
    bad_inputs: int = 0
    server_errors: int = 0
    mismatches: list[str] = field(default_factory=list)
    bad_answers: list[str] = field(default_factory=list)
    leaks: list[str] = field(default_factory=list)
    preemptions: float = 0.0
    seconds: float = 0.0

    def line(self, label: str) -> str:
        return (f"chaos[{label}]: {self.requests} requests in {self.seconds:.1f} s: {self.completed} completed "
                f"and replayed, {self.disconnects} mid-stream disconnects, {self.aborts} early aborts, "
                f"{self.bad_inputs} bad inputs, {self.server_errors} 5xx, {len(self.mismatches)} mismatches, "
                f"{len(self.leaks)} leaks, {self.preemptions:.0f} preemptions")


def _is_error_object(body: Any, status: int) -> bool:
    err = body.get("error") if isinstance(body, dict) else None
    return (isinstance(err, dict) and isinstance(err.get("message"), str) and isinstance(err.get("type"), str)
            and err.get("code") == status and "param" in err)


def check_outcomes(url: str, outcomes: list[Outcome]) -> Figures:
    """Replay every completed request alone and compare; count everything (no asserts here)."""
    fig = Figures(requests=len(outcomes))
    with httpx.Client(timeout=60.0) as client:
        for o in outcomes:
            a = o.action
            if o.status is not None and o.status >= 500:
                fig.server_errors += 1
            if a.kind == "bad":
                fig.bad_inputs += 1
                if o.status != a.expect_status or not _is_error_object(o.error, o.status):
                    fig.bad_answers.append(f"{a.name}: {o.status} {o.error}")
                continue
            if o.left:
                fig.disconnects += a.kind == "disconnect"
                fig.aborts += a.kind == "abort"
                continue
            if o.status != 200 or o.error is not None:
                fig.bad_answers.append(f"{a.kind} {a.body}: {o.status} {o.error}")
                continue
            if a.kind != "ok":  # a cut or abort the server finished first: nothing to compare
                continue
            fig.completed += 1
            r = client.post(url + a.path, json=_replay_body(a))
            if r.status_code != 200:
                fig.bad_answers.append(f"replay {a.body}: {r.status_code} {r.text[:200]}")
                continue
            alone = _whole(r.json()["choices"])
            if alone != o.choices:
                fig.mismatches.append(f"{a.path} {a.body}:\n  under load {o.choices}\n  alone      {alone}")
    return fig


def scrape(client: httpx.Client, url: str) -> dict[str, float]:
    """GET /metrics as {sample name: value}, summed over labels."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(client.get(url + "/metrics").text):
        for s in family.samples:
            if "le" not in s.labels:
                values[s.name] = values.get(s.name, 0.0) + s.value
    return values


def wait_idle(url: str, timeout_s: float = 20.0) -> dict[str, float]:
    """The metrics once running = waiting = 0 and KV usage = 0 (or the last ones at the timeout)."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=10.0) as client:
        while True:
            m = scrape(client, url)
            idle = (m.get("vllm:num_requests_running") == 0 and m.get("vllm:num_requests_waiting") == 0
                    and m.get("vllm:kv_cache_usage_perc") == 0)
            if idle or time.monotonic() > deadline:
                return m
            time.sleep(0.05)


def idle_leaks(m: dict[str, float]) -> list[str]:
    return [f"{name} = {m.get(name)}" for name in
            ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
            if m.get(name) != 0]

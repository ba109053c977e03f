"""The `pagedllm` command: engine flags generated from the config dataclasses, `generate`,
`bench` dispatch, and `serve` in a subprocess (API key, clean shutdown on SIGINT)."""
from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import pytest
from ci_support import free_port
from server_utils import CLI_API_KEY, HTTP, wait_for_health

from pagedllm import SamplingParams
from pagedllm.config import CacheConfig, ModelConfig, SchedulerConfig, default_model
from pagedllm.entrypoints.cli import engine_kwargs, main, make_parser


def _subparser(name: str):
    parser = make_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return sub.choices[name]


def test_every_engine_field_is_a_flag_with_its_help():
    serve = _subparser("serve")
    flags = {opt: a for a in serve._actions for opt in a.option_strings}
    for cls in (ModelConfig, CacheConfig, SchedulerConfig):
        for f in dataclasses.fields(cls):
            if f.name == "model":
                continue
            flag = "--" + f.name.replace("_", "-")
            assert flag in flags, flag
            assert f.metadata["help"] in flags[flag].help
    assert "--no-enable-prefix-caching" in flags and "--speculative-config" in flags


def test_engine_kwargs_carry_only_the_flags_given():
    args = make_parser().parse_args(["serve", "/m", "--max-num-seqs", "4", "--no-enable-prefix-caching",
                                     "--block-size", "8", "--speculative-config", '{"num_speculative_tokens": 2}'])
    assert engine_kwargs(args) == {"max_num_seqs": 4, "enable_prefix_caching": False, "block_size": 8,
                                   "speculative_config": {"num_speculative_tokens": 2}}
    assert args.model_tag == "/m" and args.port == 8000 and args.api_key is None
    assert engine_kwargs(make_parser().parse_args(["serve"])) == {}
    with pytest.raises(SystemExit):
        make_parser().parse_args(["serve", "--speculative-config", "not json"])


def test_generate_prints_the_completion(capsys, reference_llm):
    assert main(["generate", "Once upon a time", "--max-tokens", "16", "--temperature", "0",
                 "--num-gpu-blocks-override", "64"]) == 0
    printed = capsys.readouterr().out
    expected = reference_llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=16),
                                      use_tqdm=False)[0].outputs[0].text
    assert printed.strip() == ("Once upon a time" + expected).strip()


def test_generate_reports_bad_flags_cleanly(capsys):
    assert main(["generate", "hi", "--temperature", "-1", "--num-gpu-blocks-override", "16"]) == 2
    assert "temperature" in capsys.readouterr().err


def _fake_checkout(tmp_path, monkeypatch):
    """A checkout whose benchmarks/ holds one benchmark, fake_bench.py, that records its argv."""
    import pagedllm

    (tmp_path / "pagedllm").mkdir()
    bench = tmp_path / "benchmarks"
    bench.mkdir()
    (bench / "__init__.py").write_text("")
    (bench / "fake_bench.py").write_text("CALLS = []\ndef main(argv):\n    CALLS.append(argv)\n    return 0\n")
    monkeypatch.setattr(pagedllm, "__file__", str(tmp_path / "pagedllm" / "__init__.py"))
    for name in [m for m in sys.modules if m == "benchmarks" or m.startswith("benchmarks.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "path", list(sys.path))
    return bench


def test_bench_runs_main_of_the_checkouts_benchmarks_folder(tmp_path, monkeypatch, capsys):
    _fake_checkout(tmp_path, monkeypatch)
    assert main(["bench", "fake", "--steps", "3", "-x"]) == 0  # a unique NAME_* prefix answers
    assert sys.modules["benchmarks.fake_bench"].CALLS == [["--steps", "3", "-x"]]
    assert main(["bench", "no_such_benchmark"]) == 2
    err = capsys.readouterr().err
    assert "no benchmark 'no_such_benchmark'" in err and "available: fake_bench" in err


def test_bench_outside_a_checkout_fails_in_one_line(tmp_path, monkeypatch, capsys):
    import pagedllm

    monkeypatch.setattr(pagedllm, "__file__", str(tmp_path / "site-packages" / "pagedllm" / "__init__.py"))
    assert main(["bench", "throughput"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "benchmarks live in the source checkout" in err


def test_the_real_benchmarks_are_found_beside_the_package():
    from pagedllm.entrypoints.cli import _benchmark_names, _benchmarks_dir

    names = _benchmark_names(_benchmarks_dir())
    assert {"throughput", "latency", "prefix", "memory", "scheduler_overhead"} <= set(names)


def test_serve_api_key_and_clean_sigint_shutdown(cli_server):
    wait_for_health(cli_server.url, cli_server.proc, cli_server.log)
    url = cli_server.url
    body = {"model": "demo", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": CLI_API_KEY}):
        r = HTTP.post(f"{url}/v1/completions", json=body, headers=headers)
        assert r.status_code == 401, headers
        assert r.json()["error"]["type"] == "AuthenticationError"
    assert HTTP.get(f"{url}/v1/models").status_code == 401
    auth = {"Authorization": f"Bearer {CLI_API_KEY}"}
    r = HTTP.post(f"{url}/v1/completions", json=body, headers=auth)
    assert r.status_code == 200 and r.json()["choices"][0]["text"]
    models = HTTP.get(f"{url}/v1/models", headers=auth).json()
    assert [m["id"] for m in models["data"]] == ["demo"]
    chat = HTTP.post(f"{url}/v1/chat/completions", headers=auth,
                      json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert chat.status_code == 200  # --chat-template given inline
    assert HTTP.get(f"{url}/health").status_code == 200  # only /v1 needs the key

    # A stream in flight when SIGINT arrives ends (finished or with an error), and the process exits.
    lines: list[str] = []

    def stream() -> None:
        try:
            with HTTP.stream("POST", f"{url}/v1/completions", headers=auth, timeout=30,
                              json={**body, "max_tokens": 300, "ignore_eos": True, "stream": True}) as r:
                for line in r.iter_lines():
                    lines.append(line)
        except httpx.HTTPError as e:  # the connection may be cut: that ends the stream too
            lines.append(f"closed: {e!r}")

    reader = threading.Thread(target=stream)
    reader.start()
    while not any(line.startswith("data: {") for line in lines):
        assert reader.is_alive()
        time.sleep(0.01)
    cli_server.proc.send_signal(signal.SIGINT)
    reader.join(timeout=20)
    assert not reader.is_alive()
    assert cli_server.proc.wait(timeout=20) == 0
    events = [line for line in lines if line]
    assert events[-1] == "data: [DONE]", events[-3:]
    # Finished in the grace period, or told why not.
    assert '"finish_reason":"length"' in events[-2] or '"error"' in events[-2], events[-2]


@pytest.mark.parametrize("flags,message", [
    (["--quantization", "fp8"], "quantization 'fp8' is not supported; supported: awq, gptq"),
    (["--kv-cache-dtype", "fp4"], "kv_cache_dtype 'fp4' is unsupported; supported: auto, bfloat16"),
    (["-tp", "3"], "valid sizes: 1, 2, 4"),  # the demo model: 8 heads, 4 KV heads, 172 MLP units
    (["--max-logprobs", "50"], "0 to 20 logprobs"),
])
def test_vllm_flags_pagedllm_lacks_fail_in_one_line(capsys, flags, message):
    assert main(["serve", "--num-gpu-blocks-override", "16", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_underscore_spellings_parse_like_dashes():
    dashed = make_parser().parse_args(["serve", "--max-num-seqs", "4", "--served-model-name", "x"])
    under = make_parser().parse_args(["serve", "--max_num_seqs", "4", "--served_model_name=x"])
    assert engine_kwargs(dashed) == engine_kwargs(under) == {"max_num_seqs": 4}
    assert under.served_model_name == ["x"]


def test_a_vllm_launch_line_parses_and_serves_and_sigterm_exits_0(tmp_path):
    """vLLM's flags, TLS, CORS, no --chat-template (the demo's own is used), then SIGTERM."""
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
                    "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1"], check=True,
                   capture_output=True)
    port = free_port()
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--model", default_model(),
           "--port", str(port), "--served-model-name", "demo", "--max_model_len", "256", "-tp", "1",
           "--enforce-eager", "--disable-log-stats", "--enable-log-requests", "--max-logprobs", "5",
           "--generation-config", "auto", "--trust-remote-code", "--uvicorn-log-level", "warning",
           "--allowed-origins", '["http://example.com"]', "--root-path", "/proxy",
           "--ssl-keyfile", str(key), "--ssl-certfile", str(cert), "--enable-auto-tool-choice",
           "--tool-call-parser", "hermes", "--kv-cache-dtype", "auto", "--gpu_memory_utilization",
           "0.5", "--num_gpu_blocks_override", "64", "--shutdown-timeout", "1",
           "--disable-uvicorn-access-log", "--max-log-len", "100", "--disable-fastapi-docs"]
    log = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"https://127.0.0.1:{port}"
    try:
        with httpx.Client(verify=False, timeout=30) as tls:
            deadline = time.monotonic() + 90
            while True:
                assert proc.poll() is None, _tail(log)
                try:
                    if tls.get(f"{url}/ping").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, _tail(log)
                time.sleep(0.2)
            body = {"model": "demo", "prompt": "Once upon a time", "max_tokens": 4, "logprobs": 5}
            r = tls.post(f"{url}/v1/completions", json=body, headers={"Origin": "http://example.com"})
            assert r.status_code == 200, r.text
            assert r.headers["access-control-allow-origin"] == "http://example.com"
            assert tls.post(f"{url}/v1/completions", json={**body, "logprobs": 6}).status_code == 400
            chat = tls.post(f"{url}/v1/chat/completions", json={
                "model": "demo", "messages": [{"role": "user", "content": "Once upon a time"}],
                "max_tokens": 4})
            assert chat.status_code == 200, chat.text  # the demo's template, found by itself
            tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
            chat = tls.post(f"{url}/v1/chat/completions", json={  # auto, on the hermes parser
                "model": "demo", "messages": [{"role": "user", "content": "Once"}], "max_tokens": 4,
                "tools": tools})
            assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["tool_calls"] == []
            assert tls.get(f"{url}/version").json()["version"]
            assert tls.get(f"{url}/openapi.json").status_code == 404  # --disable-fastapi-docs
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, _tail(log)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


def _tail(log) -> str:
    log.seek(0)
    return log.read()[-3000:]


def test_llm_chat_works_on_the_demo_model_out_of_the_box(reference_llm):
    out = reference_llm.chat([{"role": "user", "content": "Once upon a time"}],
                             SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert out[0].outputs[0].text

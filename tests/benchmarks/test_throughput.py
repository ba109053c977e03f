"""The throughput benchmark's repeats: rounds interleaved across engines, medians, ratios paired by
round, and the --serve protocol of the vLLM peer, driven by stand-ins (vLLM is not needed)."""
from __future__ import annotations

import importlib.util
import io
import json
import statistics
import sys
import textwrap

import pytest

from benchmarks import common, throughput

SMALL_KV = ["--engine-arg", "num_gpu_blocks_override=256"]

# Answers like vllm_peer.py --serve: a ready line, then one result per stdin line. Elapsed times
# differ per run (compile: 0.5 s, 1.0 s, ...; eager: 2.0 s, 1.0 s, ...), ids are all 7s.
FAKE_PEER = textwrap.dedent("""
    import json, sys
    argv = sys.argv[1:]
    lens = json.load(open(argv[argv.index("--workload-file") + 1]))["output_lens"]
    mode = argv[argv.index("--mode") + 1]
    print(json.dumps({"ready": True, "vllm_version": "0.0-fake", "mode": mode, "load_s": 1.5}), flush=True)
    k = 0
    for line in sys.stdin:
        k += 1
        elapsed = 0.5 * k if mode == "compile" else 2.0 / k
        print(json.dumps({"elapsed_s": elapsed, "num_tokens": sum(lens),
                          "token_ids": [[7] * n for n in lens]}), flush=True)
""")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return str(common.build_model("tiny", tmp_path_factory.mktemp("bench") / "tiny"))


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch) -> str:
    fake = tmp_path / "fake_peer.py"
    fake.write_text(FAKE_PEER)
    python = tmp_path / "python"  # called as PYTHON vllm_peer.py --serve ...: drop the script path
    python.write_text(f'#!/bin/sh\nshift\nexec {sys.executable} {fake} "$@"\n')
    python.chmod(0o755)
    # The tiny model's head size (16) is no vLLM CPU one; the stand-in does not care.
    monkeypatch.setattr(throughput, "VLLM_CPU_HEAD_SIZES", (16,))
    return str(python)


def test_round_order_alternates():
    names = ["pagedllm", "hf", "vllm", "vllm-eager"]
    assert throughput.round_order(names, 0) == names
    assert throughput.round_order(names, 1) == names[::-1]
    assert throughput.round_order(names, 2) == names


def _run(engine: str, rnd: int, tps: float, ids: list[list[int]]) -> dict:
    return {"engine": engine, "round": rnd, "position": 0, "elapsed_s": 100 / tps,
            "num_tokens": 100, "token_ids": ids}


def test_ratios_pair_runs_by_round():
    a, b = [[1, 2], [3]], [[1, 2], [4]]
    runs = [_run("pagedllm", 0, 100, a), _run("peer", 0, 50, a),  # ratios by round: 2, 1, 0.5
            _run("peer", 1, 300, b), _run("pagedllm", 1, 300, a),
            _run("peer", 2, 400, a), _run("pagedllm", 2, 200, b)]
    e = throughput.summarize(runs[::-1])  # the input order does not matter, the rounds do
    ours, peer = e["pagedllm"], e["peer"]
    assert ours["runs_tok_per_s"] == pytest.approx([100, 300, 200]) and ours["tok_per_s"] == pytest.approx(200)
    assert peer["runs_tok_per_s"] == pytest.approx([50, 300, 400]) and peer["tok_per_s"] == pytest.approx(300)
    assert peer["runs_pagedllm_ratio"] == pytest.approx([2.0, 1.0, 0.5])
    assert peer["pagedllm_ratio"] == pytest.approx(1.0)  # not 200 / 300, the ratio of the medians
    assert ours["repeats_same_ids"] == 2 and peer["repeats_same_ids"] == 2
    assert peer["greedy_agree"] == 2  # the first runs of both engines: ids a and a
    assert "pagedllm_ratio" not in ours


def test_repeat_2_with_interleaved_stand_in_vllm_peers(tiny_model, fake_vllm, tmp_path, capsys):
    out, png = tmp_path / "t.json", tmp_path / "t.png"
    throughput.main(["--model", tiny_model, "--workload", "small", "--repeat", "2", "--vllm-mode",
                     "both", "--vllm-python", fake_vllm, "--json", str(out), "--plot", str(png),
                     "--matmul-size", "128", *SMALL_KV])
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("throughput small (4 req, median of 2 "), lines
    r = json.loads(out.read_text())
    names = ["pagedllm", "hf", "vllm", "vllm-eager"]
    assert r["repeat"] == 2 and list(r["engines"]) == names and len(r["runs_matmul_flops_per_s"]) == 2
    # Round 1 in the given order, round 2 reversed; one engine at a time.
    assert [(x["round"], x["engine"]) for x in r["runs"]] == (
        [(0, n) for n in names] + [(1, n) for n in names[::-1]])
    assert all(x["position"] == i % 4 for i, x in enumerate(r["runs"]))
    assert all("token_ids" not in x for x in r["runs"])
    ours = r["engines"]["pagedllm"]
    assert ours["repeats_same_ids"] == 2  # greedy: both repeats give the same ids
    ours_runs = [x for x in r["runs"] if x["engine"] == "pagedllm"]
    assert all(x["prefix_cache_hits"] == 0 for x in ours_runs)  # reset before every run
    assert r["engines"]["hf"]["greedy_agree"] == 4
    for name in names:
        e = r["engines"][name]
        runs = sorted((x for x in r["runs"] if x["engine"] == name), key=lambda x: x["round"])
        assert e["runs_tok_per_s"] == [x["tok_per_s"] for x in runs]
        assert e["tok_per_s"] == pytest.approx(statistics.median(e["runs_tok_per_s"]))
        if name != "pagedllm":
            paired = [a / b for a, b in zip(ours["runs_tok_per_s"], e["runs_tok_per_s"])]
            assert e["runs_pagedllm_ratio"] == pytest.approx(paired)
            assert e["pagedllm_ratio"] == pytest.approx(statistics.median(paired))
            assert f"{name} {e['tok_per_s']:.1f} tok/s" in lines[0]
            assert f"{e['pagedllm_ratio']:.2f}x (" in lines[0]
    # The stand-ins' own numbers: each answered in its own turn, first run first.
    n = r["num_output_tokens"]
    assert r["engines"]["vllm"]["runs_tok_per_s"] == pytest.approx([n / 0.5, n / 1.0])
    assert r["engines"]["vllm-eager"]["runs_tok_per_s"] == pytest.approx([n / 2.0, n / 1.0])
    v = r["engines"]["vllm"]
    assert v["vllm_version"] == "0.0-fake" and v["mode"] == "compile" and v["greedy_agree"] == 0
    assert r["engines"]["vllm-eager"]["mode"] == "eager"
    assert v["idle_cpu_share"] is None or v["idle_cpu_share"] >= 0
    assert png.stat().st_size > 0


def test_repeat_1_keeps_the_single_run_line():
    e = {"tok_per_s": 200.0, "runs_tok_per_s": [200.0], "repeats_same_ids": 1, "utilization": 0.1}
    peer = {"tok_per_s": 100.0, "runs_tok_per_s": [100.0], "repeats_same_ids": 1,
            "pagedllm_ratio": 2.0, "runs_pagedllm_ratio": [2.0], "greedy_agree": 3}
    result = {"workload": "small", "num_requests": 4, "repeat": 1, "flops_per_output_token": 2e6,
              "matmul_flops_per_s": 4e9, "engines": {"pagedllm": e, "hf": peer}}
    assert throughput.result_line(result) == (
        "throughput small (4 req): pagedllm 200.0 tok/s | hf 100.0 tok/s (2.00x, greedy agree 3/4) "
        "| 2.0 MFLOP/tok, 0.4 GFLOP/s = 10.0% of 4.0 GFLOP/s fp32 matmul")


def test_a_vllm_peer_that_dies_before_ready(tiny_model, tmp_path, monkeypatch):
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\nexit 3\n")
    python.chmod(0o755)
    monkeypatch.setattr(throughput, "VLLM_CPU_HEAD_SIZES", (16,))
    with pytest.raises(SystemExit, match=r"vLLM peer \(compile\) failed \(exit 3\)"):
        throughput.main(["--model", tiny_model, "--workload", "small", "--no-hf", "--vllm",
                         "--vllm-python", str(python), "--repeat", "2", *SMALL_KV])


def test_repeat_must_be_positive(capsys):
    with pytest.raises(SystemExit):
        throughput.main(["--repeat", "0"])
    assert "--repeat must be at least 1" in capsys.readouterr().err


def test_vllm_peer_serve_protocol():
    # vllm_peer imports the standard library only, until main() runs.
    from benchmarks import vllm_peer

    calls = []

    def run_once() -> dict:
        calls.append(1)
        return {"elapsed_s": 0.25 * len(calls), "num_tokens": 10, "token_ids": [[1, 2]]}

    out = io.StringIO()
    n = vllm_peer.serve({"ready": True, "vllm_version": "x"}, run_once, io.StringIO("run\n\nrun\n"), out)
    lines = [json.loads(x) for x in out.getvalue().splitlines()]
    assert n == 2 and len(calls) == 2  # the blank line is no request
    assert lines[0] == {"ready": True, "vllm_version": "x"}
    assert [x["elapsed_s"] for x in lines[1:]] == [0.25, 0.5]


def test_vllm_peer_serve_explains_a_missing_vllm():
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed here")
    from benchmarks import vllm_peer

    with pytest.raises(SystemExit, match="setup_vllm_cpu.sh"):
        vllm_peer.main(["--model", "x", "--workload-file", "w", "--serve"])


def test_plot_title_names_the_cpu(tmp_path, monkeypatch):
    """A throughput picture says which CPU and tuned level it came from (the result's "cpu",
    else this machine's), so a figure from another machine or build is never mistaken."""
    import matplotlib.figure

    titles: list[str] = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig",
                        lambda fig, *a, **k: titles.append(fig.axes[0].get_title()))
    engine = {"tok_per_s": 10.0, "runs_tok_per_s": [9.0, 10.0, 11.0]}
    result = {"workload": "cpu", "num_requests": 32, "repeat": 3,
              "engines": {"pagedllm": engine, "vllm": engine}}
    throughput.plot(str(tmp_path / "a.png"), {**result, "cpu": "AMD EPYC 9R14 (x86-64-v4: AVX-512)"})
    throughput.plot(str(tmp_path / "b.png"), result)
    assert titles[0].endswith("\nAMD EPYC 9R14 (x86-64-v4: AVX-512)"), titles
    from pagedllm.kernels.cpu_extension import cpu_description
    assert titles[1].endswith("\n" + cpu_description()), titles


def test_vllm_peer_follows_a_capped_torch(monkeypatch):
    """ATEN_CPU_CAPABILITY=avx2 on an AVX-512 CPU: the peer's vLLM must see no AVX-512, BF16, VNNI
    or AMX (it picks its _C_AVX2 library and code paths from these); uncapped, they read the CPU."""
    import torch

    from benchmarks import vllm_peer

    names = vllm_peer.CPU_FEATURE_PROBES
    for name in names:
        monkeypatch.setattr(torch.cpu, name, lambda: True)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    vllm_peer.follow_torch_capability()
    assert all(getattr(torch.cpu, name)() for name in names)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    vllm_peer.follow_torch_capability()
    assert not any(getattr(torch.cpu, name)() for name in names)

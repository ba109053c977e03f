"""Smoke tests of the benchmarks: each main() runs end to end on a tiny random model with tiny
settings, prints one result line and writes JSON with sane numbers. Speed is not checked."""
from __future__ import annotations

import importlib.util
import json
import re
import statistics
from pathlib import Path

import pytest

from benchmarks import common

# A small KV cache: allocating the default one costs more time than the smoke runs themselves.
SMALL_KV = ["--engine-arg", "num_gpu_blocks_override=256"]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return str(common.build_model("tiny", tmp_path_factory.mktemp("bench") / "tiny"))


def _one_line(capsys, prefix: str) -> str:
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(prefix), lines
    return lines[0]


def _printed_ratio_is(printed: float, num: float, den: float, digits: int) -> None:
    # num and den as printed (rounded to 0.1): the ratio's error bound from that rounding.
    lo, hi = (num - 0.05) / (den + 0.05), (num + 0.05) / (den - 0.05)
    assert lo - 10 ** -digits <= printed <= hi + 10 ** -digits, (printed, num, den)


def test_workloads_are_fixed_and_in_range():
    a, b = common.make_workload("cpu", 32000), common.make_workload("cpu", 32000)
    assert a.prompts == b.prompts and a.output_lens == b.output_lens
    assert a.num_requests == 32
    assert all(32 <= len(p) <= 256 for p in a.prompts) and all(64 <= o <= 256 for o in a.output_lens)
    assert common.make_workload("nano", 32000).num_requests == 256


def test_flop_count_of_the_tiny_model(tiny_model):
    s = common.model_stats(tiny_model)
    # Per layer: q 64x64, k/v 64x32 each, o 64x64, MLP 3x64x128, 2 norms of 64, q/k norms of 16;
    # plus the final norm. Embedding and head: 32000 x 64 each (untied).
    assert s.num_body_params == 2 * (4096 + 2 * 2048 + 4096 + 3 * 64 * 128 + 2 * 64 + 2 * 16) + 64
    assert s.num_embedding_params == s.num_head_params == 32000 * 64
    one = common.Workload("one", [[5]], [1])  # one token in, one out: no attention beyond itself
    assert common.workload_flops(s, one) == 2 * s.num_body_params + 4 * 2 * 4 * 16 + 2 * 64 * 32000
    assert common.percentile([1.0, 2.0, 3.0], 50) == 2.0


def test_throughput(tiny_model, tmp_path, capsys):
    from benchmarks import throughput

    out, png = tmp_path / "t.json", tmp_path / "t.png"
    throughput.main(["--model", tiny_model, "--workload", "small", "--json", str(out),
                     "--plot", str(png), "--matmul-size", "128", *SMALL_KV])
    line = _one_line(capsys, "throughput small")
    r = json.loads(out.read_text())
    ours, hf = r["engines"]["pagedllm"], r["engines"]["hf"]
    assert r["num_requests"] == 4
    # Every timed run produced the tokens the workload asks for.
    assert r["num_output_tokens"] == sum(common.make_workload("small", 32000).output_lens)
    assert all(x["num_tokens"] == r["num_output_tokens"] for x in r["runs"])
    assert hf["greedy_agree"] == 4, line  # float32 greedy on a tiny model: identical tokens
    # Each round's printed ratio is the ratio of that round's printed rates; the headline ratio
    # is the median of the rounds' ratios.
    assert r["repeat"] == 3
    ours_runs = re.search(r"pagedllm [\d.]+ tok/s \(([\d./]+);", line).group(1).split("/")
    hf_runs, ratio, ratio_runs = re.search(
        r"\| hf [\d.]+ tok/s \(([\d./]+)\), ([\d.]+)x \(([\d./]+)\)", line).groups()
    for mine, peer, printed in zip(ours_runs, hf_runs.split("/"), ratio_runs.split("/"), strict=True):
        _printed_ratio_is(float(printed), float(mine), float(peer), 2)
    assert float(ratio) == statistics.median(float(x) for x in ratio_runs.split("/"))
    assert hf["runs_pagedllm_ratio"] == pytest.approx(
        [a / b for a, b in zip(ours["runs_tok_per_s"], hf["runs_tok_per_s"])])
    assert hf["pagedllm_ratio"] == statistics.median(hf["runs_pagedllm_ratio"])
    # Utilization: the FLOP/s the output tokens imply over the measured matmul FLOP/s.
    assert ours["utilization"] == pytest.approx(
        r["flops_per_output_token"] * ours["tok_per_s"] / r["matmul_flops_per_s"])
    assert f"{ours['utilization']:.1%} of" in line
    assert png.stat().st_size > 0


def test_throughput_runs_async_scheduling_beside_sync(tiny_model, tmp_path, capsys):
    from benchmarks import throughput

    out = tmp_path / "a.json"
    throughput.main(["--model", tiny_model, "--workload", "small", "--no-hf", "--repeat", "2",
                     "--async-scheduling", "both", "--json", str(out), "--matmul-size", "64", *SMALL_KV])
    line = _one_line(capsys, "throughput small")
    e = json.loads(out.read_text())["engines"]
    assert list(e) == ["pagedllm", "pagedllm-async"], line
    assert e["pagedllm-async"]["greedy_agree"] == 4 and e["pagedllm-async"]["repeats_same_ids"] == 2


def test_model_idle_measures_both_modes(tiny_model, tmp_path, capsys):
    from benchmarks import model_idle

    out = tmp_path / "i.json"
    model_idle.main(["--model", tiny_model, "--workload", "small", "--rounds", "2", "--json", str(out),
                     *SMALL_KV])
    line = _one_line(capsys, "model_idle small")
    r = json.loads(out.read_text())
    for mode in ("sync", "async"):
        runs = r["runs"][mode]
        assert len(runs) == 2, line
        assert all(0 < x["busy_s"] < x["wall_s"] for x in runs)  # the model ran, and not always
        assert all(x["idle_share"] == pytest.approx(1 - x["busy_s"] / x["wall_s"]) for x in runs)
        assert r["medians"][mode]["idle_share"] == pytest.approx(statistics.median(x["idle_share"] for x in runs))
        assert f"{r['medians'][mode]['idle_share']:.1%}" in line


def test_prefix(tiny_model, tmp_path, capsys):
    from benchmarks import prefix

    out = tmp_path / "p.json"
    prefix.main(["--model", tiny_model, "--num-requests", "4", "--prefix-len", "64",
                 "--question-len", "8", "--output-len", "3", "--json", str(out), *SMALL_KV])
    _one_line(capsys, "prefix")
    r = json.loads(out.read_text())
    on, off = r["caching_on"], r["caching_off"]
    assert off["prompt_tokens_computed"] == 4 * (64 + 8)
    assert 64 + 4 * 8 <= on["prompt_tokens_computed"] < off["prompt_tokens_computed"]
    assert r["outputs_agree"] == 4


def test_memory(tiny_model, tmp_path, capsys):
    from benchmarks import memory

    out = tmp_path / "m.json"
    # 128 KiB of KV at 512 bytes/token = 256 tokens: one contiguous request of max_model_len 256.
    memory.main(["--model", tiny_model, "--workload", "small", "--max-model-len", "256",
                 "--kv-budget-mib", "0.125", "--json", str(out), *SMALL_KV])
    _one_line(capsys, "memory small")
    r = json.loads(out.read_text())
    b = r["waste"]["busiest_step"]
    assert 0 < b["tokens"] <= b["slots"] and b["waste"] < b["contiguous_waste"]
    assert b["waste"] == pytest.approx(1 - b["tokens"] / b["slots"])  # the slots held, not filled
    assert b["contiguous_waste"] == pytest.approx(1 - b["tokens"] / (b["running"] * 256))
    assert r["contiguous_batch"] == 1 and r["paged_batch"]["peak_running"] >= 1
    held = r["paged_batch"]  # memory truth: the KV allocated is the budget, and nothing beside it
    assert r["kv_budget_bytes"] - 16 * 512 < held["kv_cache_bytes"] <= r["kv_budget_bytes"]
    assert held["other_tensor_bytes"] < 16 * 512 and held["peak_rss_bytes"] > 0
    # The weights reported apart from the KV: the checkpoint's float32 tensors, held once (the
    # packed panels pad each layer to 64 output rows: at most twice a tiny model's matrices).
    checkpoint = sum(p.stat().st_size for p in Path(tiny_model).glob("*.safetensors"))
    assert 0.9 * checkpoint < held["weight_bytes"] < 2 * checkpoint


def test_latency(tiny_model, tmp_path, capsys):
    from benchmarks import latency

    out = tmp_path / "l.json"
    latency.main(["--model", tiny_model, "--workload", "small", "--request-rate", "50",
                  "--server", "inprocess", "--json", str(out), *SMALL_KV])
    _one_line(capsys, "latency small")
    r = json.loads(out.read_text())
    assert r["completed"] == 4 and r["failed"] == 0
    assert r["total_output_tokens"] == sum(common.make_workload("small", 32000).output_lens)
    assert 0 < r["ttft"]["p50_ms"] <= r["ttft"]["p99_ms"]


def test_latency_compares_serving_modes_in_interleaved_rounds(tiny_model, tmp_path, capsys):
    from benchmarks import latency

    out = tmp_path / "c.json"
    latency.main(["--model", tiny_model, "--workload", "small", "--request-rate", "inf",
                  "--server", "inprocess", "--compare", "single,core-async", "--rounds", "2",
                  "--json", str(out), *SMALL_KV])
    lines = capsys.readouterr().out.strip().splitlines()
    assert [ln.split(" (")[0] for ln in lines] == [
        "latency small single", "latency small core-async", "latency small core-async",
        "latency small single", "latency single", "latency core-async"]
    assert "vs single: output tok/s" in lines[-1]
    r = json.loads(out.read_text())
    assert [x["config"] for x in r["runs"]] == ["single", "core-async", "core-async", "single"]
    assert all(x["completed"] == 4 and x["failed"] == 0 for x in r["runs"])
    assert r["summary"]["baseline"] == "single" and set(r["summary"]["medians"]) == {"single", "core-async"}
    with pytest.raises(SystemExit):
        latency.main(["--model", tiny_model, "--compare", "single,warp"])


def test_vllm_peer_explains_a_missing_vllm(tmp_path):
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed here")
    from benchmarks import vllm_peer

    with pytest.raises(SystemExit, match="setup_vllm_cpu.sh"):
        vllm_peer.main(["--model", "x", "--workload-file", "w", "--out", str(tmp_path / "o")])


@pytest.mark.slow
def test_dashboard_overhead(tiny_model, tmp_path, capsys):
    """One round each on a real `pagedllm serve` (engine core process): the open rounds' viewer
    gets step records, so the feed ran while the load was measured."""
    from benchmarks import dashboard_overhead

    out = tmp_path / "d.json"
    dashboard_overhead.main(["--model", tiny_model, "--workload", "small", "--rounds", "1",
                             "--json", str(out), *SMALL_KV])
    _one_line(capsys, "dashboard_overhead small")
    r = json.loads(out.read_text())
    assert len(r["closed_tok_s"]) == len(r["open_tok_s"]) == 1
    assert r["step_records_per_round"][0] > 0
    assert r["ratio_median"] == pytest.approx(r["open_tok_s"][0] / r["closed_tok_s"][0])


def test_linear_kernels_compares_the_skinny_kernel_with_its_peers(capsys):
    from benchmarks import linear_kernels
    from pagedllm.kernels.cpu_extension import can_run, load_cpu_ops

    if load_cpu_ops() is None:
        pytest.skip("no C++ compiler: no CPU kernels")
    linear_kernels.main(["--model-config", "tiny", "--rows", "1", "3", "--rounds", "1",
                         "--isa", "native", "v3"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 5 * 2
    for line in lines:
        cells = [c.strip() for c in line.split("|")]
        layer, rows = cells[0].split()
        assert layer in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head") and rows in ("1", "3")
        names = [c.split(" us")[0].rsplit(" ", 1)[0].strip() for c in cells[1:-1]]
        want = ["skinny native", *(["skinny v3"] if can_run("v3") else []), "onednn", "f_linear"]
        assert names == want, names
        # Each ratio is the faster library path's time over the kernel's, from the printed times
        # (whole microseconds: the bound allows their rounding).
        us = {name: float(c.split(" us")[0].rsplit(" ", 1)[1]) for name, c in zip(names, cells[1:-1])}
        best_lib = min(us["onednn"], us["f_linear"])
        ratios = dict(re.findall(r"(skinny \w+): ([\d.]+)x", cells[-1]))
        assert set(ratios) == {n for n in names if n.startswith("skinny")}
        for name, ratio in ratios.items():
            lo, hi = (best_lib - 0.5) / (us[name] + 0.5), (best_lib + 0.5) / max(us[name] - 0.5, 0.5)
            assert lo - 0.01 <= float(ratio) <= hi + 0.01, (line, name)


def test_half_decode_times_each_dtype_against_float32(tmp_path, capsys):
    from benchmarks import half_decode

    out = tmp_path / "h.json"
    half_decode.main(["--shape", "tiny", "--rounds", "1", "--dtype", "float32", "bfloat16",
                      "--threads", "1", "--model-dir", str(tmp_path), "--json", str(out),
                      "--engine-arg", "enforce_eager=True"])
    line = _one_line(capsys, "half_decode tiny: float32")
    r = json.loads(out.read_text())["results"][0]
    tok_s = r["decode_tok_s"]
    assert r["ratio_vs_first"]["float32"] == 1.0
    assert r["ratio_vs_first"]["bfloat16"] == pytest.approx(tok_s["bfloat16"] / tok_s["float32"])
    nbytes = r["weight_bytes_per_token"]
    assert nbytes["float32"] == 2 * nbytes["bfloat16"] > 0
    for dtype in ("float32", "bfloat16"):
        assert r["bandwidth_share"][dtype] == pytest.approx(tok_s[dtype] * nbytes[dtype] / r["read_bandwidth"])
    assert r["same_leading_ids"]["float32"] == half_decode.MAX_TOKENS
    same = r["same_leading_ids"]["bfloat16"]  # printed as the JSON has it
    assert f"({r['ratio_vs_first']['bfloat16']:.2f}x, " in line
    assert f"{same}/{half_decode.MAX_TOKENS} ids as float32" in line


def test_checkout_ab_alternates_two_checkouts(tiny_model, tmp_path, capsys):
    """This checkout against itself: two engine processes, alternating rounds, the same ids."""
    from benchmarks import checkout_ab

    root = str(Path(checkout_ab.__file__).resolve().parent.parent)
    out = tmp_path / "ab.json"
    checkout_ab.main(["--baseline", root, "--candidate", root, "--model", tiny_model,
                      "--workload", "small", "--rounds", "2", "--json", str(out),
                      "--engine-arg", "enforce_eager=True", *SMALL_KV])
    line = _one_line(capsys, "checkout_ab small")
    r = json.loads(out.read_text())
    assert r["same_ids"] and "same ids: yes" in line
    assert all(len(t) == 4 and min(t) > 0 for t in r["times_s"].values())  # 2 rounds x 2 orders
    med = {name: statistics.median(t) for name, t in r["times_s"].items()}
    assert r["speedup"] == pytest.approx(med["baseline"] / med["candidate"])
    assert len(r["speedup_by_start_order"]) == 2
    tokens = sum(common.make_workload("small", 32000).output_lens)
    assert r["num_tokens"] == tokens and f"({tokens / med['baseline']:.1f} -> " in line


def test_checkout_ab_refuses_a_folder_that_is_no_checkout(tmp_path):
    from benchmarks import checkout_ab

    with pytest.raises(SystemExit, match="not a pagedllm source checkout"):
        checkout_ab.main(["--baseline", str(tmp_path), "--model", "unused"])


def test_gguf_without_llama_cpp_measures_pagedllm_alone(tmp_path, capsys, monkeypatch):
    """No llama.cpp here: the benchmark says so, writes the tiny shape's Q8_0 file with the gguf
    package and measures pagedllm on it; every figure it prints is one its JSON holds."""
    import gguf

    from benchmarks import gguf as bench

    monkeypatch.setattr(bench, "CACHE_DIR", tmp_path / "cache")
    monkeypatch.setattr(bench, "LLAMA_CPP_VENV", tmp_path / "no-llama-cpp")
    out, bandwidth = tmp_path / "g.json", 1e10
    bench.main(["--shape", "tiny", "--type", "Q8_0", "--rounds", "1", "--threads", "1",
                "--skip", "batch", "--read-bandwidth", str(bandwidth), "--json", str(out)])
    captured = capsys.readouterr()
    assert "llama.cpp is not installed" in captured.err and "measuring pagedllm alone" in captured.err
    lines = captured.out.strip().splitlines()
    assert len(lines) == 1
    line = lines[0]
    assert line.startswith("tiny Q8_0 (auto activations, pagedllm alone, file by the gguf package): ")
    r = json.loads(out.read_text())["results"][0]
    m = r["medians"]
    assert list(m) == ["pagedllm"] and r["file_by"] == "gguf package"
    assert r["num_tokens"] == {"pagedllm": {"decode": 128, "prefill": 1}}  # what each job asks
    assert f"decode {m['pagedllm']['decode']:.1f} tok/s" in line
    assert f"prefill {m['pagedllm']['prefill']:.1f} tok/s" in line
    # The file: every matrix Q8_0 (34 bytes per 32 weights), the norms F32, the head tied.
    spec = bench.SHAPES["tiny"]
    h, i, n = spec["hidden_size"], spec["intermediate_size"], spec["num_hidden_layers"]
    kv = spec["head_dim"] * spec["num_key_value_heads"]
    matrices = spec["vocab_size"] * h + n * (2 * h * h + 2 * kv * h + 3 * i * h)
    norms = (2 * n + 1) * h
    reader = gguf.GGUFReader(str(tmp_path / "cache" / "gguf-tiny-gguf-py" / "Q8_0.gguf"))
    assert {t.tensor_type.name for t in reader.tensors if len(t.shape) == 2} == {"Q8_0"}
    assert "output.weight" not in {t.name for t in reader.tensors}
    assert r["weight_bytes_per_token"] == matrices // 32 * 34 + 4 * norms
    # pagedllm's share counts the bytes it holds: int8 codes (a byte a weight) and their scales,
    # no norms (outside the weight table), within a few percent of the file's.
    held = r["held_bytes_per_token"]
    assert matrices < held < 1.15 * r["weight_bytes_per_token"]
    share = r["decode_bandwidth_share"]["pagedllm"]
    assert share == pytest.approx(m["pagedllm"]["decode"] * held / bandwidth)
    assert f"decode bandwidth pagedllm {100 * share:.0f}%" in line
    assert r["rss_bound_bytes"] == int(1.1 * (r["file_bytes"] + bench.KV_BUDGET))
    assert 0 < r["rss_loaded_bytes"] <= r["peak_rss_bytes"]
    assert f"peak RSS {r['peak_rss_bytes'] / 2**20:.0f} MiB" in line
    # K-quants need llama.cpp's quantizer: refused in one line before anything is built.
    with pytest.raises(SystemExit, match="Q4_K_M: run bash benchmarks/setup_llama_cpp.sh"):
        bench.main(["--shape", "tiny", "--type", "Q4_K_M", "--read-bandwidth", "1e10"])


@pytest.mark.parametrize("shape", ["tiny", "qwen3-tiny"])
def test_embed(tmp_path, capsys, shape):
    """Both shapes (CLS pooling of BERT, last-token pooling of a Qwen3 decoder) give
    sentence-transformers' vectors on its own folder."""
    from benchmarks import embed

    out = tmp_path / "e.json"
    embed.main(["--shape", shape, "--folder", str(tmp_path), "--num-texts", "6", "--min-len", "8",
                "--max-len", "40", "--num-queries", "3", "--rounds", "1", "--json", str(out)])
    _one_line(capsys, f"embed ({shape}")
    r = json.loads(out.read_text())
    assert r["pagedllm"]["texts_per_s"] > 0 and r["sentence_transformers"]["query_p50_ms"] > 0
    assert r["bulk_ratio"] == r["pagedllm"]["texts_per_s"] / r["sentence_transformers"]["texts_per_s"]
    st = r["sentence_transformers"]
    assert st["max_abs_diff"] <= 1e-4 and st["min_cosine"] >= 0.99999, st


def _embed_peer_line(tmp_path, capsys, flags: list[str], name: str, shape: str = "tiny") -> None:
    """The peer's printed figures parse, its ratios are pagedllm's figures over its own, and its
    vectors are pagedllm's (both float32 on the same weights, normalized)."""
    from benchmarks import embed

    out = tmp_path / "e.json"
    embed.main(["--shape", shape, "--folder", str(tmp_path), "--num-texts", "6", "--min-len", "8",
                "--max-len", "40", "--num-queries", "3", "--rounds", "1", "--json", str(out), *flags])
    line = _one_line(capsys, f"embed ({shape}")
    m = re.search(rf"pagedllm ([\d.]+) texts/s .* single query p50 ([\d.]+) ms .* \| {re.escape(name)} ([\d.]+) "
                  rf"texts/s \(([\d.]+)x\), p50 ([\d.]+) ms \(pagedllm/{re.escape(name)} ([\d.]+)\)", line)
    assert m, line
    ours, our_p50, theirs, ratio, their_p50, p50_ratio = map(float, m.groups())
    _printed_ratio_is(ratio, ours, theirs, 2)
    _printed_ratio_is(p50_ratio, our_p50, their_p50, 2)
    r = json.loads(out.read_text())[name]
    assert r["bulk_ratio"] == json.loads(out.read_text())["pagedllm"]["texts_per_s"] / r["texts_per_s"]
    assert r["max_abs_diff"] <= 1e-4 and r["min_cosine"] >= 0.99999, r


def test_embed_llama_cpp_peer(tmp_path, capsys):
    from benchmarks.embed import LLAMA_CPP_PYTHON
    from benchmarks.llama_cpp_convert import converter_missing

    if converter_missing() or not LLAMA_CPP_PYTHON.is_file():
        pytest.skip(converter_missing() or f"no llama.cpp venv at {LLAMA_CPP_PYTHON}: run "
                    "benchmarks/setup_llama_cpp.sh")
    _embed_peer_line(tmp_path, capsys, ["--llama-cpp"], "llama.cpp")


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["tiny", "qwen3-tiny"])
def test_embed_vllm_peer(tmp_path, capsys, shape):
    from benchmarks.common import DEFAULT_VLLM_PYTHON

    if not DEFAULT_VLLM_PYTHON.is_file():
        pytest.skip(f"no vLLM venv at {DEFAULT_VLLM_PYTHON}: run benchmarks/setup_vllm_cpu.sh")
    _embed_peer_line(tmp_path, capsys, ["--vllm", "--vllm-eager"], "vllm", shape)


def test_embed_mixed(tiny_model, tmp_path, capsys):
    """One server generating and embedding: the streams' tokens all arrive, their gaps are
    measured alone and mixed, embeddings come back, and the ratio is the figures' ratio."""
    from benchmarks import embed

    out = tmp_path / "m.json"
    embed.main(["--mixed", "--model", tiny_model, "--server", "inprocess", "--rounds", "1", "--num-gen", "2",
                "--prompt-len", "8", "--max-tokens", "12", "--embed-concurrency", "2", "--embed-min-len", "8",
                "--embed-max-len", "40", "--num-embed-inputs", "4", "--max-pooling-tokens-while-decoding", "4",
                "--json", str(out), *SMALL_KV])
    line = _one_line(capsys, "embed --mixed (")
    r = json.loads(out.read_text())
    assert r["output_tokens"] == 2 * 2 * 12  # both phases, every stream to max_tokens
    for phase in ("alone", "mixed"):
        assert 0 < r[phase]["num_itl"] <= 2 * 11
        assert 0 < r[phase]["itl_p50_ms"] <= r[phase]["itl_p99_ms"]
    assert r["embeddings_returned"] >= 2 and r["embed_tokens"] <= 40 * r["embeddings"]
    assert r["p99_ratio"] == pytest.approx(r["mixed"]["itl_p99_ms"] / r["alone"]["itl_p99_ms"])
    assert f"p99 ratio {r['p99_ratio']:.3f}" in line

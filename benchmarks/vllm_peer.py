"""The vLLM peer of the throughput and LoRA benchmarks; runs inside the vLLM venv, not pagedllm's.

``throughput --vllm`` (and ``lora --vllm``) writes its workload to a JSON file ({"prompts":
[[ids]], "output_lens": [n], "warmup_prompts": ..., "warmup_output_lens": ..., and for adapters
"lora": {"paths": [PEFT folder], "max_lora_rank": r, "adapters": [index into paths, or null for
the base, per prompt], "warmup_adapters": [the same per warm-up prompt]}}) and runs this file
with the venv made by benchmarks/setup_vllm_cpu.sh, with VLLM_CPU_OMP_THREADS_BIND,
VLLM_CPU_KVCACHE_SPACE and VLLM_ENABLE_V1_MULTIPROCESSING set. Here vLLM runs the same protocol
as pagedllm: one warm-up call on other prompts, then timed generate() calls of every request at
once, greedy, ignore_eos, prompts given as token ids. vLLM's prefix cache is reset before every
timed call, so each one computes the whole workload. With "lora",
vLLM starts with enable_lora (max_loras = the number of folders, max_lora_rank) and each request
carries its adapter's LoRARequest (vLLM's CPU platform then turns its compilation off).

Two ways to run it:
  --serve (what the benchmark uses): load, warm up, print one JSON line {"ready": true,
    "vllm_version", "mode", "load_s"} on stdout, then for every line read from stdin run one timed
    generate() and answer one JSON line {"elapsed_s", "num_tokens", "token_ids"}; exit at the end
    of stdin. Between requests the process blocks on stdin, so the benchmark can interleave these
    runs with the other engines'. vLLM's own logs go to stderr; stdout carries only the JSON lines.
  --out FILE: one timed generate(), its result written to FILE as JSON: {"elapsed_s",
    "num_tokens", "token_ids", "vllm_version", "mode", "load_s"}.

--mode compile (the default, vLLM's own default on CPU) lets vLLM compile the model with
torch.compile/inductor while it loads (a minute or more on 2 cores the first time; vLLM caches it
under ~/.cache/vllm); --mode eager passes enforce_eager=True. Loading and compiling are not timed.
The model's head size must be one vLLM's CPU attention supports (32, 64, 80, ..., 256): the
benchmark's qwen3-58m has 64; the tiny random model (16) and stories260K (8) do not run here.

With ``ATEN_CPU_CAPABILITY=avx2`` in the environment the peer runs vLLM's AVX2 kernel library
(``follow_torch_capability``). Only the standard library and vllm (with its torch) are imported
(pagedllm is not installed in that venv), only inside main() and follow_torch_capability(), so
serve() can be driven without them.

    .venv-vllm/bin/python benchmarks/vllm_peer.py --model DIR --workload-file W \
        (--serve | --out O) [--mode compile|eager]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TextIO


def serve(ready: dict, run_once: Callable[[], dict], inp: TextIO, out: TextIO) -> int:
    """The --serve protocol: write ``ready`` as one JSON line, then answer each non-blank line of
    ``inp`` with ``run_once()`` as one JSON line. Returns how many runs it answered."""
    out.write(json.dumps(ready) + "\n")
    out.flush()
    n = 0
    for line in inp:  # a blocking read: an idle peer sleeps here
        if not line.strip():
            continue
        out.write(json.dumps(run_once()) + "\n")
        out.flush()
        n += 1
    return n


# What vLLM asks torch about the CPU before it picks its kernels (follow_torch_capability).
CPU_FEATURE_PROBES = ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_vnni_supported",
                      "_is_amx_tile_supported", "_is_amx_fp16_supported")


def follow_torch_capability() -> None:
    """vLLM chooses its kernel library (``_C``: AVX-512 with BF16, ``_C_AVX512``, ``_C_AVX2``) and
    its attention and MoE code paths from ``torch.cpu._is_*_supported()``, which read the CPU's
    flags, not the level torch runs at. Where torch is capped below AVX-512 (``ATEN_CPU_CAPABILITY=
    avx2``: an AVX-512 machine standing in for an AVX2 one, as the benchmarks' AVX2 figures do),
    those answers follow the cap, so the peer runs the code it would run on an AVX2 CPU."""
    import torch

    if torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        return
    for name in CPU_FEATURE_PROBES:
        if hasattr(torch.cpu, name):
            setattr(torch.cpu, name, lambda: False)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="Hugging Face model folder")
    parser.add_argument("--workload-file", required=True)
    how = parser.add_mutually_exclusive_group(required=True)
    how.add_argument("--out", help="run once and write the result JSON here")
    how.add_argument("--serve", action="store_true",
                     help="after the warm-up, run once per stdin line, answering JSON lines")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--mode", default="compile", choices=("compile", "eager"),
                        help="compile: vLLM's default torch.compile; eager: enforce_eager=True")
    args = parser.parse_args(argv)
    follow_torch_capability()
    try:
        import vllm
        from vllm import LLM, SamplingParams
    except ImportError as e:
        raise SystemExit(f"vllm_peer: vllm is not importable here ({e}); run it with the venv made "
                         f"by benchmarks/setup_vllm_cpu.sh") from e
    try:
        from vllm.inputs import TokensPrompt
    except ImportError:  # older layouts: a plain dict is the same TypedDict
        TokensPrompt = dict

    results = sys.stdout
    if args.serve:
        # stdout carries only the protocol: vLLM's logger (and anything else) writes to fd 1, so
        # point fd 1 at stderr and keep a private handle on the real stdout.
        results = os.fdopen(os.dup(1), "w")
        os.dup2(2, 1)
        sys.stdout = sys.stderr

    work = json.loads(Path(args.workload_file).read_text())
    prompts, output_lens = work["prompts"], work["output_lens"]
    max_len = max(len(p) + o for p, o in zip(prompts + work["warmup_prompts"],
                                             output_lens + work["warmup_output_lens"]))
    lora = work.get("lora")
    lora_args = {} if lora is None else {"enable_lora": True, "max_loras": len(lora["paths"]),
                                         "max_lora_rank": lora["max_lora_rank"]}
    t0 = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, seed=0, max_model_len=max_len,
              enforce_eager=args.mode == "eager", **lora_args)
    load_s = time.perf_counter() - t0

    def adapters(indices: list[int | None] | None) -> list | None:
        if indices is None:
            return None
        from vllm.lora.request import LoRARequest

        return [None if i is None else LoRARequest(f"adapter{i}", i + 1, lora["paths"][i]) for i in indices]

    def requests(ids: list[list[int]]) -> list:
        return [TokensPrompt(prompt_token_ids=p) for p in ids]

    def params(lens: list[int]) -> list:
        return [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for o in lens]

    # Warm-up: the same requests pagedllm warms up with (other tokens, short outputs).
    llm.generate(requests(work["warmup_prompts"]), params(work["warmup_output_lens"]), use_tqdm=False,
                 lora_request=adapters(lora and lora["warmup_adapters"]))

    def run_once() -> dict:
        if not llm.reset_prefix_cache():  # so a repeat recomputes every prompt
            raise SystemExit("vllm_peer: vLLM refused to reset its prefix cache")
        t0 = time.perf_counter()
        outputs = llm.generate(requests(prompts), params(output_lens), use_tqdm=False,
                               lora_request=adapters(lora and lora["adapters"]))
        elapsed = time.perf_counter() - t0
        token_ids = [list(o.outputs[0].token_ids) for o in outputs]
        got = [len(t) for t in token_ids]
        if got != output_lens:  # ignore_eos: every request must run to exactly its length
            raise SystemExit(f"vllm_peer: output lengths {got} differ from the workload's {output_lens}")
        print(f"vllm ({args.mode}): {sum(got) / elapsed:.1f} tok/s ({sum(got)} tokens in "
              f"{elapsed:.2f} s)", file=sys.stderr, flush=True)
        return {"elapsed_s": elapsed, "num_tokens": sum(got), "token_ids": token_ids}

    info = {"vllm_version": getattr(vllm, "__version__", "?"), "mode": args.mode, "load_s": load_s}
    if args.serve:
        serve({"ready": True, **info}, run_once, sys.stdin, results)
        return
    Path(args.out).write_text(json.dumps({**run_once(), **info}))
    print(f"vllm ({args.mode}): loading took {load_s:.1f} s", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1:])

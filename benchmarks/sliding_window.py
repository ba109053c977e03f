"""Sliding-window KV memory and decode time (issue 31's sliding-window figure).

Four random models, built once into the cache folder from transformers configs (same seed, so
each window model and its peer share every weight):
  mistral         Mistral, every layer windowed (``sliding_window`` W)
  mistral-full    the same config with ``sliding_window: null``: the full-attention peer
  gemma2          Gemma 2, local (window W) and global layers alternating
  gemma2-full     the same with every layer global (``layer_types`` all full_attention)

1. Memory. One request of ``--prompt-len`` prompt tokens (default 8,192) plus a few decode
   tokens, prefix caching off, ``--max-num-batched-tokens`` per step (the chunk), a block pool
   that could hold the whole request in every group, stepped through ``llm.llm_engine``. After
   every step the scheduler's KV cache manager says how many blocks the request holds in each
   KV cache group (``get_block_ids``, null slots left out); the peak over the run, in bytes
   (blocks x the runner's ``bytes_per_block``), is set against the full-attention peer's. The
   target: a window layer holds at most window + chunk + one block of KV
   (``cdiv(W + chunk, block_size) + 1`` blocks) however long the request: PASS / FAIL. The
   memory runs are eager (no torch.compile): block counts do not depend on it.
2. Decode time (``--skip timing`` leaves it out). The Mistral window model and its full peer,
   one request at each context length (``--contexts``, default 1K 2K 4K 8K): prefill, two
   warm-up decode steps, then the median time of ``--timed-steps`` decode steps (whole engine
   steps, ms), after one warm-up request per engine. Past W the window model's time should stay
   flat, the full one's grow. Context lengths run one after the other, the two models
   interleaved at each.

    python -m benchmarks.sliding_window [--window 1024] [--prompt-len 8192] [--decode-tokens 4]
        [--max-num-batched-tokens 512] [--block-size 16] [--shape small|tiny]
        [--contexts 1024 2048 4096 8192] [--timed-steps 16] [--skip timing] [--json FILE]
"""
from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
from pathlib import Path

from benchmarks.common import CACHE_DIR, add_engine_args, build_random_model, engine_args, log, write_json

# Layer shapes (shared by both families): "small" runs an 8K request in a minute or two on two
# cores; "tiny" is for the smoke test.
SHAPES: dict[str, dict] = {
    "small": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16),
}
MODELS = ("mistral", "mistral-full", "gemma2", "gemma2-full")
PEERS = {"mistral": "mistral-full", "gemma2": "gemma2-full"}
_TOKENS = dict(vocab_size=32000, bos_token_id=1, eos_token_id=2)  # the synthetic tokenizer's


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def model_spec(name: str, shape: str, window: int, max_len: int) -> dict:
    """The transformers config fields of model ``name``."""
    spec = dict(SHAPES[shape], **_TOKENS, max_position_embeddings=max_len)
    num_layers = spec["num_hidden_layers"]
    if name.startswith("mistral"):
        return dict(spec, kind="Mistral", tie_word_embeddings=False,
                    sliding_window=None if name.endswith("-full") else window)
    kinds = (["full_attention"] * num_layers if name.endswith("-full") else
             ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)])
    return dict(spec, kind="Gemma2", pad_token_id=0, query_pre_attn_scalar=spec["head_dim"],
                sliding_window=window, layer_types=kinds)


def build_window_model(name: str, spec: dict, root: Path) -> Path:
    """Build (once) the random model ``name`` from ``spec`` into ``root``/sw-NAME."""
    fields = {k: v for k, v in spec.items() if k != "kind"}
    return build_random_model(spec["kind"], fields, root / f"sw-{name}", stamp=spec)


def _prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [1] + [rng.randrange(3, 32000) for _ in range(length - 1)]


def _params(max_tokens: int):
    from pagedllm import SamplingParams
    from pagedllm.sampling_params import RequestOutputKind

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                          output_kind=RequestOutputKind.CUMULATIVE, detokenize=False)


def _local_runner(llm):
    runner = getattr(llm.llm_engine.executor, "runner", None)
    if runner is None or not hasattr(runner, "kv_cache_groups"):
        raise SystemExit("sliding_window reads the runner's KV cache groups: run the engine in this "
                         "process (PAGEDLLM_ENABLE_MULTIPROCESSING=0, one worker)")
    return runner


# -- 1. memory ---------------------------------------------------------------------------------
def measure_memory(folder: Path, args: argparse.Namespace) -> dict:
    """The peak KV the one long request holds, per group and in all, over every step."""
    from pagedllm import LLM

    bs, chunk = args.block_size, args.max_num_batched_tokens
    max_model_len = args.prompt_len + args.decode_tokens
    # A pool that holds the whole request in each of the (at most two) groups, so the bound is
    # the window manager's doing: a pool sized for the windows alone would enforce it.
    llm = LLM(str(folder), **engine_args(
        args, max_model_len=max_model_len, enable_prefix_caching=False,
        max_num_batched_tokens=chunk, block_size=bs, max_num_seqs=1, enforce_eager=True,
        num_gpu_blocks_override=2 * cdiv(max_model_len, bs)))
    engine = llm.llm_engine
    runner = _local_runner(llm)
    kv = engine.scheduler.kv_cache_manager
    groups = runner.kv_cache_groups
    bytes_per_block = runner.bytes_per_block(bs)  # one block id of the pool, every KV tensor
    bytes_per_layer_block = bytes_per_block // max(len(g.layer_indices) for g in groups)
    rid = "long"
    engine.add_request(rid, {"prompt_token_ids": _prompt(args.prompt_len, seed=0)},
                       _params(args.decode_tokens))
    peak_group = [0] * len(groups)
    last_group = [0] * len(groups)  # at the last step before the request finished (decoding)
    peak_blocks = peak_used = steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        if rid not in engine.scheduler.requests:
            continue  # finished: its blocks are back in the pool
        held = [sum(1 for b in table if b >= 0) for table in kv.get_block_ids(rid)]
        peak_group = [max(p, h) for p, h in zip(peak_group, held)]
        last_group = held
        peak_blocks = max(peak_blocks, sum(held))
        # The pool's view (the only request): nothing held outside its tables.
        peak_used = max(peak_used, kv.num_blocks - kv.block_pool.get_num_free_blocks())
    bound = cdiv(args.window + chunk, bs) + 1
    result = {
        "model": folder.name, "steps": steps, "num_blocks": kv.num_blocks,
        "bytes_per_block": bytes_per_block, "bytes_per_layer_block": bytes_per_layer_block,
        "peak_blocks": peak_blocks, "peak_pool_blocks_used": peak_used,
        "kv_bytes": peak_blocks * bytes_per_block,
        "groups": [{"sliding_window": g.sliding_window, "num_layers": len(g.layer_indices),
                    "peak_blocks": n, "peak_tokens": n * bs, "last_step_blocks": last,
                    "bytes_per_layer": n * bytes_per_layer_block,
                    "bytes": n * bytes_per_layer_block * len(g.layer_indices),
                    **({"bound_blocks": bound, "bound_bytes_per_layer": bound * bytes_per_layer_block,
                        "within_bound": n <= bound} if g.sliding_window is not None else {})}
                   for g, n, last in zip(groups, peak_group, last_group)],
    }
    del llm, engine, kv, runner
    gc.collect()
    return result


def _memory_line(name: str, mine: dict, peer: dict, args: argparse.Namespace) -> str:
    mib = 2**20
    windowed = [g for g in mine["groups"] if g["sliding_window"] is not None]
    bound = windowed[0]["bound_blocks"] if windowed else 0
    held = max((g["peak_blocks"] for g in windowed), default=0)
    verdict = "PASS" if windowed and all(g["within_bound"] for g in windowed) else "FAIL"
    return (f"sliding_window memory {name}: {args.prompt_len} + {args.decode_tokens} tokens, window "
            f"{args.window}, chunk {args.max_num_batched_tokens}, block {args.block_size}: peak KV "
            f"held {mine['kv_bytes'] / mib:.2f} MiB vs {peer['kv_bytes'] / mib:.2f} MiB full attention "
            f"({mine['kv_bytes'] / peer['kv_bytes']:.3f}x); a window layer holds {held} blocks = "
            f"{held * args.block_size} tokens = {held * mine['bytes_per_layer_block'] / mib:.3f} MiB "
            f"(bound window + chunk + one block: {bound} blocks = {bound * args.block_size} tokens) "
            f"{verdict}")


# -- 2. decode time ----------------------------------------------------------------------------
_WARMUP_STEPS = 2


def _decode_step_times(llm, rid: str, prompt: list[int], num_steps: int) -> list[float]:
    """Seconds of each timed decode step of one request (after prefill and the warm-up)."""
    engine = llm.llm_engine
    engine.add_request(rid, {"prompt_token_ids": prompt}, _params(1 + _WARMUP_STEPS + num_steps))
    num_out, times = 0, []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        before, num_out = num_out, max([len(o.outputs[0].token_ids) for o in outs], default=num_out)
        if before > _WARMUP_STEPS:  # a decode step (the first token ends the prefill)
            times.append(dt)
    return times


def measure_decode(folders: dict[str, Path], args: argparse.Namespace) -> dict:
    from pagedllm import LLM

    max_len = max(args.contexts) + 1 + _WARMUP_STEPS + args.timed_steps
    llms = {name: LLM(str(folder), **engine_args(
        args, max_model_len=max_len, enable_prefix_caching=False, block_size=args.block_size,
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=1,
        enforce_eager=args.enforce_eager)) for name, folder in folders.items()}
    for name, llm in llms.items():  # first steps of a fresh engine are slow: one request first
        _decode_step_times(llm, "warmup", _prompt(args.contexts[0], seed=1), 2)
    ms: dict[str, dict[int, float]] = {name: {} for name in llms}
    for ctx in args.contexts:
        prompt = _prompt(ctx, seed=ctx)
        for name, llm in llms.items():
            times = _decode_step_times(llm, f"ctx{ctx}", prompt, args.timed_steps)
            ms[name][ctx] = statistics.median(times) * 1e3
            log(f"  {name} at {ctx}: {ms[name][ctx]:.2f} ms per decode step")
    del llms
    gc.collect()
    return ms


def _decode_table(ms: dict[str, dict[int, float]], args: argparse.Namespace) -> list[str]:
    first, last = args.contexts[0], args.contexts[-1]
    lines = [f"sliding_window decode step (ms, median of {args.timed_steps}; window {args.window}, "
             f"{'eager' if args.enforce_eager else 'compiled'}): "
             + "  ".join(f"{c:>7}" for c in args.contexts) + f"  {last}/{first}"]
    for name, row in ms.items():
        lines.append(f"  {name:<14}" + "  ".join(f"{row[c]:7.2f}" for c in args.contexts)
                     + f"  {row[last] / row[first]:.2f}x")
    return lines


# -- main --------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="pagedllm bench sliding_window", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--window", type=int, default=1024, help="the sliding window W (tokens)")
    parser.add_argument("--prompt-len", type=int, default=8192, help="the memory request's prompt")
    parser.add_argument("--decode-tokens", type=int, default=4, help="its generated tokens")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512, help="the chunk")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--shape", default="small", choices=sorted(SHAPES), help="layer sizes")
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 4096, 8192],
                        help="context lengths of the decode timing")
    parser.add_argument("--timed-steps", type=int, default=16, help="decode steps timed per context")
    parser.add_argument("--enforce-eager", action="store_true", help="time without torch.compile")
    parser.add_argument("--skip", nargs="+", default=[], choices=["memory", "timing"],
                        help="parts to leave out")
    parser.add_argument("--model-dir", help="where the models are built (default: ~/.cache/pagedllm)")
    add_engine_args(parser)
    parser.add_argument("--json", metavar="FILE", help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    for flag in ("window", "prompt_len", "decode_tokens", "max_num_batched_tokens", "block_size",
                 "timed_steps"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1")
    if min(args.contexts) < 1:
        parser.error("--contexts must be >= 1")
    if args.prompt_len <= args.window:
        parser.error(f"--prompt-len ({args.prompt_len}) must exceed --window ({args.window}): "
                     f"a request inside the window holds all of its KV")
    args.contexts = sorted(set(args.contexts))

    root = Path(args.model_dir) if args.model_dir else CACHE_DIR
    max_len = max(args.prompt_len + args.decode_tokens,
                  max(args.contexts) + 1 + _WARMUP_STEPS + args.timed_steps)
    # Rounded up, so other lengths reuse the same models.
    max_len = max(16384, cdiv(max_len, 4096) * 4096)
    folders = {name: build_window_model(name, model_spec(name, args.shape, args.window, max_len), root)
               for name in MODELS}
    result: dict = {"benchmark": "sliding_window", "window": args.window, "shape": args.shape,
                    "prompt_len": args.prompt_len, "decode_tokens": args.decode_tokens,
                    "max_num_batched_tokens": args.max_num_batched_tokens,
                    "block_size": args.block_size}
    if "memory" not in args.skip:
        memory = {name: measure_memory(folders[name], args) for name in MODELS}
        result["memory"] = memory
        for name, peer in PEERS.items():
            print(_memory_line(name, memory[name], memory[peer], args), flush=True)
    if "timing" not in args.skip:
        ms = measure_decode({f"mistral w{args.window}": folders["mistral"],
                             "mistral full": folders["mistral-full"]}, args)
        result["decode_ms"] = {name: {str(c): t for c, t in row.items()} for name, row in ms.items()}
        result["contexts"] = args.contexts
        result["timed_steps"] = args.timed_steps
        result["enforce_eager"] = args.enforce_eager
        for line in _decode_table(ms, args):
            print(line, flush=True)
    write_json(args.json, result)


if __name__ == "__main__":
    main(sys.argv[1:])

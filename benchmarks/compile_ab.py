"""Compiled vs eager pagedllm, interleaved step by step in one process: is torch.compile worth it?

Two engines on the same model and workload, one with ``enforce_eager=False`` (torch.compile,
runner/compile.py), one with ``enforce_eager=True``; each loads and warms up once (the compile
is reported, not timed). Both get the same requests (greedy, ignore_eos), then the engines
alternate single ``step()`` calls (ABBA order), each timed, until both finish: on a shared VM
whose speed drifts by 2-3x within minutes, only such fine interleaving compares like with like.
Prints the median per-step ratio compiled / eager for decode-only steps and for steps with a
prefill, each engine's total step time, and whether the greedy ids agree.

    python -m benchmarks.compile_ab [--model-config qwen3-58m | --model DIR] [--workload cpu]
                                    [--num-requests N] [--max-tokens N]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

from benchmarks.common import (
    add_model_args,
    add_workload_args,
    engine_args,
    log,
    resolve_model,
    resolve_workload,
    write_json,
)


def main(argv: list[str] | None = None) -> dict:
    from pagedllm import LLM, SamplingParams

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser)
    add_workload_args(parser)
    parser.add_argument("--max-tokens", type=int, default=None, help="cap every output length")
    args = parser.parse_args(argv)
    model = resolve_model(args)
    workload = resolve_workload(args, model)
    lens = [min(o, args.max_tokens or o) for o in workload.output_lens]
    engines = {}
    for name, eager in (("compiled", False), ("eager", True)):
        t0 = time.perf_counter()
        llm = LLM(model, **engine_args(args, enforce_eager=eager))
        llm.generate(workload.as_prompts()[:2], SamplingParams(temperature=0.0, max_tokens=4),
                     use_tqdm=False)
        llm.reset_prefix_cache()
        log(f"{name}: loaded and warmed up in {time.perf_counter() - t0:.1f} s")
        engines[name] = llm.llm_engine
        for i, (prompt, n) in enumerate(zip(workload.prompts, lens)):
            engines[name].add_request(str(i), {"prompt_token_ids": prompt},
                                      SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    steps: dict[str, list[tuple[float, bool]]] = {n: [] for n in engines}  # (seconds, prefill?)
    ids: dict[str, dict[str, list[int]]] = {n: {} for n in engines}
    k = 0
    while any(e.has_unfinished_requests() for e in engines.values()):
        for name in (list(engines) if k % 2 == 0 else list(engines)[::-1]):
            engine = engines[name]
            if not engine.has_unfinished_requests():
                continue
            prefill = any(r.num_computed_tokens < r.num_prompt_tokens
                          for r in engine.scheduler.running + list(engine.scheduler.waiting))
            t0 = time.perf_counter()
            outs = engine.step()
            steps[name].append((time.perf_counter() - t0, prefill))
            for o in outs:
                if o.finished:
                    ids[name][o.request_id] = list(o.outputs[0].token_ids)
        k += 1
    result = {"model": model, "workload": workload.name, "num_requests": workload.num_requests}
    for kind, is_prefill in (("decode", False), ("prefill", True)):
        pairs = [(c, e) for (c, pc), (e, pe) in zip(steps["compiled"], steps["eager"])
                 if pc == pe == is_prefill]
        if pairs:
            result[f"{kind}_steps"] = len(pairs)
            result[f"{kind}_ratio_median"] = statistics.median(e / c for c, e in pairs)
            result[f"{kind}_ms_median"] = {n: statistics.median(x[i] for x in pairs) * 1e3
                                           for i, n in enumerate(("compiled", "eager"))}
    result["total_s"] = {n: sum(t for t, _ in s) for n, s in steps.items()}
    result["greedy_ids_agree"] = sum(ids["compiled"][r] == ids["eager"][r] for r in ids["eager"])
    print("speed-up compiled over eager, median of paired steps: decode "
          f"{result.get('decode_ratio_median', float('nan')):.3f}x ({result.get('decode_steps', 0)} steps, "
          f"{result.get('decode_ms_median', {}).get('compiled', 0):.1f} vs "
          f"{result.get('decode_ms_median', {}).get('eager', 0):.1f} ms), prefill "
          f"{result.get('prefill_ratio_median', float('nan')):.3f}x ({result.get('prefill_steps', 0)} steps); "
          f"total {result['total_s']['compiled']:.1f} vs {result['total_s']['eager']:.1f} s; "
          f"greedy ids agree {result['greedy_ids_agree']}/{workload.num_requests}")
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])

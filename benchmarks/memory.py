"""KV cache memory: how much of the allocated cache holds real tokens, and the batch a budget fits.

1. Waste. The throughput workload (default "cpu") is stepped through ``llm.llm_engine`` with the
   prefix cache off and ample KV memory. After every step:
     slots allocated = kv_cache_usage_perc x num_gpu_blocks x block_size
     tokens held     = prompt tokens computed (``prompt_tokens_computed`` minus the prompts of
                       finished requests) + for each unfinished request, its generated tokens - 1
                       (the newest sampled token has no K/V yet)
   Reported at the busiest step (most slots allocated): waste = 1 - held / allocated, against a
   contiguous cache that reserves max_model_len slots per running request. vLLM's paper reports
   under 4% waste for paged attention.
2. Batch size. The same workload with a fixed KV budget (``--kv-budget-mib``): the peak and the
   mean number of running requests over the steps that had requests waiting (the batch the budget
   sustains under load), against a contiguous cache: budget // (max_model_len x bytes per token).
   Memory truth, in the same run: every KV byte the runner allocated (its cache tensors, and
   every other tensor alive after the run besides the weights: a second copy of the KV would show
   there) against the budget, and the process's peak RSS while the workload ran (Linux).

    python -m benchmarks.memory [--workload cpu] [--kv-budget-mib 64] [--max-model-len 2048]
"""
from __future__ import annotations

import argparse
import gc
import sys
import warnings

from benchmarks.common import (
    Workload,
    add_model_args,
    add_workload_args,
    engine_args,
    log,
    model_stats,
    reset_peak_rss,
    resolve_model,
    resolve_workload,
    rss_bytes,
    write_json,
)
from pagedllm.config import KV_CACHE_DTYPES


def _add_requests(llm, workload: Workload) -> None:
    from pagedllm import SamplingParams
    from pagedllm.sampling_params import RequestOutputKind

    for i, (prompt, out_len) in enumerate(zip(workload.prompts, workload.output_lens)):
        params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True,
                                output_kind=RequestOutputKind.CUMULATIVE, detokenize=False)
        llm.llm_engine.add_request(str(i), {"prompt_token_ids": prompt}, params)


def measure_waste(model: str, workload: Workload, llm_kwargs: dict, block_size: int,
                  max_model_len: int) -> dict:
    from pagedllm import LLM

    llm = LLM(model, **{**llm_kwargs, "enable_prefix_caching": False, "block_size": block_size,
                        "max_model_len": max_model_len})
    _add_requests(llm, workload)
    num_generated: dict[str, int] = {}  # unfinished requests that have produced tokens
    finished_prompt_tokens = 0
    busiest = {"slots": -1}
    sum_held = sum_slots = 0
    steps = 0
    while llm.llm_engine.has_unfinished_requests():
        for out in llm.llm_engine.step():
            if out.finished:
                num_generated.pop(out.request_id, None)
                finished_prompt_tokens += len(out.prompt_token_ids)
            else:
                num_generated[out.request_id] = len(out.outputs[0].token_ids)
        m = llm.get_metrics()
        steps += 1
        if m["pagedllm:num_preemptions"]:
            # A preempted request frees its blocks but its prompt stays counted as computed.
            raise SystemExit("memory: a request was preempted, so tokens held cannot be counted; "
                             "give the engine more KV memory (--engine-arg kv_cache_memory_bytes=N)")
        slots = round(m["pagedllm:kv_cache_usage_perc"] * m["pagedllm:num_gpu_blocks"]) * block_size
        held = (m["pagedllm:prompt_tokens_computed"] - finished_prompt_tokens
                + sum(max(g - 1, 0) for g in num_generated.values()))
        assert held <= slots, f"tokens held ({held}) exceed slots allocated ({slots})"
        sum_held += held
        sum_slots += slots
        if slots > busiest["slots"]:
            running = int(m["pagedllm:num_requests_running"])
            busiest = {"step": steps, "slots": slots, "tokens": held, "running": running,
                       "waste": 1 - held / slots if slots else 0.0,
                       "contiguous_slots": running * max_model_len,
                       "contiguous_waste": 1 - held / (running * max_model_len) if running else 0.0}
    del llm
    gc.collect()
    return {"busiest_step": busiest, "steps": steps,
            "mean_waste": 1 - sum_held / sum_slots if sum_slots else 0.0}


def _kv_bytes_allocated(llm) -> dict:
    """The runner's KV cache bytes, its weights' bytes (parameters, buffers, and the layers held
    as packed panels or quantized: one copy each), and the bytes of every other live tensor
    (None with an out-of-process executor)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensor

    runner = getattr(llm.llm_engine.executor, "runner", None)
    if runner is None or not hasattr(runner, "kv_caches"):
        return {"kv_cache_bytes": None, "weight_bytes": None, "weight_formats": None,
                "other_tensor_bytes": None}
    kv = {c.untyped_storage().data_ptr(): c.untyped_storage().nbytes() for c in runner.kv_caches}
    weights = list(runner.model.state_dict().values())
    # the layers held in a weight format (panels, bf16/fp16, quantized: weight_plan/weight_table.py)
    from pagedllm.weight_plan.weight_table import held_tensors

    weights += held_tensors(runner.model)
    weight_storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in weights}
    seen = set(kv) | set(weight_storages)
    gc.collect()
    with warnings.catch_warnings():  # isinstance() pokes deprecated torch module attributes
        warnings.simplefilter("ignore")
        # type(), not isinstance(): a dead weakref.proxy among the objects raises on __class__.
        tensors = [o for o in gc.get_objects() if issubclass(type(o), torch.Tensor)]
    other = 0
    for t in tensors:
        # Opaque (mkldnn) tensors have no storage to read; fake tensors (left by an earlier
        # torch.compile in the process) hold no memory.
        if t.is_mkldnn or t.is_meta or isinstance(t, FakeTensor):
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            other += storage.nbytes()
    formats: dict[str, int] = {}  # the runner's table: bytes per weight format
    for row in runner.weight_table:
        formats[row.format] = formats.get(row.format, 0) + row.nbytes
    return {"kv_cache_bytes": sum(kv.values()), "weight_bytes": sum(weight_storages.values()),
            "weight_formats": formats, "other_tensor_bytes": other}


def measure_batch(model: str, workload: Workload, llm_kwargs: dict, block_size: int,
                  max_model_len: int, budget_bytes: int) -> dict:
    from pagedllm import LLM

    llm_kwargs = {k: v for k, v in llm_kwargs.items() if k != "num_gpu_blocks_override"}
    llm = LLM(model, **{**llm_kwargs, "enable_prefix_caching": False, "block_size": block_size,
                        "max_model_len": max_model_len, "kv_cache_memory_bytes": budget_bytes})
    num_blocks = int(llm.get_metrics()["pagedllm:num_gpu_blocks"])
    _add_requests(llm, workload)
    reset_peak_rss()
    rss_at_start = rss_bytes("VmRSS")
    peak = 0
    loaded: list[int] = []  # running counts of the steps with requests still waiting
    while llm.llm_engine.has_unfinished_requests():
        llm.llm_engine.step()
        m = llm.get_metrics()
        running = int(m["pagedllm:num_requests_running"])
        peak = max(peak, running)
        if m["pagedllm:num_requests_waiting"] > 0:
            loaded.append(running)
    preemptions = llm.get_metrics()["pagedllm:num_preemptions"]
    peak_rss = rss_bytes()
    held = _kv_bytes_allocated(llm)
    del llm
    gc.collect()
    return {"num_gpu_blocks": num_blocks, "peak_running": peak,
            "mean_running_under_load": sum(loaded) / len(loaded) if loaded else float(peak),
            "steps_under_load": len(loaded), "num_preemptions": preemptions,
            "rss_at_start_bytes": rss_at_start, "peak_rss_bytes": peak_rss, **held}


def _memory_truth(batch: dict, budget: int) -> str:
    mib = 2**20
    if batch["kv_cache_bytes"] is None:
        return f"peak RSS {batch['peak_rss_bytes'] / mib:.0f} MiB"
    formats = ", ".join(f"{fmt} {n / mib:.1f}" for fmt, n in batch["weight_formats"].items())
    return (f"weights {batch['weight_bytes'] / mib:.1f} MiB ({formats}); "
            f"KV allocated {batch['kv_cache_bytes'] / mib:.2f} MiB of the {budget / mib:.2f} MiB "
            f"budget ({batch['kv_cache_bytes'] / budget:.1%}), other live tensors "
            f"{batch['other_tensor_bytes'] / mib:.2f} MiB; peak RSS {batch['peak_rss_bytes'] / mib:.0f} "
            f"MiB during the workload ({batch['rss_at_start_bytes'] / mib:.0f} MiB at its start)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="pagedllm bench memory", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser)
    add_workload_args(parser)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=2048,
                        help="what a contiguous cache reserves per request")
    parser.add_argument("--kv-budget-mib", type=float, default=64.0, help="KV budget of part 2")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                        help="the engine's KV cache dtype (auto: the model's)")
    args = parser.parse_args(argv)

    model = resolve_model(args)
    stats = model_stats(model)
    workload = resolve_workload(args, model)
    kwargs = engine_args(args, kv_cache_dtype=args.kv_cache_dtype)
    elem = 2 if args.dtype in ("bfloat16", "float16", "half", "bf16", "fp16") else 4
    if args.kv_cache_dtype != "auto":  # narrower than the model's (the engine refuses wider)
        elem = 1 if args.kv_cache_dtype.startswith("fp8") else 2
    bytes_per_token = stats.kv_bytes_per_token(elem)
    budget = int(args.kv_budget_mib * 2**20)
    log(f"memory: workload {workload.name} ({workload.num_requests} requests), block_size "
        f"{args.block_size}, max_model_len {args.max_model_len}, KV dtype {args.kv_cache_dtype}, "
        f"{bytes_per_token} KV bytes/token")

    waste = measure_waste(model, workload, kwargs, args.block_size, args.max_model_len)
    batch = measure_batch(model, workload, kwargs, args.block_size, args.max_model_len, budget)
    contiguous_batch = budget // (args.max_model_len * bytes_per_token)
    b = waste["busiest_step"]
    result = {"benchmark": "memory", "model": model, "workload": workload.name,
              "num_requests": workload.num_requests, "block_size": args.block_size,
              "max_model_len": args.max_model_len, "kv_bytes_per_token": bytes_per_token,
              "kv_cache_dtype": args.kv_cache_dtype,
              "kv_budget_tokens": batch["num_gpu_blocks"] * args.block_size,
              "waste": waste, "kv_budget_bytes": budget, "paged_batch": batch,
              "contiguous_batch": contiguous_batch,
              "batch_ratio": (batch["mean_running_under_load"] / contiguous_batch
                              if contiguous_batch else float("inf"))}
    print(f"memory {workload.name}: busiest step holds {b['tokens']} tokens in {b['slots']} slots, "
          f"waste {b['waste']:.1%} (mean {waste['mean_waste']:.1%}) vs {b['contiguous_waste']:.1%} "
          f"contiguous at max_model_len {args.max_model_len} | {args.kv_budget_mib:g} MiB KV "
          f"({args.kv_cache_dtype}: {result['kv_budget_tokens']} tokens): "
          f"{batch['mean_running_under_load']:.1f} running under load (peak {batch['peak_running']}, "
          f"{batch['num_preemptions']} preemptions) vs {contiguous_batch} contiguous "
          f"({result['batch_ratio']:.1f}x) | {_memory_truth(batch, budget)}", flush=True)
    write_json(args.json, result)


if __name__ == "__main__":
    main(sys.argv[1:])

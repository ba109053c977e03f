"""vLLM's V1 scheduler under the workloads of pagedllm's scheduler_overhead benchmark.

Run with the python of the vLLM venv (made by benchmarks/setup_vllm_cpu.sh); it imports vLLM and the
standard library only, never pagedllm. vLLM's ``Scheduler`` (vllm.v1.core.sched.scheduler) is built
directly, with no model and no KV tensors: a VllmConfig from EngineArgs (block_size 16, prefix
caching on, the model config read from a small local HF folder), a KVCacheConfig of the given number
of blocks with one full-attention group, and a StructuredOutputManager. A fake runner (not timed)
samples one token per request that finished its prefill this step: (last token * 31 + 7) % 32000.

Each step times ``schedule()`` and ``update_from_output()`` separately, like pagedllm's benchmark.
Prompts are hashed for the prefix cache when a vLLM Request is built (as vLLM's engine core does,
before add_request), which is outside the timed steps; ``request_create_s`` reports that time.
As vLLM's engine core does once it is built, the garbage collector's heap is frozen
(vllm.utils.gc_utils.freeze_gc_heap) after the scheduler is built and before requests arrive, so
collections do not rescan the objects of torch and vLLM's imports.

    .venv-vllm/bin/python benchmarks/vllm_scheduler_peer.py [--workloads decode-512,...]
        [--repeat R] [--steps 100] [--model DIR]      # prints a JSON list on stdout (one line)
    .venv-vllm/bin/python benchmarks/vllm_scheduler_peer.py --serve
        # prints {"ready": ...}, then reads one JSON workload spec per stdin line and answers each
        # with one JSON result line (used by scheduler_overhead.py --vllm)
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

VOCAB = 32000
BLOCK_SIZE = 16
MAX_MODEL_LEN = 16384
REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = REPO_ROOT.parent / "shared" / "models" / "stories260K" / "hf"
ENV_DEFAULTS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "4",
                "VLLM_CPU_OMP_THREADS_BIND": "0-1"}


def standard_spec(name: str, steps: int = 100) -> dict:
    """The workloads of benchmarks.scheduler_overhead (kept in step with it by hand)."""
    if name.startswith("decode-"):
        n = int(name.split("-", 1)[1])
        return {"workload": name, "kind": "decode", "num_seqs": n, "num_blocks": n * 48,
                "budget": 8192, "num_requests": n, "out_lo": 400, "out_hi": 400, "steps": steps}
    if name.startswith("lifecycle-"):
        n = int(name.split("-", 1)[1])
        return {"workload": name, "kind": "lifecycle", "num_seqs": 512, "num_blocks": 512 * 40,
                "budget": 8192, "num_requests": n, "out_lo": 64, "out_hi": 256}
    raise SystemExit(f"unknown workload {name!r} (decode-N or lifecycle-N)")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Peer:
    """Imports vLLM once; builds a fresh scheduler per run."""

    def __init__(self, model: str, hash_algo: str | None = None) -> None:
        for k, v in ENV_DEFAULTS.items():
            os.environ.setdefault(k, v)
        try:
            import vllm  # first, alone: without vLLM, fail before the slow torch import
        except ImportError as e:
            raise SystemExit(f"vLLM is not importable here ({e}): run this script with the python of "
                             "the vLLM venv (bash benchmarks/setup_vllm_cpu.sh makes it)") from e
        import torch
        from vllm.engine.arg_utils import EngineArgs
        from vllm.sampling_params import SamplingParams
        from vllm.utils.gc_utils import freeze_gc_heap
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import (
            get_request_block_hasher,
            init_none_hash,
            resolve_cache_hit_alignment_tokens,
            resolve_kv_cache_block_sizes,
        )
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.core.single_type_kv_cache_manager import (
            register_all_kvcache_specs,
        )
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
        )
        from vllm.v1.outputs import ModelRunnerOutput
        from vllm.v1.request import Request
        from vllm.v1.structured_output import StructuredOutputManager
        self.vllm_version = vllm.__version__
        self.model = str(Path(model).resolve())
        self.hash_algo = hash_algo
        self._torch = torch
        self._EngineArgs, self._SamplingParams = EngineArgs, SamplingParams
        self._get_hash_fn_by_name, self._init_none_hash = get_hash_fn_by_name, init_none_hash
        self._get_request_block_hasher = get_request_block_hasher
        self._resolve_alignment, self._resolve_sizes = (resolve_cache_hit_alignment_tokens,
                                                        resolve_kv_cache_block_sizes)
        self._Scheduler, self._register_specs = Scheduler, register_all_kvcache_specs
        self._FullAttentionSpec, self._KVCacheConfig = FullAttentionSpec, KVCacheConfig
        self._KVCacheGroupSpec, self._ModelRunnerOutput = KVCacheGroupSpec, ModelRunnerOutput
        self._Request, self._SOManager = Request, StructuredOutputManager
        self._freeze_gc_heap = freeze_gc_heap
        self._configs: dict[tuple[int, int, int], object] = {}
        self.config_notes: dict = {}

    def _vllm_config(self, num_seqs: int, num_blocks: int, budget: int):
        import copy

        key = (num_seqs, num_blocks, budget)
        if key not in self._configs:
            extra = {} if self.hash_algo is None else {"prefix_caching_hash_algo": self.hash_algo}
            # stories260K declares max_position_embeddings 512; raise it so max_model_len 16384
            # (pagedllm's setting) is accepted. Nothing runs the model, so it changes nothing else.
            args = self._EngineArgs(
                model=self.model, skip_tokenizer_init=True, dtype="float32", block_size=BLOCK_SIZE,
                enable_prefix_caching=True, max_num_seqs=num_seqs, max_num_batched_tokens=budget,
                max_model_len=MAX_MODEL_LEN, hf_overrides={"max_position_embeddings": MAX_MODEL_LEN},
                num_gpu_blocks_override=num_blocks, **extra)
            cfg = args.create_engine_config()
            cfg.cache_config.num_gpu_blocks = num_blocks
            sc, cc = cfg.scheduler_config, cfg.cache_config
            self.config_notes = {
                "vllm_version": self.vllm_version, "block_size": cc.block_size,
                "enable_prefix_caching": cc.enable_prefix_caching,
                "prefix_caching_hash_algo": cc.prefix_caching_hash_algo,
                "enable_chunked_prefill": sc.enable_chunked_prefill,
                "async_scheduling": sc.async_scheduling, "policy": str(sc.policy),
                "max_model_len": cfg.model_config.max_model_len}
            self._configs[key] = cfg
        # The scheduler may write into its config; each run gets its own copy.
        return copy.deepcopy(self._configs[key])

    def build(self, num_seqs: int, num_blocks: int, budget: int):
        gc.unfreeze()  # let the previous run's scheduler and requests be collected
        cfg = self._vllm_config(num_seqs, num_blocks, budget)
        self._register_specs(cfg)
        # One full-attention group; the spec's sizes only matter for byte counts nobody reads.
        spec = self._FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=8,
                                       dtype=self._torch.float32)
        group = self._KVCacheGroupSpec(["model.layers.0.attn"], spec)
        kv_config = self._KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[group])
        sched_block_size, hash_block_size = self._resolve_sizes(kv_config, cfg)
        kv_config.hash_block_size = hash_block_size
        kv_config.cache_hit_alignment_tokens = self._resolve_alignment(
            kv_config, cfg, sched_block_size, hash_block_size)
        sched = self._Scheduler(vllm_config=cfg, kv_cache_config=kv_config,
                                structured_output_manager=self._SOManager(cfg),
                                block_size=sched_block_size, hash_block_size=hash_block_size,
                                log_stats=False)
        hash_fn = self._get_hash_fn_by_name(cfg.cache_config.prefix_caching_hash_algo)
        self._init_none_hash(hash_fn)
        hasher = self._get_request_block_hasher(hash_block_size, hash_fn)
        self._freeze_gc_heap()
        return sched, hasher

    def make_requests(self, n: int, out_lo: int, out_hi: int, hasher) -> tuple[list, float]:
        """The same prompts and lengths as pagedllm's _make_requests (random.Random(0))."""
        rng = random.Random(0)
        specs = []
        for i in range(n):
            prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(32, 256))]
            specs.append((str(i), prompt, rng.randint(out_lo, out_hi)))
        t0 = time.perf_counter()
        reqs = [self._Request(request_id=rid, prompt_token_ids=prompt, pooling_params=None,
                              sampling_params=self._SamplingParams(temperature=0.0, max_tokens=mt,
                                                                   ignore_eos=True),
                              block_hasher=hasher)
                for rid, prompt, mt in specs]
        return reqs, time.perf_counter() - t0

    def fake_runner_output(self, sched, so):
        """One sampled token per scheduled request whose prefill is done (none for a partial one)."""
        req_ids = list(so.num_scheduled_tokens)
        sampled = []
        for rid in req_ids:
            req = sched.requests[rid]
            sampled.append([] if req.is_prefill_chunk else [(req.all_token_ids[-1] * 31 + 7) % VOCAB])
        return self._ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                       sampled_token_ids=sampled)

    def timed_step(self, sched) -> tuple[float, float, int]:
        t0 = time.perf_counter()
        so = sched.schedule()
        t1 = time.perf_counter()
        ro = self.fake_runner_output(sched, so)
        t2 = time.perf_counter()
        sched.update_from_output(so, ro)
        t3 = time.perf_counter()
        return t1 - t0, t3 - t2, len(so.num_scheduled_tokens)

    def run(self, spec: dict) -> dict:
        sched, hasher = self.build(spec["num_seqs"], spec["num_blocks"], spec["budget"])
        reqs, create_s = self.make_requests(spec["num_requests"], spec["out_lo"], spec["out_hi"], hasher)
        for r in reqs:
            sched.add_request(r)
        if spec["kind"] == "decode":
            result = self._steady_decode(sched, spec)
        else:
            result = self._lifecycle(sched, spec)
            short = [r.request_id for r in reqs if r.num_output_tokens != r.max_tokens]
            if short or sched.requests:
                raise RuntimeError(f"{spec['workload']}: requests {short[:5]} ended with the wrong "
                                   f"number of tokens ({len(sched.requests)} left in the scheduler)")
            result["output_tokens"] = sum(r.num_output_tokens for r in reqs)
        result["request_create_s"] = create_s
        result["engine"] = "vllm"
        return result

    def _steady_decode(self, sched, spec: dict) -> dict:
        n = spec["num_requests"]
        while (any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.requests.values())
               or sched.get_request_counts()[1]):
            so = sched.schedule()
            sched.update_from_output(so, self.fake_runner_output(sched, so))
        t_sched, t_update = [], []
        for _ in range(spec["steps"]):
            ts, tu, num_scheduled = self.timed_step(sched)
            if num_scheduled != n:
                raise RuntimeError(f"{spec['workload']}: a step scheduled {num_scheduled} of {n} requests")
            t_sched.append(ts)
            t_update.append(tu)
        s, u = statistics.median(t_sched) * 1e6, statistics.median(t_update) * 1e6
        return {"workload": spec["workload"], "running": n,
                "schedule_us_per_step": s, "update_us_per_step": u,
                "us_per_request_per_step": (s + u) / n,
                "schedule_us_per_request": s / n, "update_us_per_request": u / n}

    def _lifecycle(self, sched, spec: dict) -> dict:
        t_sched = t_update = 0.0
        steps = running_sum = 0
        start = time.perf_counter()
        while sched.has_unfinished_requests():
            ts, tu, num_scheduled = self.timed_step(sched)
            t_sched += ts
            t_update += tu
            steps += 1
            running_sum += num_scheduled
        wall = time.perf_counter() - start
        s, u = t_sched / steps * 1e6, t_update / steps * 1e6
        return {"workload": spec["workload"], "steps": steps, "mean_running": running_sum / steps,
                "schedule_us_per_step": s, "update_us_per_step": u,
                "us_per_request_per_step": (t_sched + t_update) * 1e6 / running_sum, "wall_s": wall}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(DEFAULT_MODEL),
                        help="HF folder for vLLM's model config (nothing is loaded from its weights)")
    parser.add_argument("--workloads", default="decode-512,decode-2048,lifecycle-2048",
                        help="comma-separated: decode-N and lifecycle-N")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--steps", type=int, default=100, help="timed steps of the decode workloads")
    parser.add_argument("--hash-algo", default=None,
                        help="vLLM's prefix_caching_hash_algo (default: vLLM's own default)")
    parser.add_argument("--serve", action="store_true",
                        help="answer JSON workload specs read from stdin, one per line")
    args = parser.parse_args(argv)

    # stdout carries only results: vLLM's logger (and anything else) writes to fd 1 by default, so
    # point fd 1 at stderr and keep a private handle on the real stdout.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    peer = Peer(args.model, args.hash_algo)
    if args.serve:
        out.write(json.dumps({"ready": True, "vllm_version": peer.vllm_version}) + "\n")
        out.flush()
        for line in sys.stdin:
            if not line.strip():
                continue
            result = peer.run(json.loads(line))
            result["config"] = peer.config_notes
            out.write(json.dumps(result) + "\n")
            out.flush()
        return
    results = []
    for rep in range(args.repeat):
        for name in args.workloads.split(","):
            spec = standard_spec(name.strip(), args.steps)
            log(f"vLLM scheduler: {spec['workload']} (repeat {rep + 1}/{args.repeat})")
            r = peer.run(spec)
            r["repeat"] = rep
            results.append(r)
            log(f"  {r['us_per_request_per_step']:.2f} us/req/step")
    for r in results:
        r["config"] = peer.config_notes
    out.write(json.dumps(results) + "\n")
    out.flush()


if __name__ == "__main__":
    main()

"""Structured outputs: the grammar mask's share of a step at 32 requests, and the same run free.

Workload (random.Random(0)): 32 requests, each a JSON schema of 2..4 bounded fields (a string
with maxLength, an integer range, an enum, a boolean), greedy, up to 64 tokens. Each step's mask
work is timed where it happens: the engine core's bitmask fill after schedule() and the matcher
advance after the update, and the runner's one masked_fill over the logits. One warm-up, then
the timed run; then the same prompts without constraints, for the step time's reference.
Prints one line: the mask's share of the structured run's wall time, its time per step, and
the ratio of the two runs' step times.

    python -m benchmarks.structured_output [--model DIR | --model-config tiny]
"""
from __future__ import annotations

import argparse
import random
import time
from collections import defaultdict
from pathlib import Path

DEMO = Path(__file__).resolve().parent.parent.parent / "shared" / "models" / "stories260K" / "hf"


def schemas(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    fields = [{"type": "string", "maxLength": 8}, {"type": "integer", "minimum": 0, "maximum": 999},
              {"enum": ["red", "green", "blue"]}, {"type": "boolean"}]
    out = []
    for _ in range(n):
        names = rng.sample(["id", "name", "kind", "ok", "size"], rng.randint(2, 4))
        props = {k: rng.choice(fields) for k in names}
        out.append({"type": "object", "properties": props, "required": names,
                    "additionalProperties": False})
    return out


def timed(owner: object, name: str, bucket: dict[str, float]) -> None:
    """Wrap ``owner.name`` so its time adds up in ``bucket[name]``."""
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            bucket[name] += time.perf_counter() - t0
    setattr(owner, name, wrapper)


def run(llm, prompts: list[str], structured: bool, bucket: dict[str, float]) -> tuple[float, int]:
    from pagedllm import SamplingParams, StructuredOutputsParams

    params = [SamplingParams(temperature=0.0, max_tokens=64, structured_outputs=StructuredOutputsParams(
        json=s, disable_any_whitespace=True) if structured else None) for s in schemas(len(prompts))]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up (grammars compile here too)
    llm.generate(prompts, params, use_tqdm=False)  # compile every grammar before timing
    bucket.clear()
    t0 = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    return elapsed, int(bucket.pop("steps", 0))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.structured_output", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(DEMO), help="a Hugging Face folder (default: the demo model)")
    parser.add_argument("--model-config", help="build a random benchmark model instead (e.g. tiny: 32k vocab)")
    parser.add_argument("--num-requests", type=int, default=32)
    args = parser.parse_args(argv)
    model = args.model
    if args.model_config:
        from benchmarks.common import build_model

        model = str(build_model(args.model_config))

    import pagedllm.runner.model_runner as model_runner
    from pagedllm import LLM
    from pagedllm.engine.engine_core import EngineCore
    from pagedllm.structured_output.manager import StructuredOutputManager

    bucket: dict[str, float] = defaultdict(float)
    timed(StructuredOutputManager, "grammar_bitmask", bucket)
    timed(StructuredOutputManager, "accept", bucket)
    timed(model_runner, "apply_grammar_bitmask", bucket)
    step = EngineCore.step

    def counting_step(self):
        bucket["steps"] += 1
        return step(self)
    EngineCore.step = counting_step

    llm = LLM(model, max_num_seqs=args.num_requests, seed=0)
    prompts = [f"Record {i}: " for i in range(args.num_requests)]
    free_s, free_steps = run(llm, prompts, False, bucket)
    so_s, so_steps = run(llm, prompts, True, bucket)
    mask_s = sum(bucket.values())
    print(f"structured_output: {args.num_requests} requests, {so_steps} steps; mask "
          f"{mask_s / so_s:.1%} of the run ({mask_s / max(so_steps, 1) * 1e3:.3f} ms/step: fill "
          f"{bucket['grammar_bitmask'] * 1e3:.0f} ms, advance {bucket['accept'] * 1e3:.0f} ms, apply "
          f"{bucket['apply_grammar_bitmask'] * 1e3:.0f} ms); step {so_s / max(so_steps, 1) * 1e3:.2f} ms "
          f"vs {free_s / max(free_steps, 1) * 1e3:.2f} ms unconstrained "
          f"({so_s / so_steps / (free_s / free_steps):.2f}x)")


if __name__ == "__main__":
    main()

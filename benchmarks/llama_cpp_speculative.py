"""llama.cpp's own speculative decoding, the peer of ``pagedllm bench speculative_draft
--llama-cpp``: llama.cpp's command-line tools (benchmarks/setup_llama_cpp_tools.sh) on one GGUF
pair, the target written in F32 by llama.cpp's converter and its Q4_0 draft made by
llama-quantize, so both engines read the very same two files.

Batch 1, greedy (``--temp 0 --top-k 1``: the cheapest greedy pick llama.cpp has), EOS ignored.
llama-speculative-simple (``--spec-type draft-simple``: the draft model, no n-gram speculator
before it) drafts up to k tokens, the draft's top token each (``--spec-draft-p-min 0``: no draft
stops early for low confidence; ``--spec-draft-n-min 0``: no short draft is thrown away),
verifies them in one target step, and prints its decode speed (every step after the prompt, the
first token's included) and n_drafted / n_accept. llama-bench ``-p 0 -n N -d P`` measures the
target alone the same way: N single-token steps after P tokens of context. Both tools come from
one build, so llama.cpp's own speed-up is free of any binding overhead. llama-tokenize gives the
prompt's ids as llama.cpp reads the text, which pagedllm is then given.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

from benchmarks.common import REPO_ROOT, log
from benchmarks.llama_cpp_convert import convert_to_gguf, converter_missing, converter_view

TOOLS_DIR = REPO_ROOT / ".venv-llama-cpp" / "bin"
TOOLS = ("llama-speculative-simple", "llama-quantize", "llama-bench", "llama-tokenize")
SETUP = "bash benchmarks/setup_llama_cpp_tools.sh"


def tools_missing(tools_dir: Path = TOOLS_DIR) -> str | None:
    """Why the llama.cpp peer cannot run here; None when it can."""
    absent = [t for t in TOOLS if not (tools_dir / t).is_file()]
    if absent:
        return f"llama.cpp's {' '.join(absent)} not in {tools_dir}: run {SETUP}"
    why = converter_missing()
    return f"{why} (or {SETUP}, which copies it too)" if why else None


def gguf_pair(folder: Path, threads: int, tools_dir: Path = TOOLS_DIR) -> tuple[Path, Path]:
    """The random model ``folder`` as an F32 GGUF (F32: the float32 weights pagedllm's target
    holds, bit for bit) and its Q4_0 draft (llama-quantize's default Q4_0 mix, what a user makes:
    the output head it keeps in a wider type, Q6_K or Q8_0); made
    once beside ``folder``, remade when the model's build stamp changes."""
    out = folder.with_name(folder.name + "-gguf")
    stamp = (folder / "pagedllm_bench.json").read_text()
    target, draft = out / "F32.gguf", out / "Q4_0.gguf"
    if (out / "pagedllm_bench.json").is_file() and (out / "pagedllm_bench.json").read_text() == stamp:
        return target, draft
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    log(f"converting {folder.name} to an F32 GGUF with llama.cpp's converter ...")
    convert_to_gguf(converter_view(folder, out / "hf"), target, "f32")
    shutil.rmtree(out / "hf")
    log("quantizing it to Q4_0 with llama-quantize ...")
    _run([str(tools_dir / "llama-quantize"), str(target), str(draft), "Q4_0", str(threads)], threads)
    (out / "pagedllm_bench.json").write_text(stamp)  # last: an interrupted build is redone
    return target, draft


def prompt_ids(target: Path, prompt: str, tools_dir: Path = TOOLS_DIR) -> list[int]:
    """``prompt`` as llama.cpp tokenizes it with the vocabulary in ``target`` (BOS as the file
    says), the ids pagedllm is given so that both engines start from the same tokens."""
    text = _run([str(tools_dir / "llama-tokenize"), "-m", str(target), "-p", prompt, "--ids",
                 "--log-disable"], 1, stderr=False)
    try:
        return [int(i) for i in json.loads(text.strip().splitlines()[-1])]
    except (ValueError, IndexError) as e:
        raise SystemExit(f"llama-tokenize printed no ids ({e}):\n{text[-2000:]}") from e


def speculative(target: Path, draft: Path, prompt: str, num_tokens: int, k: int, threads: int,
                tools_dir: Path = TOOLS_DIR) -> dict:
    """One greedy batch-1 run of llama-speculative-simple: decode tok/s, acceptance, tokens/step."""
    text = _run([str(tools_dir / "llama-speculative-simple"), "-m", str(target), "-md", str(draft),
                 "-p", prompt, "-n", str(num_tokens), "--ignore-eos", "--temp", "0", "--top-k", "1",
                 "--seed", "0", "-c", str(_context(num_tokens, k)), "-t", str(threads), "-tb", str(threads),
                 "--spec-type", "draft-simple", "--spec-draft-n-max", str(k), "--spec-draft-n-min", "0",
                 "--spec-draft-p-min", "0"],
                threads)
    speed = _last(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds, speed:\s+([\d.]+) t/s", text)
    n_predict, n_drafted, n_accept = (int(_last(rf"{name}\s*=\s*(\d+)", text)[0])
                                      for name in ("n_predict", "n_drafted", "n_accept"))
    # A step verifies one draft and yields its accepted tokens plus the target's own one.
    num_steps = max(n_predict - n_accept, 1)
    return {"tok_per_s": float(speed[2]), "num_tokens": n_predict, "decode_s": float(speed[1]),
            "acceptance": n_accept / max(n_drafted, 1), "tokens_per_step": n_predict / num_steps,
            "drafts_per_step": n_drafted / num_steps}


def target_alone(target: Path, num_tokens: int, depth: int, threads: int,
                 tools_dir: Path = TOOLS_DIR) -> float:
    """Batch-1 decode tok/s of the target alone: llama-bench, one repetition after its warm-up."""
    text = _run([str(tools_dir / "llama-bench"), "-m", str(target), "-p", "0", "-n", str(num_tokens),
                 "-d", str(depth), "-t", str(threads), "-r", "1", "-o", "json"], threads, stderr=False)
    try:
        return float(json.loads(text)[0]["avg_ts"])
    except (ValueError, LookupError) as e:
        raise SystemExit(f"llama-bench printed no result ({e}):\n{text[-2000:]}") from e


def _context(num_tokens: int, k: int) -> int:
    # the prompt, the tokens, a last draft past the end, some slack; a smaller KV cache than the
    # model's 4096 positions changes no step (llama.cpp attends to the used cells only)
    return num_tokens + k + 256


def _run(cmd: list[str], threads: int, stderr: bool = True) -> str:
    """The tool's output (stderr too unless told: llama.cpp logs its figures there)."""
    result = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS=str(threads)), text=True,
                            errors="replace", stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT if stderr else subprocess.PIPE)
    if result.returncode != 0:
        raise SystemExit(f"{Path(cmd[0]).name} failed ({result.returncode}):\n"
                         f"{(result.stdout + (result.stderr or ''))[-3000:]}")
    return result.stdout


def _last(pattern: str, text: str) -> tuple[str, ...]:
    """The last match's groups: the figures come after the generated text, which could hold anything."""
    found = re.findall(pattern, text)
    if not found:
        raise SystemExit(f"llama-speculative-simple printed no {pattern!r}:\n{text[-2000:]}")
    return found[-1] if isinstance(found[-1], tuple) else (found[-1],)

"""Test helpers: a paged step runner over the KV cache, random weights, the transformers reference.

A uniquely named module (not conftest.py) so ``from paged_helpers import ...`` cannot collide
with other test folders' conftest modules."""
from __future__ import annotations

import random
import shutil
import subprocess
import sysconfig
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from pagedllm.kernels import cpu_extension
from pagedllm.layers import bind_kv_caches, build_attention_metadata, kv_cache_layers, set_forward_context

REPO_ROOT = Path(__file__).resolve().parents[2]
STORIES_DIR = REPO_ROOT / ".." / "shared" / "models" / "stories260K"
SYNTHETIC_TOKENIZER_DIR = REPO_ROOT.parent / "shared" / "models" / "synthetic-tokenizer-32k"


class PagedRunner:
    """Drives a model step by step like the engine would: owns the KV caches, hands out blocks
    from a shuffled free list (so block tables are non-contiguous), tracks computed tokens."""

    def __init__(self, model: nn.Module, num_blocks: int = 96, block_size: int = 4,
                 seed: int = 0) -> None:
        self.model, self.block_size = model, block_size
        dtype = next(model.parameters()).dtype
        # A cache per layer, in the layer's own KV geometry (its spec).
        self.kv_caches = [torch.zeros(spec.shape(num_blocks, block_size), dtype=dtype)
                          for _, spec in kv_cache_layers(model, dtype)]
        bind_kv_caches(model, self.kv_caches)
        self.free_blocks = list(range(num_blocks))
        random.Random(seed).shuffle(self.free_blocks)
        self.block_tables: dict[str, list[int]] = {}
        self.num_computed: dict[str, int] = {}

    def share_prefix(self, req_id: str, src_id: str, num_blocks: int) -> None:
        """``req_id`` starts with ``src_id``'s first blocks as its cached prefix (a prefix-cache
        hit); the blocks may still be unwritten if both run in the same step."""
        self.block_tables[req_id] = self.block_tables[src_id][:num_blocks]
        self.num_computed[req_id] = num_blocks * self.block_size

    def step(self, batch: list[tuple[str, list[int]]]) -> dict[str, torch.Tensor]:
        """Run one flat step; ``batch`` = (request id, its new token ids). Returns each
        request's log-probs ``[len(new tokens), vocab]``."""
        for req_id, tokens in batch:
            table = self.block_tables.setdefault(req_id, [])
            needed = self.num_computed.setdefault(req_id, 0) + len(tokens)
            while len(table) * self.block_size < needed:
                table.append(self.free_blocks.pop())
        md = build_attention_metadata(
            [len(t) for _, t in batch], [self.num_computed[r] for r, _ in batch],
            [self.block_tables[r] for r, _ in batch], self.block_size, "cpu")
        input_ids = torch.tensor([tok for _, tokens in batch for tok in tokens])
        with torch.inference_mode(), set_forward_context(md):
            logits = self.model.compute_logits(self.model(input_ids, md.positions))
        out = {}
        for i, (req_id, tokens) in enumerate(batch):
            self.num_computed[req_id] += len(tokens)
            rows = logits[md.query_start_loc[i]:md.query_start_loc[i + 1]]
            out[req_id] = torch.log_softmax(rows, dim=-1)
        return out


def decode_steps(model: nn.Module, prompts: Sequence[list[int]], steps: int,
                 forced: Sequence[list[int]] | None = None) -> tuple[list[list[int]], list[torch.Tensor]]:
    """The prompts as one batch of decode steps: greedy ids (or ``forced``'s: a teacher-forced
    run comparing two paths on the same context), and each step's log probs [len(prompts),
    vocab] as float32."""
    runner = PagedRunner(model, num_blocks=96, block_size=4)
    ids = [list(p) for p in prompts]
    out = runner.step([(str(i), list(p)) for i, p in enumerate(prompts)])
    log_probs = []
    for t in range(steps):
        log_probs.append(torch.stack([out[str(i)][-1].float() for i in range(len(prompts))]))
        for i in range(len(prompts)):
            greedy = int(log_probs[-1][i].argmax())
            ids[i].append(greedy if forced is None else forced[i][len(prompts[i]) + t])
        out = runner.step([(str(i), [ids[i][-1]]) for i in range(len(prompts))])
    return ids, log_probs


def randomize_(model: nn.Module, seed: int = 0) -> None:
    """Weights large enough that the outputs are far from uniform (HF's init with std 0.02
    makes a near-constant model, which would hide mistakes under a 1e-4 tolerance); biases and
    norm weights random so they are checked too."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(torch.rand(param.shape, generator=gen) * 0.5 + 0.75)
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)


def hf_log_probs(hf_model: nn.Module, token_ids: list[int]) -> torch.Tensor:
    """transformers' full-sequence forward: ``[len, vocab]`` log-probs."""
    with torch.no_grad():
        logits = hf_model(input_ids=torch.tensor([token_ids])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def check_greedy_logprobs(hf_model: nn.Module, prompts: Sequence[list[int]], outputs,
                          atol: float = 1e-4) -> None:
    """Every sampled token of ``outputs`` (LLM.generate with temperature 0 and ``logprobs=0``)
    is transformers' argmax after the prompt and the tokens before it, with its log-prob."""
    for prompt, out in zip(prompts, outputs):
        ids = list(prompt)
        for token, entry in zip(out.outputs[0].token_ids, out.outputs[0].logprobs):
            row = hf_log_probs(hf_model, ids)[-1]
            assert token == int(row.argmax())
            assert abs(entry[token].logprob - float(row[token])) < atol
            ids.append(token)


def check_llm_greedy_with_prefix_hit(hf_model: nn.Module, folder: Path, last_prompt_len: int) -> None:
    """The whole engine on a checkpoint saved in ``folder`` (32k vocabulary; the synthetic
    tokenizer is copied in): prefills chunked by a 16-token budget, a prompt that reuses another's
    cached 16-token prefix (a prefix-cache hit), and every greedy continuation equal to
    transformers' generate. ``last_prompt_len``: the longest unrelated prompt."""
    from pagedllm import LLM, SamplingParams

    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(SYNTHETIC_TOKENIZER_DIR / name, folder / name)
    gen = torch.Generator().manual_seed(6)
    shared = torch.randint(3, 32000, (16,), generator=gen).tolist()
    prompts = [shared + torch.randint(3, 32000, (n,), generator=gen).tolist() for n in (5, 9)]
    prompts += [torch.randint(3, 32000, (n,), generator=gen).tolist() for n in (3, last_prompt_len)]
    llm = LLM(str(folder), device="cpu", dtype="float32", max_num_batched_tokens=16,
              block_size=8, enable_prefix_caching=True)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)  # caches the prefix
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], params, use_tqdm=False)
    metrics = llm.get_metrics()
    assert metrics["pagedllm:prefix_cache_hits"] >= 16, metrics
    for prompt, out in zip(prompts[1:], outputs):
        with torch.no_grad():
            want = hf_model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=6,
                                     min_new_tokens=6, pad_token_id=0)[0, len(prompt):].tolist()
        assert list(out.outputs[0].token_ids) == want


def check_isa_builds_compile(out_dir: Path, source: str = "paged_attention.cpp") -> None:
    """The x86-64-v3 and -v4 builds of a kernel source compile (an object file each in
    ``out_dir``, never loaded: this CPU may lack AVX-512)."""
    from torch.utils import cpp_extension

    includes = [arg for path in [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
                for arg in ("-isystem", path)]
    for isa in ("v3", "v4"):
        cmd = ["c++", "-std=c++17", "-fPIC", *includes, *cpu_extension._cflags(isa), "-c",
               str(cpu_extension.CSRC / source), "-o", str(out_dir / f"{isa}.o")]
        result = subprocess.run(cmd, capture_output=True, text=True)
        assert result.returncode == 0, result.stderr[-2000:]

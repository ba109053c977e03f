"""The demo model: paged greedy decoding, step by step through the KV cache, reproduces the
golden continuations (all cases batched: one prefill step, then one decode step per token)."""
from __future__ import annotations

import json

import pytest
import torch
from paged_helpers import STORIES_DIR

from pagedllm.checkpoint.loader import load_model
from pagedllm.layers import attention_layers

MODEL_DIR = STORIES_DIR / "hf"
GOLDEN = STORIES_DIR / "golden_greedy.json"

pytestmark = pytest.mark.skipif(not MODEL_DIR.is_dir(), reason=f"demo model not found at {MODEL_DIR}")


def test_paged_greedy_matches_golden(paged_runner):
    cases = json.loads(GOLDEN.read_text())["cases"]
    model, config = load_model(str(MODEL_DIR), torch.float32, torch.device("cpu"))
    assert (model.num_layers, model.vocab_size, model.max_position_embeddings) == (5, 512, 512)
    assert {(layer.num_kv_heads, layer.head_dim) for layer in attention_layers(model)} == {(4, 8)}
    runner = paged_runner(model, num_blocks=96, block_size=4)
    generated: dict[str, list[int]] = {str(i): [] for i in range(len(cases))}
    batch = [(str(i), case["prompt_ids"]) for i, case in enumerate(cases)]
    while batch:
        log_probs = runner.step(batch)
        batch = []
        for req_id, lp in log_probs.items():
            out = generated[req_id]
            out.append(int(lp[-1].argmax()))
            if len(out) < len(cases[int(req_id)]["greedy_ids"]):
                batch.append((req_id, [out[-1]]))
    for i, case in enumerate(cases):
        assert generated[str(i)] == case["greedy_ids"], f"case {i} ({case['prompt']!r})"

"""Paged model vs transformers on tiny random models (float32): logits of a mixed flat batch."""
from __future__ import annotations

import json

import pytest
import torch
from paged_helpers import PagedRunner, hf_log_probs, randomize_
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from pagedllm.checkpoint.loader import load_model
from pagedllm.layers import attention_layers

TOL = 1e-4
SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, max_position_embeddings=256)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}

CONFIGS = {
    "llama_gqa_untied": lambda: LlamaConfig(**SMALL, num_key_value_heads=2,
                                            tie_word_embeddings=False),
    "llama3_rope": lambda: LlamaConfig(**SMALL, num_key_value_heads=4, tie_word_embeddings=False,
                                       rope_parameters=LLAMA3_ROPE),
    "qwen2_bias": lambda: Qwen2Config(**SMALL, num_key_value_heads=2, tie_word_embeddings=False),
    "qwen3_qknorm_tied": lambda: Qwen3Config(**SMALL, num_key_value_heads=2, head_dim=32,
                                             tie_word_embeddings=True),
}


def make_hf_model(config, seed: int = 0):
    torch.manual_seed(seed)
    config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize_(model, seed)
    return model


def save(hf_model, path, **kwargs) -> str:
    hf_model.save_pretrained(path, safe_serialization=True, **kwargs)
    return str(path)


def max_diff(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return (ours - ref).abs().max().item()


def check_mixed_batch(model, hf_model, runner: PagedRunner) -> None:
    gen = torch.Generator().manual_seed(1)
    seqs = {name: torch.randint(0, model.vocab_size, (n,), generator=gen).tolist()
            for name, n in {"A": 13, "B": 13, "C": 10, "D": 18}.items()}
    ref = {name: hf_log_probs(hf_model, ids) for name, ids in seqs.items()}
    # Earlier steps fill the caches: B's first chunk, C's context, D's context in two chunks
    # (the second chunk attends to a cached prefix).
    steps = [
        [("B", (0, 8)), ("C", (0, 9)), ("D", (0, 10))],
        [("D", (10, 17))],
        # The mixed step: a full prefill, a chunk over a cached prefix, and two decodes.
        [("A", (0, 13)), ("B", (8, 13)), ("C", (9, 10)), ("D", (17, 18))],
    ]
    for step in steps:
        out = runner.step([(name, seqs[name][a:b]) for name, (a, b) in step])
        for name, (a, b) in step:
            diff = max_diff(out[name], ref[name][a:b])
            assert diff < TOL, f"request {name} positions {a}..{b - 1}: max diff {diff:.2e}"
    # The paging is really exercised: block tables are scattered, not 0, 1, 2, ...
    for table in runner.block_tables.values():
        assert table != list(range(table[0], table[0] + len(table)))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_mixed_flat_batch_matches_transformers(name, tmp_path):
    hf_model = make_hf_model(CONFIGS[name]())
    model, config = load_model(save(hf_model, tmp_path), torch.float32, torch.device("cpu"))
    assert config["architectures"] == hf_model.config.architectures
    assert (model.num_layers, model.vocab_size) == (2, 96)
    assert {layer.num_kv_heads for layer in attention_layers(model)} == {
        hf_model.config.num_key_value_heads}
    check_mixed_batch(model, hf_model, PagedRunner(model, block_size=4))


def test_tied_and_untied_lm_head(tmp_path):
    tied, _ = load_model(save(make_hf_model(CONFIGS["qwen3_qknorm_tied"]()), tmp_path / "t"),
                         torch.float32, torch.device("cpu"))
    untied, _ = load_model(save(make_hf_model(CONFIGS["llama_gqa_untied"]()), tmp_path / "u"),
                           torch.float32, torch.device("cpu"))
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight


def test_sharded_checkpoint(tmp_path):
    hf_model = make_hf_model(CONFIGS["llama_gqa_untied"]())
    path = save(hf_model, tmp_path, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    model, _ = load_model(path, torch.float32, torch.device("cpu"))
    check_mixed_batch(model, hf_model, PagedRunner(model, block_size=4, seed=3))


def test_transformers4_rope_scaling_spelling(tmp_path):
    """A config written by transformers 4.x (rope_theta + rope_scaling) loads the same model."""
    hf_model = make_hf_model(CONFIGS["llama3_rope"]())
    path = save(hf_model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    params = config.pop("rope_parameters")
    config["rope_theta"] = params.pop("rope_theta")
    config["rope_scaling"] = params
    (tmp_path / "config.json").write_text(json.dumps(config))
    model, _ = load_model(path, torch.float32, torch.device("cpu"))
    check_mixed_batch(model, hf_model, PagedRunner(model, block_size=4))


def test_shared_prefix_blocks_written_in_the_same_step(tmp_path):
    """Identical prompts in one step share blocks: E writes them, F (a 2-token chunk) and G
    (a decode) read them in the same layer pass, which only works if every layer writes the
    step's K/V before it attends."""
    hf_model = make_hf_model(CONFIGS["llama_gqa_untied"]())
    model, _ = load_model(save(hf_model, tmp_path), torch.float32, torch.device("cpu"))
    runner = PagedRunner(model, block_size=4)
    prompt = torch.randint(0, 96, (10,), generator=torch.Generator().manual_seed(2)).tolist()
    ref = hf_log_probs(hf_model, prompt)
    runner.block_tables["E"] = [runner.free_blocks.pop() for _ in range(3)]
    runner.share_prefix("F", "E", 2)
    runner.share_prefix("G", "E", 2)
    out = runner.step([("E", prompt), ("F", prompt[8:]), ("G", prompt[8:9])])
    assert max_diff(out["E"], ref) < TOL
    assert max_diff(out["F"], ref[8:]) < TOL
    assert max_diff(out["G"], ref[8:9]) < TOL


def test_forward_without_context_is_one_causal_sequence(tmp_path):
    hf_model = make_hf_model(CONFIGS["qwen2_bias"]())
    model, _ = load_model(save(hf_model, tmp_path), torch.float32, torch.device("cpu"))
    ids = list(range(3, 15))
    with torch.inference_mode():
        logits = model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids))))
    assert logits.dtype == torch.float32
    assert max_diff(torch.log_softmax(logits, -1), hf_log_probs(hf_model, ids)) < TOL

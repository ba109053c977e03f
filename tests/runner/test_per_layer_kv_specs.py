"""A model whose attention layers differ in KV heads and head size (issue 54): the runner sizes
and groups the KV cache from each layer's spec (layers/attention/kv_cache_spec.py,
runner/kv_cache_groups.py), and the engine's greedy tokens and logprobs, with chunked prefill
and a prefix-cache hit, equal the same model's full causal attention over each whole sequence
without any cache.

The family is a Llama whose config lists each layer's (KV heads, head size, window): the
decoder builds layers from per-layer specs, so it differs from Llama in its layer specs only.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from pagedllm import LLM, SamplingParams
from pagedllm.checkpoint.loader import load_model
from pagedllm.layers import attention_layers
from pagedllm.models import registry
from pagedllm.models.llama import LlamaForCausalLM

TOKENIZER = Path(__file__).resolve().parents[2].parent / "shared" / "models" / "synthetic-tokenizer-32k"
ARCH = "PerLayerKVLlamaForCausalLM"
HIDDEN, HEADS, INTERMEDIATE, VOCAB = 32, 4, 64, 32000
BLOCK_SIZE, WINDOW = 4, 8
F32 = 4  # bytes per element of the float32 cache
# Per layer: (KV heads, head size, sliding window). "hybrid": layers 0/1 have 32 KV elements
# per token in different shapes, as do layers 2/3 with 16: one full and one window group whose
# layers share two tensors, each viewed in its layer's shape.
LAYOUTS = {
    "full": [(2, 16, None), (1, 16, None), (4, 8, None), (2, 8, None)],
    "hybrid": [(2, 16, None), (4, 8, WINDOW), (1, 16, None), (2, 8, WINDOW)],
}


class PerLayerKVLlama(LlamaForCausalLM):
    @classmethod
    def args_from_hf(cls, config: dict):
        args = super().args_from_hf(config)
        layers = tuple(replace(spec, num_kv_heads=kv_heads, head_dim=head_dim, sliding_window=window)
                       for spec, (kv_heads, head_dim, window) in zip(args.layers, config["layer_kv"],
                                                                     strict=True))
        return replace(args, layers=layers)


def _checkpoint(folder: Path, layout: list[tuple[int, int, int | None]]) -> Path:
    """A random checkpoint under transformers' Llama names, with the 32k tokenizer."""
    folder.mkdir()
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.1

    def norm() -> torch.Tensor:
        return torch.rand(HIDDEN, generator=gen) * 0.5 + 0.75

    tensors = {"model.embed_tokens.weight": rand(VOCAB, HIDDEN), "model.norm.weight": norm()}
    for i, (kv_heads, head_dim, _) in enumerate(layout):
        p = f"model.layers.{i}."
        tensors |= {
            p + "self_attn.q_proj.weight": rand(HEADS * head_dim, HIDDEN),
            p + "self_attn.k_proj.weight": rand(kv_heads * head_dim, HIDDEN),
            p + "self_attn.v_proj.weight": rand(kv_heads * head_dim, HIDDEN),
            p + "self_attn.o_proj.weight": rand(HIDDEN, HEADS * head_dim),
            p + "mlp.gate_proj.weight": rand(INTERMEDIATE, HIDDEN),
            p + "mlp.up_proj.weight": rand(INTERMEDIATE, HIDDEN),
            p + "mlp.down_proj.weight": rand(HIDDEN, INTERMEDIATE),
            p + "input_layernorm.weight": norm(), p + "post_attention_layernorm.weight": norm(),
        }
    save_file(tensors, str(folder / "model.safetensors"))
    config = {"architectures": [ARCH], "model_type": "llama", "vocab_size": VOCAB,
              "hidden_size": HIDDEN, "intermediate_size": INTERMEDIATE,
              "num_hidden_layers": len(layout), "num_attention_heads": HEADS,
              "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256,
              "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": True,
              "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
              "layer_kv": [list(spec) for spec in layout]}
    (folder / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER / name, folder / name)
    return folder


@pytest.fixture
def registered(monkeypatch):
    monkeypatch.setitem(registry._MODELS, ARCH, PerLayerKVLlama)


def _full_sequence_greedy(model, prompt: list[int], steps: int) -> list[tuple[int, float]]:
    """Greedy tokens and their logprobs from full causal attention over the whole sequence
    (no forward context: no paged cache)."""
    ids, out = list(prompt), []
    with torch.inference_mode():
        for _ in range(steps):
            hidden = model(torch.tensor(ids), torch.arange(len(ids)))
            row = torch.log_softmax(model.compute_logits(hidden[-1:])[0], dim=-1)
            token = int(row.argmax())
            out.append((token, float(row[token])))
            ids.append(token)
    return out


@pytest.mark.parametrize("backend", ["torch", "cpu_paged"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_per_layer_kv_geometry_serves_like_full_attention(registered, tmp_path, monkeypatch,
                                                          layout, backend):
    if backend == "cpu_paged":
        monkeypatch.setenv("PAGEDLLM_CPU_KERNELS", "pagedllm")  # the kernel, without timing it
    specs = LAYOUTS[layout]
    folder = _checkpoint(tmp_path / "model", specs)
    llm = LLM(str(folder), device="cpu", dtype="float32", max_num_batched_tokens=16,
              block_size=BLOCK_SIZE, enable_prefix_caching=True,
              attention_backend="auto" if backend == "cpu_paged" else "torch")
    runner = llm.llm_engine.executor.runner
    if backend == "cpu_paged" and runner.attn_backend.name != "cpu_paged":
        pytest.skip("the cpu_paged kernel is not available here")

    # Every layer's cache is in its own geometry.
    layers = attention_layers(runner.model)
    assert [(a.kv_cache.shape[3:], a.sliding_window) for a in layers] == [
        ((kv_heads, head_dim), window) for kv_heads, head_dim, window in specs]

    gen = torch.Generator().manual_seed(6)
    shared = torch.randint(3, VOCAB, (16,), generator=gen).tolist()
    prompts = [shared + torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (5, 9)]
    prompts += [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (3, 37)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)
    llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)  # caches the prefix
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], params, use_tqdm=False)
    assert llm.get_metrics()["pagedllm:prefix_cache_hits"] >= 16

    reference, _ = load_model(str(folder), torch.float32, torch.device("cpu"))
    for prompt, out in zip(prompts[1:], outputs):
        got = out.outputs[0]
        want = _full_sequence_greedy(reference, prompt, 6)
        assert list(got.token_ids) == [token for token, _ in want]
        for (token, logprob), entry in zip(want, got.logprobs):
            assert abs(entry[token].logprob - logprob) < 1e-4


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_bytes_per_block_is_the_sum_over_the_layers_owning_a_tensor(registered, tmp_path, layout):
    specs = LAYOUTS[layout]
    folder = _checkpoint(tmp_path / "model", specs)
    budget = 1 << 20
    llm = LLM(str(folder), device="cpu", dtype="float32", block_size=BLOCK_SIZE,
              attention_backend="torch", kv_cache_memory_bytes=budget)
    runner = llm.llm_engine.executor.runner
    page = [2 * BLOCK_SIZE * kv_heads * head_dim * F32 for kv_heads, head_dim, _ in specs]
    layers = attention_layers(runner.model)
    storages = [a.kv_cache.untyped_storage().data_ptr() for a in layers]
    if layout == "full":  # one group: every layer its own tensor
        owners = [0, 1, 2, 3]
        assert runner.get_kv_cache_groups() == [None] and len(set(storages)) == 4
    else:  # the full group's layer 0 / 2 own the tensors the window group's 1 / 3 view
        owners = [0, 2]
        assert runner.get_kv_cache_groups() == [None, WINDOW]
        assert storages[0] == storages[1] != storages[2] == storages[3]
        assert [a.kv_cache_group for a in layers] == [0, 1, 0, 1]
    per_block = sum(page[i] for i in owners)
    assert runner.bytes_per_block(BLOCK_SIZE) == per_block
    assert len(runner.kv_caches) == len(owners)
    assert [tuple(c.shape[3:]) for c in runner.kv_caches] == [specs[i][:2] for i in owners]
    assert llm.llm_engine.num_blocks == budget // per_block
    allocated = sum(c.numel() * c.element_size() for c in runner.kv_caches)
    assert budget - per_block < allocated <= budget

"""The sharded model itself, below the engine: two gloo ranks load a tiny Llama (untied head) and
a tiny Qwen3 (tied head) whose vocabulary (37) does not divide by 2, so the last rank's rows are
padding, and each rank's logits equal the unsharded model's within 1e-5; each rank's
parameters hold only its share (what the loader read through safetensors slices)."""
from __future__ import annotations

import pytest
import torch
from rank_processes import run_on_ranks

TOKENS = [1, 5, 36, 0, 17, 35, 2, 18, 9]  # ids on both sides of the split (19 rows per rank)


def _save(arch: str, folder) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    common = {"vocab_size": 37, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "max_position_embeddings": 64, "initializer_range": 0.2}
    config = (LlamaConfig(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                          **common) if arch == "llama" else
              Qwen3Config(num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                          tie_word_embeddings=True, **common))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)


def _logits(folder: str) -> tuple[torch.Tensor, int]:
    from pagedllm.checkpoint.loader import load_model

    model, _ = load_model(folder, torch.float32, torch.device("cpu"))
    with torch.inference_mode():
        hidden = model(torch.tensor(TOKENS), torch.arange(len(TOKENS)))
        logits = model.compute_logits(hidden)
    return logits, sum(p.numel() for p in model.parameters())


def _rank(rank: int, port: int, folders: list[str], queue) -> None:
    from pagedllm.distributed.launch import DistributedInit
    from pagedllm.distributed.parallel_state import destroy_distributed, init_distributed

    torch.set_num_threads(1)
    init_distributed(DistributedInit(rank, 2, "127.0.0.1", port, "cpu", rank, 2, timeout_s=60))
    # Plain lists: a tensor would travel as shared memory the exiting rank takes with it.
    queue.put((rank, [(logits.tolist(), n) for logits, n in (_logits(f) for f in folders)]))
    destroy_distributed()


@pytest.mark.slow  # two spawned ranks import torch and transformers
def test_two_gloo_ranks_compute_the_unsharded_logits(tmp_path):
    folders = []
    for arch in ("llama", "qwen3"):
        _save(arch, tmp_path / arch)
        folders.append(str(tmp_path / arch))
    want = [_logits(f) for f in folders]
    results = run_on_ranks(_rank, (folders,), timeout=120)
    for rank in (0, 1):
        for (got, got_params), (ref, ref_params) in zip(results[rank], want):
            got = torch.tensor(got)
            assert got.shape == ref.shape == (len(TOKENS), 37)
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
            assert got_params < 0.7 * ref_params  # a shard, not a replica (norms stay whole)

"""Builders shared by the tensor-parallel tests, importable by spawned workers (spawn hands them
this folder on sys.path): keep it light, no pytest fixtures, no torch at module level."""
from __future__ import annotations

import shutil
import time
from pathlib import Path

from pagedllm.runner.fake import FakeRunner

REPO_ROOT = Path(__file__).resolve().parents[2]
SHARED_MODELS = REPO_ROOT.parent / "shared" / "models"
DEMO_MODEL_DIR = SHARED_MODELS / "stories260K" / "hf"
SYNTHETIC_TOKENIZER_DIR = SHARED_MODELS / "synthetic-tokenizer-32k"
VOCAB = 1000


class SlowFakeRunner(FakeRunner):
    """A FakeRunner whose every step takes ``delay_s`` (a rank busy in a long step)."""

    def __init__(self, delay_s: float = 0.5) -> None:
        super().__init__(vocab_size=VOCAB)
        self.delay_s = delay_s

    def execute_model(self, so):
        time.sleep(self.delay_s)
        return super().execute_model(so)


def tiny_config(arch: str):
    """Small enough to start in seconds, with heads that split over two ranks both ways: the
    Llama splits its 2 KV heads (one per rank), the Qwen3 replicates its single KV head."""
    from transformers import LlamaConfig, Qwen3Config

    common = {"vocab_size": 32000, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
              "bos_token_id": 1, "eos_token_id": 2, "initializer_range": 0.1}
    if arch == "llama":
        return LlamaConfig(num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False,
                           attention_bias=True, rope_theta=10000.0, **common)
    if arch == "qwen3":
        return Qwen3Config(num_attention_heads=4, num_key_value_heads=1, head_dim=32,
                           tie_word_embeddings=True, rope_theta=1000000.0, **common)
    raise ValueError(arch)


def build_tiny_model(arch: str, folder: Path, seed: int = 0) -> Path:
    """A random float32 ``arch`` model (biases and norm weights randomised too, so a shard of
    them loaded wrong shows) saved with the synthetic 32k tokenizer beside it."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.2)
            elif "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(SYNTHETIC_TOKENIZER_DIR / name, folder / name)
    return folder

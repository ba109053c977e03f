"""Helpers of the LoRA tests: tiny random base models (Llama with GQA, Qwen2 with q/k/v
biases) and PEFT adapters on them; PEFT's model is the reference for every adapter."""
from __future__ import annotations

import shutil
from pathlib import Path

SYNTHETIC_TOKENIZER_DIR = Path(__file__).resolve().parents[2].parent / "shared" / "models" / \
    "synthetic-tokenizer-32k"
VOCAB = 512


def _config(arch: str):
    from transformers import LlamaConfig, Qwen2Config

    common = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "bos_token_id": 1,
              "eos_token_id": 2, "initializer_range": 0.1}
    if arch == "llama":
        return LlamaConfig(tie_word_embeddings=False, rope_theta=10000.0, **common)
    return Qwen2Config(tie_word_embeddings=True, rope_theta=1000000.0, **common)


def build_base(arch: str, folder: Path, seed: int = 0) -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_config(arch), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.2)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(SYNTHETIC_TOKENIZER_DIR / name, folder / name)
    return folder


def build_adapter(base: Path, folder: Path, r: int, alpha: float, target_modules: list[str],
                  use_rslora: bool = False, seed: int = 0, modules_to_save: list[str] | None = None):
    """A PEFT LoRA adapter with random A and B (and ``modules_to_save`` trained: the base's
    copy moved by noise) saved into ``folder``; returns PEFT's model."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=target_modules, lora_dropout=0.0,
                        use_rslora=use_rslora, task_type="CAUSAL_LM", modules_to_save=modules_to_save)
    peft_model = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3 / p.shape[-1] ** 0.5)
            elif "modules_to_save" in name:
                p.add_(torch.randn(p.shape, generator=gen) * 0.1)
    peft_model.save_pretrained(folder)
    return peft_model.eval()


# (rank, alpha, target modules, rslora): ranks 4-64, different targets, alpha/r and rslora.
ADAPTER_SPECS = [
    (4, 8, ["q_proj", "v_proj"], False),
    (8, 16, ["q_proj", "k_proj", "v_proj", "o_proj"], False),
    (16, 8, ["gate_proj", "up_proj", "down_proj"], False),
    (64, 32, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], True),
    (8, 32, ["up_proj", "o_proj"], True),
    (4, 4, ["k_proj", "down_proj"], False),
    (32, 64, ["v_proj", "gate_proj"], False),
    (16, 16, ["q_proj", "up_proj", "down_proj"], True),
]

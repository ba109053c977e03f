"""Tiny random pooling models saved by sentence-transformers into a test's folder: the same
folder is pagedllm's checkpoint and the reference's."""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch

WORDS = ["the", "cat", "dog", "sat", "on", "mat", "##s", "a", "red", "blue", "ran", "far"]


def write_bert_tokenizer(folder: Path):
    from transformers import BertTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + list("abcdefghijklmnopqrstuvwxyz") + WORDS
    (folder / "vocab.txt").write_text("\n".join(vocab))
    return BertTokenizerFast(str(folder / "vocab.txt")), len(vocab)


def bert_config(vocab_size: int, **overrides):
    from transformers import BertConfig

    return BertConfig(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=64, max_position_embeddings=64, **overrides)


def one_token_type(folder: Path) -> None:
    """XLM-R has one token type: the tokenizer must not send type ids."""
    path = folder / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    cfg["model_input_names"] = ["input_ids", "attention_mask"]
    path.write_text(json.dumps(cfg))


def save_st_bert(folder: Path, pooling: str = "cls", dense: int | None = 16, normalize: bool = True,
                 matryoshka: bool = False, prompts: dict | None = None, arch: str = "bert") -> Path:
    """A sentence-transformers BERT (or XLM-R) embedder: Transformer, Pooling, optional Dense and
    Normalize."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Dense, Normalize, Pooling, Transformer
    from transformers import BertModel, XLMRobertaConfig, XLMRobertaModel

    warnings.filterwarnings("ignore", category=DeprecationWarning)
    torch.manual_seed(0)
    tokenizer, vocab_size = write_bert_tokenizer(folder / "tok")
    hf = folder / "hf"
    if arch == "bert":
        model = BertModel(bert_config(vocab_size))
    elif arch == "modernbert":  # a window of 8 (4 each side): the test's texts are longer
        from transformers import ModernBertConfig, ModernBertModel

        model = ModernBertModel(ModernBertConfig(
            vocab_size=vocab_size, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
            num_attention_heads=4, local_attention=8, global_attn_every_n_layers=3, max_position_embeddings=128,
            pad_token_id=0, bos_token_id=2, eos_token_id=3, cls_token_id=2, sep_token_id=3))
    else:
        model = XLMRobertaModel(XLMRobertaConfig(
            vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=64, max_position_embeddings=66, type_vocab_size=1, pad_token_id=1))
    with torch.no_grad():  # a random init's LayerNorms are identities: make them count
        for name, p in model.named_parameters():
            if "LayerNorm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(hf)
    tokenizer.save_pretrained(hf)
    if arch != "bert":
        one_token_type(hf)
    modules = [Transformer(str(hf)), Pooling(32, pooling)]
    if dense:
        modules.append(Dense(32, dense))
    if normalize:
        modules.append(Normalize())
    st = SentenceTransformer(modules=modules, prompts=prompts)
    out = folder / "st"
    st.save(str(out))
    if matryoshka:
        cfg = json.loads((out / "config.json").read_text())
        cfg["is_matryoshka"] = True
        (out / "config.json").write_text(json.dumps(cfg))
    return out


def save_tiny_qwen3(folder: Path, **overrides):
    """A tiny random Qwen3ForCausalLM (seed 0) saved into ``folder`` with the demo model's
    tokenizer (its 512 ids): a decoder to embed or rerank with. Returns the transformers model."""
    import shutil

    from transformers import Qwen3Config, Qwen3ForCausalLM

    from pagedllm.config import DEFAULT_MODEL_DIR

    torch.manual_seed(0)
    cfg = Qwen3Config(**{**dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                max_position_embeddings=256, tie_word_embeddings=False), **overrides})
    model = Qwen3ForCausalLM(cfg).eval()
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(DEFAULT_MODEL_DIR / name, folder / name)
    return model

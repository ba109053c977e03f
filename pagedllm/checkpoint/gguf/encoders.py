"""llama.cpp's encoder architectures (``bert``, ``nomic-bert``): their metadata as the config.json
of the transformers model pagedllm runs them as (``BertModel``, ``NomicBertModel``), and their
tensor names as that model's checkpoint names.

What the file does not say is llama.cpp's own choice: BERT's GELU (the exact one, as
transformers' ``gelu``), NomicBERT's SwiGLU with rotary over the whole head and no biases
(its converter refuses any other NomicBERT), and no position table for NomicBERT.

An XLM-RoBERTa file is a ``bert`` file with a Unigram tokenizer (``tokenizer.ggml.model`` t5):
its position table lost the ``pad_token_id + 1`` rows XLM-R never reads, so positions count
from 0; with RoBERTa's classification head (``cls``, ``cls.output``) it is a cross-encoder.
"""
from __future__ import annotations

import re
from typing import Any, Callable

from pagedllm.checkpoint.gguf.reader import GGUFCheckpoint
from pagedllm.errors import ModelLoadError

Key = Callable[..., Any]  # key(name, default=None, required=False): ``<arch>.<name>``

_BERT_GLOBAL = {
    "token_embd.weight": "embeddings.word_embeddings.weight",
    "position_embd.weight": "embeddings.position_embeddings.weight",
    "token_types.weight": "embeddings.token_type_embeddings.weight",
    "token_embd_norm.weight": "embeddings.LayerNorm.weight",
    "token_embd_norm.bias": "embeddings.LayerNorm.bias",
}
_BERT_LAYER = {
    "attn_q": "attention.self.query", "attn_k": "attention.self.key", "attn_v": "attention.self.value",
    "attn_output": "attention.output.dense", "attn_output_norm": "attention.output.LayerNorm",
    "ffn_up": "intermediate.dense", "ffn_down": "output.dense", "layer_output_norm": "output.LayerNorm",
}
_NOMIC_GLOBAL = {
    "token_embd.weight": "embeddings.word_embeddings.weight",
    "token_types.weight": "embeddings.token_type_embeddings.weight",
    "token_embd_norm.weight": "emb_ln.weight",
    "token_embd_norm.bias": "emb_ln.bias",
}
# fc11 is the up projection, fc12 the gate (llama.cpp's tensor map says the same)
_NOMIC_LAYER = {
    "attn_qkv": "attn.Wqkv", "attn_output": "attn.out_proj", "attn_output_norm": "norm1",
    "ffn_up": "mlp.fc11", "ffn_gate": "mlp.fc12", "ffn_down": "mlp.fc2", "layer_output_norm": "norm2",
}
_NAMES = {"bert": (_BERT_GLOBAL, _BERT_LAYER, "encoder.layer"),
          "nomic-bert": (_NOMIC_GLOBAL, _NOMIC_LAYER, "encoder.layers")}
# RoBERTa's classification head (dense, tanh, projection), outside the encoder's prefix
_ROBERTA_HEAD = {"cls.weight": "classifier.dense.weight", "cls.bias": "classifier.dense.bias",
                 "cls.output.weight": "classifier.out_proj.weight", "cls.output.bias": "classifier.out_proj.bias"}
ENCODER_ARCHITECTURES = frozenset(_NAMES)
_BLOCK = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def encoder_hf_name(gguf_name: str, architecture: str, model_prefix: str = "") -> str | None:
    """The checkpoint name of an encoder's tensor, None for one pagedllm does not load;
    ``model_prefix`` is a classifier's encoder module (``roberta.``)."""
    global_names, layer_names, prefix = _NAMES[architecture]
    if model_prefix and gguf_name in _ROBERTA_HEAD:
        return _ROBERTA_HEAD[gguf_name]
    if gguf_name in global_names:
        return model_prefix + global_names[gguf_name]
    match = _BLOCK.match(gguf_name)
    if match is None or match[2] not in layer_names:
        return None
    return f"{model_prefix}{prefix}.{match[1]}.{layer_names[match[2]]}.{match[3]}"


def is_xlm_roberta(ckpt: GGUFCheckpoint) -> bool:
    return ckpt.architecture == "bert" and ckpt.get("tokenizer.ggml.model") == "t5"


def encoder_model_prefix(config: dict) -> str:
    """Where a classifier keeps its encoder: the checkpoint names' prefix."""
    return "roberta." if config.get("architectures") == ["XLMRobertaForSequenceClassification"] else ""


def encoder_config(ckpt: GGUFCheckpoint, key: Key) -> dict:
    """The config dict of a ``bert`` or ``nomic-bert`` file."""
    embed = ckpt.tensors.get("token_embd.weight")
    if embed is None:
        raise ModelLoadError(f"{ckpt.path.name} has no token_embd.weight tensor")
    types = ckpt.tensors.get("token_types.weight")
    shared = {"vocab_size": int(embed.shape[0]),
              "type_vocab_size": int(types.shape[0]) if types is not None else 1,
              "pad_token_id": ckpt.get("tokenizer.ggml.padding_token_id"),
              "torch_dtype": "float32"}
    hidden, heads = int(key("embedding_length", required=True)), int(key("attention.head_count", required=True))
    layers, inner = int(key("block_count", required=True)), int(key("feed_forward_length", required=True))
    eps = float(key("attention.layer_norm_epsilon", 1e-12))
    context = int(key("context_length", 512))
    if is_xlm_roberta(ckpt):
        labels = ckpt.get("bert.classifier.output_labels")
        head = "cls.output.weight" in ckpt.tensors
        return {"architectures": ["XLMRobertaForSequenceClassification" if head else "XLMRobertaModel"],
                "model_type": "xlm-roberta", "hidden_size": hidden, "num_attention_heads": heads,
                "num_hidden_layers": layers, "intermediate_size": inner, "max_position_embeddings": context,
                "position_offset": 0, "layer_norm_eps": eps, "hidden_act": "gelu",
                **({"id2label": dict(enumerate(map(str, labels)))} if head and labels else {}), **shared}
    if ckpt.architecture == "bert":
        return {"architectures": ["BertModel"], "model_type": "bert", "hidden_size": hidden,
                "num_attention_heads": heads, "num_hidden_layers": layers, "intermediate_size": inner,
                "max_position_embeddings": context, "layer_norm_eps": eps, "hidden_act": "gelu", **shared}
    return {"architectures": ["NomicBertModel"], "model_type": "nomic_bert", "n_embd": hidden, "n_head": heads,
            "n_layer": layers, "n_inner": inner, "n_positions": context, "layer_norm_epsilon": eps,
            "rotary_emb_base": float(key("rope.freq_base", 10000.0)), "rotary_emb_fraction": 1.0,
            "rotary_emb_interleaved": False, "activation_function": "swiglu", "qkv_proj_bias": False,
            "mlp_fc1_bias": False, "mlp_fc2_bias": False, "prenorm": False, "causal": False,
            "pad_vocab_size_multiple": 1, **shared}

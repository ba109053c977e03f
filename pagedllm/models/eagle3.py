"""An EAGLE-3 head: one decoder layer that drafts from the target's hidden states.

The checkpoint layout is the EAGLE authors' (``midlayer.*``, as yuhuili/EAGLE3-LLaMA3.1-Instruct-8B)
or the speculators' (``layers.0.*``, as RedHatAI's heads), both vLLM's ``llama_eagle3``:
``fc`` (3 * target hidden -> hidden) mixes the target's residual stream entering three of its
layers; the layer's q/k/v read ``input_layernorm(embedding) ‖ hidden_norm(hidden)`` (2 * hidden);
``norm`` and ``lm_head`` over the head's own vocabulary of ``draft_vocab_size`` tokens, mapped to
the target's by ``d2t`` (target id = draft id + d2t[draft id]); ``t2d`` is not needed to draft.
The embedding is the target's unless the checkpoint ships its own.

``forward(input_ids, positions, hidden)`` returns (rows for the logits, rows the next position
reads as its hidden state): after the first position the head feeds on its own pre-norm output.
"""
from __future__ import annotations

import torch
from torch import nn

from pagedllm.errors import ModelLoadError
from pagedllm.layers import Linear, ParallelLMHead, QKVParallelLinear, RotaryEmbedding, VocabParallelEmbedding
from pagedllm.models.decoder import DecoderAttention, DecoderLayer, make_norm
from pagedllm.models.decoder_args import DecoderArgs

EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


def default_aux_layer_ids(num_layers: int) -> tuple[int, ...]:
    """vLLM's choice when the config names none: an early, a middle and a late layer."""
    return (2, num_layers // 2, num_layers - 3)


def is_eagle3_config(config: dict) -> bool:
    return bool(set(config.get("architectures") or ()) & set(EAGLE3_ARCHITECTURES)) or "draft_vocab_size" in config


class Eagle3Attention(DecoderAttention):
    def __init__(self, args: DecoderArgs, layer_idx: int) -> None:
        super().__init__(args, layer_idx)
        # The embedding and the hidden state side by side: q/k/v read twice the hidden size.
        self.qkv_proj = QKVParallelLinear(2 * args.hidden_size, self.head_dim, args.num_heads,
                                          args.layer_num_kv_heads(layer_idx), bias=args.qkv_bias)


class Eagle3Layer(DecoderLayer):
    attention_cls = Eagle3Attention

    def __init__(self, args: DecoderArgs, layer_idx: int, norm_before_residual: bool) -> None:
        super().__init__(args, layer_idx)
        self.hidden_norm = make_norm(args, args.hidden_size)
        self.norm_before_residual = norm_before_residual

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, rope) -> torch.Tensor:  # type: ignore[override]
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = residual + self.self_attn(torch.cat((self.input_layernorm(embeds), normed), dim=-1), rope)
        return x + self.mlp(self.post_attention_layernorm(x))


class Eagle3Head(nn.Module):
    # Both published spellings onto one: ``model.`` prefixes dropped, ``layers.0.`` is ``midlayer.``.
    checkpoint_renames = {"model.": "", "layers.0.": "midlayer."}
    skipped_checkpoint_prefixes = ("d2t", "t2d")

    def __init__(self, config: dict, target_hidden_size: int, own_embedding: bool) -> None:
        super().__init__()
        if int(config.get("num_hidden_layers", 1)) != 1:
            raise ModelLoadError("an EAGLE-3 head has one decoder layer; this config names "
                                 f"{config.get('num_hidden_layers')}")
        args = DecoderArgs.from_hf({**config, "num_hidden_layers": 1, "tie_word_embeddings": False})
        self.args = args
        self.hidden_size, self.vocab_size = args.hidden_size, args.vocab_size
        self.draft_vocab_size = int(config.get("draft_vocab_size") or args.vocab_size)
        self.target_hidden_size = int(config.get("target_hidden_size") or target_hidden_size)
        eagle = config.get("eagle_config") or {}
        self.aux_layer_ids: tuple[int, ...] | None = (
            tuple(eagle["eagle_aux_hidden_state_layer_ids"]) if eagle.get("eagle_aux_hidden_state_layer_ids")
            else None)
        self.fc = Linear(3 * self.target_hidden_size, args.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(args, 0, bool(config.get("norm_before_residual", False)))
        self.norm = make_norm(args, args.hidden_size)
        self.rotary_emb = RotaryEmbedding(args.head_dim, args.rope)
        self.lm_head = ParallelLMHead(args.hidden_size, self.draft_vocab_size)
        if own_embedding:
            self.embed_tokens = VocabParallelEmbedding(args.vocab_size, args.hidden_size)
        # Draft id -> target id: where each draft logit lands in the target's vocabulary.
        self.register_buffer("draft_to_target", torch.arange(self.draft_vocab_size), persistent=False)
        self._target_embed: tuple[nn.Module, ...] = ()  # the target's, unless the head has its own

    def combine_target(self, aux: list[torch.Tensor]) -> torch.Tensor:
        """The target's residual streams at the three layers -> the head's hidden rows."""
        return self.fc(torch.cat(aux, dim=-1))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "embed_tokens"):
            return self.embed_tokens(input_ids)
        return self._target_embed[0].embed(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        embeds = self.embed(input_ids)
        prenorm = self.midlayer(embeds, hidden, self.rotary_emb(positions, hidden.dtype))
        return self.norm(prenorm), prenorm

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[N, hidden] -> [N, target vocab]`` float32: tokens outside the head's vocabulary
        get -inf, so the draft's q puts no mass on them."""
        logits = self.lm_head(hidden_states).float()
        if self.draft_vocab_size == self.vocab_size:
            return logits
        full = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))
        full[:, self.draft_to_target] = logits
        return full

"""MiMo's multi-token-prediction layers as a draft head (vLLM's ``mimo_mtp``).

``input_proj(hidden_layernorm(target hidden) ‖ token_layernorm(embedding of the next token))``,
a Qwen2 decoder layer, then ``final_layernorm``; the target's embedding and lm_head are shared.
The first MTP layer drafts every position (vLLM does the same for MiMo). Only the
``model.mtp_layers.*`` tensors are read from the target's checkpoint.
"""
from __future__ import annotations

import torch
from torch import nn

from pagedllm.layers import Linear, RotaryEmbedding
from pagedllm.models.decoder import DecoderLayer, make_norm
from pagedllm.models.decoder_args import DecoderArgs
from pagedllm.models.qwen2 import Qwen2ForCausalLM


class MiMoMTPLayer(DecoderLayer):
    def __init__(self, args: DecoderArgs, layer_idx: int) -> None:
        super().__init__(args, layer_idx)
        self.token_layernorm = make_norm(args, args.hidden_size)
        self.hidden_layernorm = make_norm(args, args.hidden_size)
        self.input_proj = Linear(2 * args.hidden_size, args.hidden_size, bias=False)
        self.final_layernorm = make_norm(args, args.hidden_size)

    def predict(self, embeds: torch.Tensor, hidden: torch.Tensor, rope) -> torch.Tensor:
        x = self.input_proj(torch.cat((self.hidden_layernorm(hidden), self.token_layernorm(embeds)), dim=-1))
        return self.final_layernorm(super().forward(x, rope))


class _MTPLayers(nn.Module):
    def __init__(self, args: DecoderArgs, num_layers: int) -> None:
        super().__init__()
        self.mtp_layers = nn.ModuleList(MiMoMTPLayer(args, i) for i in range(num_layers))


class MiMoMTPHead(nn.Module):
    """The draft head over the target checkpoint's MTP layers (only they are read from it)."""

    def __init__(self, config: dict) -> None:
        super().__init__()
        num = int(config.get("num_nextn_predict_layers") or 0)
        args = Qwen2ForCausalLM.args_from_hf(config)
        self.args, self.hidden_size, self.vocab_size = args, args.hidden_size, args.vocab_size
        self.model = _MTPLayers(args, num)
        self.rotary_emb = RotaryEmbedding(args.head_dim, args.rope)
        self._target: tuple[nn.Module, ...] = ()  # the target (its embedding and lm_head)
        # Everything but the MTP layers belongs to the target.
        names = ("model.layers.", "model.embed_tokens.", "model.norm.", "lm_head.")
        self.skipped_checkpoint_prefixes = names

    def combine_target(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden  # the target's final hidden state, as it is

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        embeds = self._target[0].decoder.embed(input_ids)
        embeds = embeds.masked_fill((positions == 0).unsqueeze(-1), 0.0)  # position 0 has no previous token
        out = self.model.mtp_layers[0].predict(embeds, hidden, self.rotary_emb(positions, hidden.dtype))
        return out, out

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self._target[0].compute_logits(hidden_states)

"""GPT-OSS (openai/gpt-oss-20b, -120b): what differs from Llama, on the shared MoE decoder.

* attention with biases on q/k/v/o and a learned sink logit per query head (the checkpoint's
  ``self_attn.sinks``, owned by the Attention layer: see layers/attention/layer.py);
* sliding-window and full layers alternating (``layer_types``), yarn rope (``truncate`` false
  in its ``rope_parameters``, read by layers/rotary.py);
* every MLP sparse: the router (``mlp.router``, with a bias) takes the top-k logits then a
  softmax over those k; each expert has biases and the clamped SwiGLU
  ``(clamp(up, -l, l) + 1) * g * sigmoid(alpha * g)`` with ``g = clamp(gate, max=l)``;
* experts stored fused, transposed, gate and up columns alternating
  (``ExpertLayout.TRANSPOSED_INTERLEAVED``), or as the Hub ships them, MXFP4 blocks and scales
  (``quantization_config.quant_method == "mxfp4"``), dequantized at load to the model dtype.
"""
from __future__ import annotations

from functools import partial

import torch
from torch import nn

from pagedllm.distributed.parallel_state import get_tp_group
from pagedllm.errors import UnsupportedModelError
from pagedllm.layers import Attention, WeightSlice
from pagedllm.layers.fused_moe import ExpertLayout
from pagedllm.layers.moe_router import RoutingOrder
from pagedllm.models.decoder import DecoderAttention, DecoderLayer
from pagedllm.models.decoder_args import DecoderArgs
from pagedllm.models.moe import MoEArgs, MoEForCausalLM


class ClampedSwiGLU(nn.Module):
    """``[..., 2I]`` (gate half, up half) -> ``[..., I]``: GPT-OSS's SwiGLU. The clamps bound
    what a single expert can add to the residual stream; ``up + 1`` keeps a path for the gate
    alone."""

    def __init__(self, alpha: float, limit: float) -> None:
        super().__init__()
        self.alpha, self.limit = float(alpha), float(limit)

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def kernel_activation(self) -> tuple[str, float, float]:
        """csrc/fused_moe.cpp's name for it: the ops above, in C++ where the CPU kernels run."""
        return "swiglu_clamped", self.alpha, self.limit

    def extra_repr(self) -> str:
        return f"alpha={self.alpha}, limit={self.limit}"


class SinkAttention(Attention):
    """Attention with sinks, split over the ranks with the query heads they belong to."""

    def checkpoint_slices(self, attr: str, param: torch.Tensor) -> list[WeightSlice]:
        tp = get_tp_group()
        return [WeightSlice(param, None, 0, tp.rank * self.num_heads,
                            self.num_heads * tp.world_size)]


class GptOssAttention(DecoderAttention):
    def __init__(self, args: DecoderArgs, layer_idx: int) -> None:
        super().__init__(args, layer_idx)
        plain = self.attn  # the same layer with sinks (free on the meta device the loader uses)
        self.attn = SinkAttention(plain.num_heads, plain.num_kv_heads, plain.head_dim, plain.scale,
                                  layer_idx, sliding_window=plain.sliding_window,
                                  logits_soft_cap=plain.logits_soft_cap, has_sinks=True)


class GptOssDecoderLayer(DecoderLayer):
    attention_cls = GptOssAttention


class GptOssForCausalLM(MoEForCausalLM):
    layer_cls = GptOssDecoderLayer
    checkpoint_renames = {".mlp.router.": ".mlp.gate.",  # SparseMoeBlock's router is ``gate``
                          ".self_attn.sinks": ".self_attn.attn.sinks"}

    @classmethod
    def args_from_hf(cls, config: dict) -> DecoderArgs:
        # attention_bias (true in every GPT-OSS config) covers q/k/v and o; configs without
        # layer_types alternate sliding and full layers from layer 0, as transformers does.
        return DecoderArgs.from_hf(config, default_pattern=2)

    @classmethod
    def moe_args_from_hf(cls, config: dict) -> MoEArgs:
        return MoEArgs.from_hf(
            config, renormalize=True, order=RoutingOrder.TOPK_SOFTMAX, router_bias=True,
            expert_bias=True, expert_layout=ExpertLayout.TRANSPOSED_INTERLEAVED,
            weight_format=_expert_format(config), decoder_sparse_step=1, mlp_only_layers=(),
            make_activation=partial(ClampedSwiGLU, float(config.get("swiglu_alpha", 1.702)),
                                    float(config.get("swiglu_limit", 7.0))))


def _expert_format(config: dict) -> str | None:
    """"mxfp4" when the experts ship quantized (the Hub checkpoints), None for float ones."""
    quant = config.get("quantization_config")
    if not quant:
        return None
    method = str(quant.get("quant_method", "")).lower()
    if method != "mxfp4":
        raise UnsupportedModelError(f"GPT-OSS with quant_method {method!r} is not supported; "
                                    "supported: float checkpoints and mxfp4", "quantization")
    return "mxfp4"

"""Expert selection for mixture-of-experts layers: router logits -> (weights, expert ids) per token.

The families route in two orders that give the same experts and, with renormalisation, the
same weights: softmax over all experts then the top k (Qwen-MoE, OLMoE; renormalising the k
probabilities to sum to 1 when ``norm_topk_prob``), or the top k logits then a softmax over
those k (Mixtral's original form: the renormalised top-k probabilities, without exponentiating
every expert). The weights are float32 whatever the model dtype: a bf16 softmax over 64+
experts loses the small probabilities the renormalisation then divides by.
"""
from __future__ import annotations

from enum import Enum

import torch

from pagedllm.errors import UnsupportedModelError


class RoutingOrder(str, Enum):
    SOFTMAX_TOPK = "softmax_topk"
    TOPK_SOFTMAX = "topk_softmax"


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                   order: RoutingOrder = RoutingOrder.SOFTMAX_TOPK
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``[T, E]`` logits -> (``[T, k]`` float32 weights, ``[T, k]`` int64 expert ids), ids in
    decreasing weight order. Row by row: a token's experts never depend on its batch."""
    logits = router_logits.float()
    if order == RoutingOrder.TOPK_SOFTMAX:
        # softmax is monotonic, so the top-k logits are the top-k probabilities' experts, and
        # a softmax over the k of them is their renormalised probability.
        top_logits, topk_ids = torch.topk(logits, top_k, dim=-1)
        return torch.softmax(top_logits, dim=-1), topk_ids
    topk_weights, topk_ids = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids


def check_routing(num_experts: int, top_k: int) -> None:
    """Raise for a config whose routing cannot work (a user error in config.json)."""
    if num_experts < 1 or not 1 <= top_k <= num_experts:
        raise UnsupportedModelError(
            f"num_experts_per_tok={top_k} with {num_experts} experts is not supported; "
            "supported: 1 <= num_experts_per_tok <= num_experts", "num_experts_per_tok")

"""The step's token types as an encoder's embedding reads them, eagerly and under torch.compile.

The types live in the forward context (layers/forward_context.py), a Python global: traced by
dynamo, its value at warm-up (None) would be baked into the graph, and a text pair's types
would be ignored by the one graph every step runs. Compiled, they come from an opaque custom op,
``pagedllm::token_type_ids``, as attention's metadata does: the graph only sees a ``[T]`` tensor
(zeros when the step has none), so one graph serves steps with and without pairs.
"""
from __future__ import annotations

import torch

from pagedllm.kernels.op_registry import layer_op
from pagedllm.layers.forward_context import get_token_type_ids


def step_token_type_ids(input_ids: torch.Tensor) -> torch.Tensor | None:
    """``[T]`` token types for ``input_ids``; eagerly None when every row's is 0 (one row of the
    table serves all), compiled always a tensor."""
    if torch.compiler.is_compiling():
        return torch.ops.pagedllm.token_type_ids(input_ids)
    return get_token_type_ids()


@layer_op("token_type_ids")
def token_type_ids_op(input_ids: torch.Tensor) -> torch.Tensor:
    """The forward context's token types, or zeros; a fresh tensor (the graph owns its outputs)."""
    types = get_token_type_ids()
    return torch.zeros_like(input_ids) if types is None else types.clone()


@torch.library.register_fake("pagedllm::token_type_ids")
def _token_type_ids_fake(input_ids: torch.Tensor) -> torch.Tensor:
    return input_ids.new_empty(input_ids.shape)

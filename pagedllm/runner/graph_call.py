"""The warm compiled forward's call: the compiled graph, its inputs gathered from where they live.

Dynamo turns ``forward(input_ids, positions)`` into bytecode that reaches every tensor the graph
reads (each weight, packed panel, quantized block, LoRA slot) through the module tree, two
attribute loads through ``nn.Module.__getattr__`` per tensor, and passes them, the two inputs and
their token counts to the compiled graph. Once warm the graph reads the same tensors every step,
so ``GraphCall.capture`` finds, once, the dict (a module's ``_parameters``, ``_buffers`` or
``__dict__``, another object's ``__dict__``) or list that holds each, and a step reads one entry
of each: a list of subscripts where the bytecode ran a few hundred Python calls.

What a step sees, as the bytecode did: a tensor written in place (a LoRA slot filled, a weight's
``.data`` replaced) and another tensor put in its place (``layer.weight = nn.Parameter(...)``).
Replacing an object that holds tensors (a layer, its weight format) changes what was traced: the
graph would need compiling again either way (the warm forward checks no guards, runner/compile.py).

Token counts: the graph takes each input's token count (an unbacked size) as an argument, an int
that inductor's C++ wrapper turns into a 0-dim tensor on every call; the call passes a 0-dim
tensor kept per distinct count instead, which the wrapper hands through as it is.
"""
from __future__ import annotations

import types
from collections.abc import Callable
from operator import getitem
from typing import Any

import torch
from torch import nn

_PREFIX = "__compiled_fn"  # the global name dynamo installs a compiled graph under
_PROBE_TOKENS = 3  # the probe's token count: distinct from every other int the graph could take
_INPUT_IDS, _POSITIONS, _NUM_TOKENS = 0, 1, 2  # keys of the per-call inputs' holder


class GraphCall:
    """``call(input_ids, positions)``: the compiled graph on them and the tensors it reads.
    Build one with ``capture``."""

    def __init__(self, graph: Callable[..., Any], holders: list[dict | list | tuple], keys: list[Any],
                 inputs: dict[int, Any], tensor_counts: bool) -> None:
        self._graph = graph
        self._holders, self._keys = holders, keys
        self._inputs = inputs  # this call's input_ids, positions, token count (one of holders)
        self._tensor_counts = tensor_counts
        self._counts: dict[int, Any] = {}  # token count -> what the graph is given for it

    @classmethod
    def capture(cls, bytecode: types.CodeType, fn_globals: dict[str, Any], model: nn.Module,
                device: torch.device, tensor_counts: bool) -> GraphCall | None:
        """The call of the one graph that ``bytecode`` (dynamo's code for ``forward``, run with
        ``fn_globals``) calls, found by running it once on a probe batch with the graph
        recorded; None when the bytecode does more than pass tensors and counts the model holds
        to the graph and return its one output. ``tensor_counts``: the graph's wrapper is
        inductor's C++ one (which takes a count as a 0-dim tensor as well as an int)."""
        names = [name for name in bytecode.co_names if name.startswith(_PREFIX)]
        if len(names) != 1:
            return None
        graph = fn_globals[names[0]]
        # Without dynamo's disable wrapper, which only matters when a compiled frame calls it.
        graph = getattr(graph, "_torchdynamo_orig_callable", graph)
        calls: list[tuple[tuple, dict, Any]] = []

        def record(*args: Any, **kwargs: Any) -> Any:
            out = graph(*args, **kwargs)
            calls.append((args, kwargs, out))
            return out

        probe = types.FunctionType(bytecode, {**fn_globals, names[0]: record})
        input_ids = torch.zeros(_PROBE_TOKENS, dtype=torch.long, device=device)
        positions = torch.arange(_PROBE_TOKENS, device=device)
        with torch.inference_mode():
            result = probe(model, input_ids, positions)
        if len(calls) != 1 or calls[0][1]:
            return None
        args, _, out = calls[0]
        if not (isinstance(out, (tuple, list)) and len(out) == 1 and out[0] is result):
            return None
        places = tensor_places(model)
        inputs: dict[int, Any] = {}
        holders: list[dict | list | tuple] = []
        keys: list[Any] = []
        for arg in args:
            if arg is input_ids or arg is positions:
                place = (inputs, _INPUT_IDS if arg is input_ids else _POSITIONS)
            elif type(arg) is int and arg == _PROBE_TOKENS:
                place = (inputs, _NUM_TOKENS)
            else:
                place = places.get(id(arg)) if isinstance(arg, torch.Tensor) else None
                if place is None:  # a tensor the model does not hold (made by a property?)
                    return None
            holders.append(place[0])
            keys.append(place[1])
        return cls(graph, holders, keys, inputs, tensor_counts)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        num_tokens = input_ids.shape[0]
        count = self._counts.get(num_tokens)
        if count is None:
            count = self._counts[num_tokens] = torch.tensor(num_tokens) if self._tensor_counts else num_tokens
        inputs = self._inputs
        inputs[_INPUT_IDS], inputs[_POSITIONS], inputs[_NUM_TOKENS] = input_ids, positions, count
        return self._graph(*map(getitem, self._holders, self._keys))[0]


def tensor_places(root: nn.Module) -> dict[int, tuple[dict | list | tuple, Any]]:
    """id(tensor) -> (the dict, list or tuple that holds it, its key there), for every tensor reachable
    from ``root`` through modules' parameters, buffers and attributes, other objects'
    attributes, lists, tuples and dicts; a tensor held twice (tied weights) keeps the first
    place found, a module's own parameter or buffer before an attribute."""
    places: dict[int, tuple[dict | list | tuple, Any]] = {}
    seen: set[int] = set()
    stack: list[Any] = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, nn.Module):
            holders: list[Any] = [obj._parameters, obj._buffers, obj._modules, vars(obj)]
        elif isinstance(obj, (dict, list, tuple)):
            holders = [obj]
        elif hasattr(obj, "__dict__") and not isinstance(obj, _OPAQUE):
            holders = [vars(obj)]
        else:
            continue
        for holder in holders:
            for key, value in (holder.items() if isinstance(holder, dict) else enumerate(holder)):
                if isinstance(value, torch.Tensor):
                    places.setdefault(id(value), (holder, key))
                else:
                    stack.append(value)
    return places


# Objects whose attributes hold no tensor the graph reads: classes, modules, code.
_OPAQUE = (type, types.ModuleType, types.FunctionType, types.MethodType, types.BuiltinFunctionType)

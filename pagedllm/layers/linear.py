"""Linear layers, plain and tensor-parallel (vLLM's split, as in Megatron and gpt-fast).

A column-parallel layer splits the output dimension: each rank computes its own rows of
``x W^T`` and no communication is needed (the next layer consumes the shard). A row-parallel
layer splits the input dimension: each rank multiplies its slice of ``x`` (the column-parallel
layer's output) and the partial sums are all-reduced. Attention is column-parallel QKV, heads
per rank, row-parallel o_proj; the MLP is column-parallel gate/up, row-parallel down: two
all-reduces per decoder layer. At world size 1 every class is an ordinary linear layer.

``ColumnParallelLinear`` stacks several projections of the same input (q/k/v, gate/up) along the
output dimension so one matmul replaces two or three; each part remembers its checkpoint name
and where this rank's rows start in it, so the loader reads just those rows from safetensors
(``checkpoint_slices``).

After loading, the planning pass (weight_plan/plan.py) gives each layer one ``WeightFormat``
(layers/weight_format.py): float32 panels of ``pagedllm::packed_linear`` (the skinny kernel,
where the runner measured it faster than torch's matmul on this CPU: weight_plan/linear_choice.py),
bf16/fp16 panels, block-quantized codes (q8, q4, q5, q6), or ``Dense``, the plain ``[out, in]``
matrix on torch's matmul. Either way a layer holds exactly one copy of its weight, and
``linear`` dispatches: the model code does not see the format. The skinny kernel sums in float32
in the same order for every row count, so a row's result does not depend on its batch; a
compiled graph calls its op directly as an opaque node with the panels as its input (inductor
would otherwise lower the matmul to a plain sgemm).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed.parallel_state import get_tp_group
from pagedllm.distributed.tp_sizes import check_heads_split, split_size
from pagedllm.errors import ModelLoadError
from pagedllm.layers.weight_format import Dense, Panels, WeightFormat


def linear(layer: Linear | nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x W^T + b`` for a layer holding its weight in a ``weight_format``, or as ``weight``
    (``F.linear``)."""
    fmt: WeightFormat | None = layer.weight_format
    if fmt is None:
        return F.linear(x, layer.weight, bias)
    return fmt.apply(x, bias)


@dataclass(frozen=True)
class WeightSlice:
    """Where (part of) one checkpoint tensor goes: ``dest``, a view of this rank's parameter,
    takes rows ``start:start + dest.shape[dim]`` of the checkpoint tensor along ``dim`` (the whole
    tensor when ``dim`` is None), whose size along ``dim`` is ``full_size``."""

    dest: torch.Tensor
    shard_name: str | None = None  # the checkpoint module replacing this one's (q_proj in qkv_proj)
    dim: int | None = None
    start: int = 0
    full_size: int = 0

    def checkpoint_shape(self) -> tuple[int, ...]:
        shape = list(self.dest.shape)
        if self.dim is not None:
            shape[self.dim] = self.full_size
        return tuple(shape)


class Linear(nn.Linear):
    """``y = x W^T + b``, replicated on every rank; a separate name so every projection in the
    models reads the same."""

    # How the layer holds its weight once loaded, in place of ``weight`` (then None); None:
    # ``weight`` itself. A plain attribute, not a submodule: set once after loading.
    weight_format: WeightFormat | None = None
    # The skinny kernel whatever the measurement, where it runs (a MoE router: its logits choose
    # the experts, so a token's choice must not depend on its batch); read by the planning pass.
    batch_invariant: bool = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return linear(self, x, bias)


class ColumnParallelLinear(Linear):
    """Projections ``shard_names[i]`` stacked in one weight, each split by output rows: this
    rank holds rows ``shard_starts[i]:shard_starts[i] + output_sizes[i]`` of part ``i`` (of
    ``full_sizes[i]``). ``output_sizes`` are this rank's."""

    def __init__(self, in_features: int, full_sizes: list[int], shard_names: list[str],
                 bias: bool, output_sizes: list[int] | None = None,
                 shard_starts: list[int] | None = None) -> None:
        if len(full_sizes) != len(shard_names):
            raise ValueError("ColumnParallelLinear needs one name per output size")
        tp = get_tp_group()
        if output_sizes is None:  # an even split of every part
            output_sizes = [split_size(size, tp.world_size, "output size") for size in full_sizes]
            shard_starts = [tp.rank * size for size in output_sizes]
        assert shard_starts is not None and len(shard_starts) == len(output_sizes)
        super().__init__(in_features, sum(output_sizes), bias=bias)
        self.full_sizes = list(full_sizes)
        self.output_sizes = list(output_sizes)
        self.shard_names = list(shard_names)
        self.shard_starts = list(shard_starts)

    def shard(self, param: torch.Tensor, shard_id: int) -> torch.Tensor:
        """The rows of ``param`` (weight or bias) that belong to projection ``shard_id`` (a view)."""
        start = sum(self.output_sizes[:shard_id])
        return param.narrow(0, start, self.output_sizes[shard_id])

    def checkpoint_slices(self, attr: str, param: torch.Tensor) -> list[WeightSlice]:
        return [WeightSlice(self.shard(param, i), name, 0, self.shard_starts[i], self.full_sizes[i])
                for i, name in enumerate(self.shard_names)]


class MergedColumnParallelLinear(ColumnParallelLinear):
    """gate/up: parts of equal size, each split evenly (the default of the base class)."""


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v: this rank's query heads and the KV heads they attend with. With fewer KV
    heads than ranks, each KV head is replicated on the ``tp / num_kv_heads`` ranks whose query
    heads use it (grouped-query attention keeps query head ``h`` on KV head ``h // group``)."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool) -> None:
        tp = get_tp_group()
        check_heads_split(num_heads, num_kv_heads, tp.world_size)
        heads, kv_heads = num_heads // tp.world_size, max(1, num_kv_heads // tp.world_size)
        kv_start = tp.rank * num_kv_heads // tp.world_size  # the first KV head this rank holds
        q_size, kv_size = heads * head_dim, kv_heads * head_dim
        super().__init__(hidden_size, [num_heads * head_dim, num_kv_heads * head_dim,
                                       num_kv_heads * head_dim], ["q_proj", "k_proj", "v_proj"],
                         bias, output_sizes=[q_size, kv_size, kv_size],
                         shard_starts=[tp.rank * q_size, kv_start * head_dim, kv_start * head_dim])
        self.num_heads, self.num_kv_heads = heads, kv_heads  # this rank's


class RowParallelLinear(Linear):
    """Input columns split across ranks: ``x`` is this rank's shard (a column-parallel output),
    the partial products are summed over the ranks; the bias is added once, after the sum."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        tp = get_tp_group()
        super().__init__(split_size(in_features, tp.world_size, "input size"), out_features, bias=bias)
        self.tp = tp
        self.full_in_features = in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return self.matmul(x, self.bias)
        y = self.tp.all_reduce(self.matmul(x, None))
        return y if self.bias is None else y + self.bias

    def checkpoint_slices(self, attr: str, param: torch.Tensor) -> list[WeightSlice]:
        if attr == "bias":
            return [WeightSlice(param)]
        return [WeightSlice(param, None, 1, self.tp.rank * self.in_features, self.full_in_features)]


def pack_weight(weight: torch.Tensor, bias: torch.Tensor | None, check: bool = True,
                narrow: bool = True) -> torch.Tensor | None:
    """``weight`` [out, in] as skinny_gemm's panels (``Panels.pack``), or None when the kernel
    cannot run here. With ``check``, the kernel is first checked against float64 on it
    (``WeightFormat.check``): a kernel whose error is not that of float32 rounding is never
    used (one check per shape suffices: the layout and the kernel's path depend on the shape,
    not on the values)."""
    panels = Panels.pack(weight, narrow)
    if panels is None or (check and not panels.check(bias)):
        return None
    return panels.packed


def hold(layer: nn.Module, fmt: WeightFormat) -> None:
    """Make ``layer`` (a linear layer, head or embedding) multiply by ``fmt``: its ``weight``
    goes (the format holds the only copy), except under ``Dense``, whose tensor it is.
    ModelLoadError when a linear layer's shape is not the format's."""
    if isinstance(layer, Linear) and (fmt.out_features, fmt.in_features) != (
            layer.out_features, layer.in_features):
        raise ModelLoadError(f"a {fmt.out_features}x{fmt.in_features} weight does not fit a "
                             f"{layer.out_features}x{layer.in_features} layer")
    layer.weight_format = fmt
    if not isinstance(fmt, Dense):
        layer.weight = None

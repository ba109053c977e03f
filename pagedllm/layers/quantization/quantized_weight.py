"""A linear layer's weight held in a format other than float32, in the panels of pagedllm's CPU
linear kernel (csrc/quant_gemm.cpp; the layout is described there and below).

Five formats, named by ``QuantizedWeight.format``:

- ``"bf16"``, ``"fp16"``: the weight's own 16-bit values, widened to float32 in registers;
- ``"q8"``: int8 codes, a float32 scale per group of ``group_size`` input elements of an output
  row, and optionally a float32 offset: ``value = code * scale (+ offset)``;
- ``"q4"``: codes 0..15 (two per byte), scale and optional offset per group, the same formula;
- ``"q5"``: codes -16..15 (q4's nibbles and a plane of fifth bits), the same formula.

These block layouts hold every GGUF block type and AWQ/GPTQ exactly (dequantizing them is
exact in float32 up to the last rounding of ``code * scale + offset``; the loaders compute each
``scale`` and ``offset`` from the file's own fields):

===========  ======  ==========  =======================  ============================
source       layout  group_size  scale                    offset
===========  ======  ==========  =======================  ============================
Q8_0         q8      32          d                        None
Q6_K         q8      16          d * sc (codes -32..31)   None
Q5_0         q5      32          d (codes q - 16)         None
Q5_1         q8      32          d (codes 0..31)          m
Q5_K         q8      32          d * sc (codes 0..31)     -dmin * m
Q4_0         q4      32          d                        -8 * d
Q4_1         q4      32          d                        m
Q4_K         q4      32          d * sc                   -dmin * m
AWQ / GPTQ   q4      group size  s                        -z * s
===========  ======  ==========  =======================  ============================

Q5_0 is what llama.cpp's Q4_K_M writes for the matrices whose rows are not whole 256-element
super-blocks (most of Qwen2.5-0.5B's: 896 columns), so it is most of such a file's bytes: q5
holds it in 0.75 bytes a weight where q8 took 1.125 (GGUF's: 0.6875). Q5_1 and Q5_K keep q8:
their codes are 0..31 with an offset, and moving them to -16..15 would round the offset once.
The scales are float32 (not GGUF's fp16 d times a 6-bit sc, which no 16-bit float holds
exactly): 4 bytes per group, so a weight costs 1 + 4/G bytes in q8, 0.625 + 4/G in q5 and
0.5 + 8/G in q4 with offsets (GGUF's Q4_K: 0.5625).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pagedllm.errors import ModelLoadError

if TYPE_CHECKING:  # loaders pass numpy arrays (GGUF's memory map); torch.as_tensor takes them
    import numpy as np

PANEL = 64  # output columns per panel (kPanel in csrc/skinny_gemm.cpp)
FORMATS = ("bf16", "fp16", "bf16_vnni", "q8", "q4", "q5")
_HALF_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass(frozen=True)
class QuantizedWeight:
    """A weight [out_features, in_features] as panels: bf16/fp16 ``codes`` [P, in, 64] (bf16's
    columns in pairs: column j at 2j, column j + 32 at 2j + 1, each pair one float's worth of
    bits the kernel widens with one shift or one mask; fp16 in column order); bf16_vnni, the
    AMX path's bf16 (``to_vnni``: Intel's VNNI layout), [P, ceil(in / 2), 64 x 2] in k pairs,
    column c's k = 2q + i at 2c + i of pair row q, a zero k padding an odd in; q8/q4
    codes in quad blocks, a column's 4 consecutive k in adjacent bytes (the int8-activation
    path's integer dot products read them as they lie, the float path picks one byte of four):
    q8 [P, ceil(in / 4), 64 x 4] int8, q4 [P, ceil(in / 4), 32 x 4] bytes, byte 4j + i of a
    quad holding column j (k = 4q + i) low and column j + 32 high; q5 [P, ceil(in / 4), 160]
    bytes, q4's quad of the codes + 16 (their low 4 bits) and 32 bytes of their fifth bits
    (``_Q5_PLANE``). ``scales`` and ``offsets`` float32 [P, in / group_size, 64] (None for
    bf16/fp16; offsets None: no offset). Zero rows pad the last panel, zero codes the last
    quad."""

    format: str
    out_features: int
    in_features: int
    codes: torch.Tensor
    scales: torch.Tensor | None = None
    offsets: torch.Tensor | None = None
    group_size: int = 0

    # -- construction --------------------------------------------------------------------------
    @classmethod
    def from_half(cls, weight: torch.Tensor) -> QuantizedWeight:
        """A bfloat16 or float16 ``weight`` [out, in] as 16-bit panels (the same values)."""
        fmt = _HALF_DTYPES.get(weight.dtype)
        if fmt is None or weight.dim() != 2:
            raise ModelLoadError(f"a half-precision weight must be a 2-D bfloat16 or float16 "
                                 f"tensor, got {weight.dtype} {tuple(weight.shape)}")
        panels = _to_panels(weight.detach())  # [P, in, 64]
        if fmt == "bf16":  # [P, in, 2, 32] -> [P, in, 32, 2]: columns j and j + 32 side by side
            panels = _pair_columns(panels)
        return cls(fmt, *weight.shape, panels.contiguous())

    def to_vnni(self) -> QuantizedWeight:
        """A bf16 weight (stacked experts too) in the AMX path's layout, bf16_vnni: each
        column's k pairs adjacent, the B operand of AMX's bf16 tile product as it lies."""
        if self.format != "bf16":
            raise ModelLoadError(f"only bf16 weights have a VNNI layout, not {self.format}")
        columns = _pair_columns(self.codes, undo=True)  # [..., in, 64] in column order
        flat = columns.reshape(-1, *columns.shape[-2:])
        pairs = _to_kgroups(flat, 2).reshape(*columns.shape[:-2], -1, 2 * PANEL)
        return dataclasses.replace(self, format="bf16_vnni", codes=pairs)

    @classmethod
    def from_q8(cls, codes: np.ndarray | torch.Tensor, scales: np.ndarray | torch.Tensor,
                offsets: np.ndarray | torch.Tensor | None, group_size: int) -> QuantizedWeight:
        """int8 ``codes`` [out, in], float ``scales`` (and ``offsets`` or None) [out, in /
        group_size]: ``W[n, k] = codes[n, k] * scales[n, k // G] (+ offsets[n, k // G])``."""
        codes_t = torch.as_tensor(codes)
        if codes_t.dtype != torch.int8:
            raise ModelLoadError(f"q8 codes must be int8, got {codes_t.dtype}")
        scales_t, offsets_t = _check_groups("q8", codes_t, scales, offsets, group_size)
        return cls("q8", *codes_t.shape, _to_kgroups(_to_panels(codes_t), 4), _to_panels(scales_t),
                   None if offsets_t is None else _to_panels(offsets_t), group_size)

    @classmethod
    def from_q4(cls, codes: np.ndarray | torch.Tensor, scales: np.ndarray | torch.Tensor,
                offsets: np.ndarray | torch.Tensor | None, group_size: int) -> QuantizedWeight:
        """``codes`` [out, in] of values 0..15 (any integer dtype, one code per element), float
        ``scales`` (and ``offsets`` or None) [out, in / group_size], as for from_q8."""
        codes_t = _integer_codes("q4", codes, 0, 15)
        scales_t, offsets_t = _check_groups("q4", codes_t, scales, offsets, group_size)
        panels = _to_panels(codes_t.to(torch.uint8))  # [P, in, 64]
        half = PANEL // 2
        packed = panels[..., :half] | (panels[..., half:] << 4)  # [P, in, 32]
        return cls("q4", *codes_t.shape, _to_kgroups(packed, 4), _to_panels(scales_t),
                   None if offsets_t is None else _to_panels(offsets_t), group_size)

    @classmethod
    def from_q5(cls, codes: np.ndarray | torch.Tensor, scales: np.ndarray | torch.Tensor,
                offsets: np.ndarray | torch.Tensor | None, group_size: int) -> QuantizedWeight:
        """``codes`` [out, in] of values -16..15 (any integer dtype), float ``scales`` (and
        ``offsets`` or None) [out, in / group_size], as for from_q8."""
        codes_t = _integer_codes("q5", codes, -16, 15)
        scales_t, offsets_t = _check_groups("q5", codes_t, scales, offsets, group_size)
        biased = _to_panels((codes_t.to(torch.int16) + 16).to(torch.uint8))  # [P, in, 64]: 0..31
        half = PANEL // 2
        nibbles = _to_kgroups((biased[..., :half] & 15) | ((biased[..., half:] & 15) << 4), 4)
        # fifth bits by nibble byte b (0..127) of the quad, low (h = 0) and high (h = 1) columns
        fifth = [_to_kgroups(biased[..., h * half:(h + 1) * half] >> 4, 4) for h in (0, 1)]
        num_panels, num_quads, _ = nibbles.shape
        plane = torch.zeros(num_panels, num_quads, _Q5_PLANE, dtype=torch.uint8)
        for h in (0, 1):
            by_run = fifth[h].view(num_panels, num_quads, 4, _Q5_PLANE)  # b = 32 * run + byte
            for run in range(4):
                plane |= by_run[:, :, run] << (2 * run + h)
        return cls("q5", *codes_t.shape, torch.cat((nibbles, plane), dim=2), _to_panels(scales_t),
                   None if offsets_t is None else _to_panels(offsets_t), group_size)

    @classmethod
    def stack(cls, weights: list[QuantizedWeight]) -> QuantizedWeight:
        """A mixture-of-experts projection: the experts' weights (one format and shape) with
        every tensor stacked along a new leading dim, codes ``[E, ...]`` (the grouped kernel's
        operand, csrc/quant_gemm.cpp); ``expert(e)`` gives one back."""
        first = weights[0]
        for w in weights[1:]:
            if (w.format, w.out_features, w.in_features, w.group_size, w.offsets is None) != (
                    first.format, first.out_features, first.in_features, first.group_size,
                    first.offsets is None):
                raise ModelLoadError(
                    f"experts of one projection must share a format and shape to be stacked: "
                    f"{first.format} {first.out_features}x{first.in_features} (group "
                    f"{first.group_size}) and {w.format} {w.out_features}x{w.in_features} "
                    f"(group {w.group_size})")
        def stacked(name: str) -> torch.Tensor | None:
            tensors = [getattr(w, name) for w in weights]
            return None if tensors[0] is None else torch.stack(tensors)
        return cls(first.format, first.out_features, first.in_features, stacked("codes"),
                   stacked("scales"), stacked("offsets"), first.group_size)

    def expert(self, e: int) -> QuantizedWeight:
        """Expert ``e``'s weight of a ``stack`` (views, no copy)."""
        return QuantizedWeight(self.format, self.out_features, self.in_features, self.codes[e],
                               None if self.scales is None else self.scales[e],
                               None if self.offsets is None else self.offsets[e], self.group_size)

    # -- reading -------------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Bytes held (codes, scales and offsets, the last panel's padding included)."""
        return sum(t.numel() * t.element_size()
                   for t in (self.codes, self.scales, self.offsets) if t is not None)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the weight, ``[T] -> [T, in]``: the lookup of an embedding tied to a
        head that holds this weight. bf16/fp16 rows in their dtype; q8/q4 rows in float32,
        ``code * scale`` then ``+ offset`` (the float32 embedding a loader would have
        dequantized: the same two roundings)."""
        panel, col = ids // PANEL, ids % PANEL
        if self.format == "fp16":
            return self.codes[panel, :, col]
        if self.format == "bf16":  # column j at 2j, column j + 32 at 2j + 1
            return self.codes[panel, :, 2 * (col % (PANEL // 2)) + col // (PANEL // 2)]
        if self.format == "bf16_vnni":  # column c's k pair at 2c, 2c + 1 of each pair row
            pairs = self.codes.view(*self.codes.shape[:2], PANEL, 2)[panel, :, col]  # [T, in / 2, 2]
            return pairs.reshape(len(ids), -1)[:, :self.in_features]
        num_panels, num_quads, width = self.codes.shape
        if self.format == "q8":  # [P, in / 4, 64, 4]: column c's 4 k together
            codes = self.codes.view(num_panels, num_quads, PANEL, 4)[panel, :, col]
        else:  # q4/q5: byte 4j + i holds column j low, column j + 32 high
            half = PANEL // 2
            high = (col >= half).to(torch.uint8).view(-1, 1, 1)
            lanes = self.codes.view(num_panels, num_quads, width // 4, 4)  # q5: 32 + 8 lanes
            codes = (lanes[panel, :, col % half] >> high * 4) & 15  # [T, in / 4, 4]
            if self.format == "q5":  # byte b = 4 (col % 32) + i: plane b % 32, bit 2 (b // 32) + h
                bit = (2 * (col % half // 8)).to(torch.uint8).view(-1, 1, 1) + high
                fifth = (lanes[panel, :, half + col % 8] >> bit) & 1
                codes = codes.to(torch.int16) + 16 * fifth.to(torch.int16) - 16
        codes = codes.reshape(len(ids), -1)[:, :self.in_features].float()  # [T, in]
        groups = (len(ids), self.in_features // self.group_size, self.group_size)
        values = codes.view(groups) * self.scales[panel, :, col].unsqueeze(-1)
        if self.offsets is not None:
            values += self.offsets[panel, :, col].unsqueeze(-1)
        return values.view(len(ids), self.in_features)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight [out, in] the kernel multiplies by (the reference of the tests), computed
        in float64 and rounded once to ``dtype``."""
        if self.format in ("bf16", "fp16", "bf16_vnni"):
            values = self.codes.double()  # [P, in, 64]
            if self.format == "bf16":  # [P, in, 32, 2] pairs -> [P, in, 64] in column order
                values = _pair_columns(values, undo=True)
            elif self.format == "bf16_vnni":  # [P, in / 2, 64 x 2] k pairs -> [P, in, 64]
                values = _from_kgroups(values, self.in_features, 2)
        else:
            if self.format == "q5":
                codes = _q5_codes(self.codes, self.in_features)
            else:
                codes = _from_kgroups(self.codes, self.in_features, 4)  # [P, in, 64 or 32]
            if self.format == "q4":
                codes = torch.cat((codes & 15, codes >> 4), dim=-1)  # [P, in, 64]
            # [P, in / G, 64] -> [P, in, 64]: each group's row repeated over its G inputs.
            scales = self.scales.double().repeat_interleave(self.group_size, dim=1)
            values = codes.double() * scales
            if self.offsets is not None:
                values = values + self.offsets.double().repeat_interleave(self.group_size, dim=1)
        # [P, in, 64] -> [P * 64, in] -> the real rows
        rows = values.transpose(1, 2).reshape(-1, self.in_features)[:self.out_features]
        return rows.to(dtype)


def _pair_columns(panels: torch.Tensor, undo: bool = False) -> torch.Tensor:
    """[..., 64] in column order -> bf16's pairs (column j at 2j, column j + 32 at 2j + 1):
    [..., 2, 32] -> [..., 32, 2]; ``undo``: back."""
    shape = panels.shape
    rows, cols = (PANEL // 2, 2) if undo else (2, PANEL // 2)
    return panels.reshape(*shape[:-1], rows, cols).transpose(-1, -2).reshape(shape)


def _to_panels(matrix: torch.Tensor) -> torch.Tensor:
    """[out, cols] -> [ceil(out / 64), cols, 64] contiguous, zero rows padding the last panel."""
    out_features, cols = matrix.shape
    padded = torch.cat((matrix, matrix.new_zeros(-out_features % PANEL, cols)))
    return padded.view(-1, PANEL, cols).transpose(1, 2).contiguous()


def _to_kgroups(panels: torch.Tensor, n: int) -> torch.Tensor:
    """[P, in, width] -> [P, ceil(in / n), width * n]: each column's n consecutive k adjacent
    (q8/q4's quads: n = 4; bf16's pairs: n = 2), zero k padding the last group."""
    num_panels, cols, width = panels.shape
    padded = torch.cat((panels, panels.new_zeros(num_panels, -cols % n, width)), dim=1)
    # [P, in / n, n (k), width] -> [P, in / n, width, n (k)]
    return padded.view(num_panels, -1, n, width).transpose(2, 3).reshape(num_panels, -1, width * n)


def _from_kgroups(groups: torch.Tensor, cols: int, n: int) -> torch.Tensor:
    """_to_kgroups undone: [P, in / n, width * n] -> [P, in, width]."""
    num_panels, num_groups, group_width = groups.shape
    per_k = groups.view(num_panels, num_groups, group_width // n, n).transpose(2, 3)
    return per_k.reshape(num_panels, num_groups * n, group_width // n)[:, :cols]


# q5's plane: 32 bytes after a quad's 128 nibble bytes; the fifth bit of nibble h (0 low, 1
# high) of nibble byte b is bit 2 (b // 32) + h of plane byte b % 32 (csrc/quant_gemm.cpp's
# Q5Panels: so a vector's fifth bits lie at one bit position).
_Q5_PLANE = 32


def _q5_codes(quads: torch.Tensor, cols: int) -> torch.Tensor:
    """q5 panels [P, in / 4, 160] -> codes [P, in, 64] int16 (-16..15)."""
    nibbles = _from_kgroups(quads[..., :2 * PANEL], cols, 4)  # [P, in, 32]
    num_panels, num_quads, _ = quads.shape
    plane = quads[..., 2 * PANEL:]  # [P, in / 4, 32]
    halves = []
    for h in (0, 1):
        runs = [(plane >> (2 * run + h)) & 1 for run in range(4)]  # each [P, in / 4, 32]
        fifth = _from_kgroups(torch.cat(runs, dim=2), cols, 4)  # nibble byte b = 32 * run + byte
        halves.append(((nibbles >> (4 * h)) & 15).to(torch.int16) + 16 * fifth.to(torch.int16) - 16)
    return torch.cat(halves, dim=-1)


def _integer_codes(fmt: str, codes: np.ndarray | torch.Tensor, low: int, high: int) -> torch.Tensor:
    """``codes`` as a tensor, after checking they are integers in ``low..high``."""
    codes_t = torch.as_tensor(codes)
    if codes_t.dtype.is_floating_point or codes_t.dtype.is_complex or codes_t.dtype == torch.bool:
        raise ModelLoadError(f"{fmt} codes must be integers {low}..{high}, got {codes_t.dtype}")
    if codes_t.numel() and not (int(codes_t.min()) >= low and int(codes_t.max()) <= high):
        raise ModelLoadError(f"{fmt} codes must lie in {low}..{high}")
    return codes_t


def _check_groups(fmt: str, codes: torch.Tensor, scales: np.ndarray | torch.Tensor,
                  offsets: np.ndarray | torch.Tensor | None,
                  group_size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """scales and offsets as float32 tensors, after checking their shapes against the codes'."""
    if codes.dim() != 2:
        raise ModelLoadError(f"{fmt} codes must be a 2-D [out, in] array, got {tuple(codes.shape)}")
    out_features, in_features = codes.shape
    if group_size <= 0 or in_features % group_size:
        raise ModelLoadError(f"{fmt} group size {group_size} does not divide the input size "
                             f"{in_features}; supported: a positive divisor")
    expected = (out_features, in_features // group_size)
    tensors = []
    for name, array in (("scales", scales), ("offsets", offsets)):
        if array is None:
            tensors.append(None)
            continue
        tensor = torch.as_tensor(array)
        if tuple(tensor.shape) != expected or not tensor.dtype.is_floating_point:
            raise ModelLoadError(f"{fmt} {name} must be floats shaped {expected} (out, in / "
                                 f"group size), got {tensor.dtype} {tuple(tensor.shape)}")
        tensors.append(tensor.float())
    if tensors[0] is None:
        raise ModelLoadError(f"{fmt} needs scales")
    return tensors[0], tensors[1]


"""A linear layer's weight held in a format other than float32, in the panels of pagedllm's CPU
linear kernel (csrc/quant_gemm.cpp; the layout is described there and below).

Six formats, named by ``QuantizedWeight.format``:

- ``"bf16"``, ``"fp16"``: the weight's own 16-bit values, widened to float32 in registers;
- ``"q8"``: int8 codes, a scale per group of ``group_size`` input elements of an output row,
  and optionally an offset: ``value = code * scale (+ offset)``;
- ``"q4"``: codes 0..15 (two per byte), scale and optional offset per group, the same formula;
- ``"q5"``: codes -16..15 (q4's nibbles and a plane of fifth bits), the same formula;
- ``"q6"``: codes -32..31 (q4's nibbles and a plane of bit pairs), the same formula.

These block layouts hold every GGUF block type and AWQ/GPTQ exactly (dequantizing them is
exact in float32 up to the last rounding of ``code * scale + offset``; the loaders compute each
``scale`` and ``offset`` from the file's own fields):

===========  ======  ==========  =======================  ============================
source       layout  group_size  scale                    offset
===========  ======  ==========  =======================  ============================
Q8_0         q8      32          d                        None
Q6_K         q6      16          d * sc (codes -32..31)   None
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
holds it in 0.6875 bytes a weight, as GGUF does (q8 took 1.125). Q5_1 and Q5_K keep q8: their
codes are 0..31 with an offset, and moving them to -16..15 would round the offset once.

Scales and offsets are held in the smallest of three forms that keeps every float exact
(``_group_panels``; csrc/group_scales.h reads them): float16 where every value is one (the d of
Q8_0, Q4_0, Q5_0 ...: 2 bytes per group), GGUF's K-quant records where the loader hands
``GroupScales`` (an fp16 d per 256 k and an int8 multiplier per group: d * sc and -dmin * m,
products no 16-bit float holds), else float32 (AWQ/GPTQ's -z * s). A Q4_K weight then costs
0.578 bytes (the file: 0.5625), a Q6_K one held as q8 1.07 (with float32 scales: 1.25).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Union

import numpy as np
import torch

from pagedllm.errors import ModelLoadError

PANEL = 64  # output columns per panel (kPanel in csrc/skinny_gemm.cpp)
# The format names, once: 16-bit weights (bf16_vnni: bf16 in the AMX tiles' layout) and
# block-quantized codes.
HALF_FORMATS = ("bf16", "fp16", "bf16_vnni")
BLOCK_FORMATS = ("q8", "q4", "q5", "q6")
FORMATS = HALF_FORMATS + BLOCK_FORMATS
_HALF_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass(frozen=True)
class GroupScales:
    """One float per group of G input elements of each output row (a weight's scales, or its
    offsets), as ``d`` per super-block of ``per_super`` groups times an integer ``multipliers``
    per group: ``value[r, j] = d[r, j // per_super] * multipliers[r, j]``, or ``d`` itself
    (``multipliers`` None, one group per super-block). GGUF's K-quants come so: an fp16 d (and
    dmin) per 256 inputs and 6- or 8-bit multipliers per group of 32 or 16; the kernel keeps
    them so (csrc/group_scales.h), the values being exact in float32 either way."""

    d: np.ndarray                           # [rows, groups / per_super] float16 or float32
    multipliers: np.ndarray | None = None   # [rows, groups] int8, or None

    @property
    def per_super(self) -> int:
        return 1 if self.multipliers is None else self.multipliers.shape[1] // self.d.shape[1]

    def values(self) -> np.ndarray:
        """float32 [rows, groups] (the products are exact: an fp16 times an int8)."""
        d = np.asarray(self.d, dtype=np.float32)
        if self.multipliers is None:
            return d
        return np.repeat(d, self.per_super, axis=1) * np.asarray(self.multipliers, dtype=np.float32)

    def rows(self, index: np.ndarray | slice) -> GroupScales:
        return GroupScales(self.d[index], None if self.multipliers is None else self.multipliers[index])

    def groups(self, start: int, stop: int) -> GroupScales:
        """Groups ``start:stop`` of every row: whole super-blocks keep the form, a cut one
        makes them plain floats."""
        n = self.per_super
        if start % n or stop % n:
            return GroupScales(self.values()[:, start:stop])
        return GroupScales(self.d[:, start // n:stop // n],
                           None if self.multipliers is None else self.multipliers[:, start:stop])

    def split(self, n: int) -> GroupScales:
        """Each group as ``n`` groups of the same float (the groups of a size ``n`` times smaller)."""
        if n == 1:
            return self
        if self.multipliers is None:
            return GroupScales(np.repeat(self.d, n, axis=1))
        return GroupScales(self.d, np.repeat(self.multipliers, n, axis=1))

    def zeros(self, rows: int) -> GroupScales:
        """``rows`` rows of zeros in this form."""
        return GroupScales(np.zeros((rows, self.d.shape[1]), self.d.dtype),
                           None if self.multipliers is None
                           else np.zeros((rows, self.multipliers.shape[1]), np.int8))

    @staticmethod
    def concat(parts: list[GroupScales]) -> GroupScales:
        """The parts' rows stacked: in their form if they share one, else as plain floats."""
        form = {(p.per_super, np.asarray(p.d).dtype, p.multipliers is None) for p in parts}
        if len(form) > 1:
            return GroupScales(np.concatenate([p.values() for p in parts]))
        return GroupScales(np.concatenate([p.d for p in parts]),
                           None if parts[0].multipliers is None
                           else np.concatenate([p.multipliers for p in parts]))


# What a loader passes as a weight's scales or offsets: plain floats [out, in / G], or GroupScales.
Groupwise = Union[np.ndarray, torch.Tensor, GroupScales]


@dataclass(frozen=True)
class QuantizedWeight:
    """A weight [out_features, in_features] as panels: bf16/fp16 ``codes`` [P, in, 64] (bf16's
    columns in pairs: column j at 2j, column j + 32 at 2j + 1, each pair one float's worth of
    bits the kernel widens with one shift or one mask; fp16 in column order); bf16_vnni, the
    AMX path's bf16 (``to_vnni``: Intel's VNNI pairs in whole AMX tiles), [P, ceil(in / 32),
    2048]: per k block of 32, the panel's 4 column tiles one after the other, each [16 pair rows
    q][16 columns c][2]: column 16t + c's k = 32b + 2q + i at (t, q, c, i) of block b, zero k
    padding in to whole blocks; q8/q4
    codes in quad blocks, a column's 4 consecutive k in adjacent bytes (the int8-activation
    path's integer dot products read them as they lie, the float path picks one byte of four):
    q8 [P, ceil(in / 4), 64 x 4] int8, q4 [P, ceil(in / 4), 32 x 4] bytes, byte 4j + i of a
    quad holding column j (k = 4q + i) low and column j + 32 high; q5 [P, ceil(in / 4), 160]
    and q6 [P, ceil(in / 4), 192] bytes, q4's quad of the codes + 16 (+ 32: their low 4 bits)
    and 32 (64) bytes of their high bits (``_HIGH_BITS``). ``scales`` and ``offsets`` float32 or
    float16 [P, in / group_size, 64],
    or uint8 super-block records [P, in / S, 64 x (2 + S / group_size)] (``_group_panels``;
    None for bf16/fp16; offsets None: no offset). Zero rows pad the last panel, zero codes the
    last quad."""

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
        blocks = _to_vnni_blocks(columns.reshape(-1, *columns.shape[-2:]))
        return dataclasses.replace(self, format="bf16_vnni",
                                   codes=blocks.reshape(*columns.shape[:-2], *blocks.shape[1:]))

    @classmethod
    def from_q8(cls, codes: np.ndarray | torch.Tensor, scales: Groupwise,
                offsets: Groupwise | None, group_size: int) -> QuantizedWeight:
        """int8 ``codes`` [out, in], float ``scales`` (and ``offsets`` or None) [out, in /
        group_size]: ``W[n, k] = codes[n, k] * scales[n, k // G] (+ offsets[n, k // G])``."""
        codes_t = torch.as_tensor(codes)
        if codes_t.dtype != torch.int8:
            raise ModelLoadError(f"q8 codes must be int8, got {codes_t.dtype}")
        scales_t, offsets_t = _check_groups("q8", codes_t, scales, offsets, group_size)
        return cls("q8", *codes_t.shape, _to_kgroups(_to_panels(codes_t), 4), scales_t,
                   offsets_t, group_size)

    @classmethod
    def from_q4(cls, codes: np.ndarray | torch.Tensor, scales: Groupwise,
                offsets: Groupwise | None, group_size: int) -> QuantizedWeight:
        """``codes`` [out, in] of values 0..15 (any integer dtype, one code per element), float
        ``scales`` (and ``offsets`` or None) [out, in / group_size], as for from_q8."""
        codes_t = _integer_codes("q4", codes, 0, 15)
        scales_t, offsets_t = _check_groups("q4", codes_t, scales, offsets, group_size)
        panels = _to_panels(codes_t.to(torch.uint8))  # [P, in, 64]
        half = PANEL // 2
        packed = panels[..., :half] | (panels[..., half:] << 4)  # [P, in, 32]
        return cls("q4", *codes_t.shape, _to_kgroups(packed, 4), scales_t,
                   offsets_t, group_size)

    @classmethod
    def from_q5(cls, codes: np.ndarray | torch.Tensor, scales: Groupwise,
                offsets: Groupwise | None, group_size: int) -> QuantizedWeight:
        """``codes`` [out, in] of values -16..15 (any integer dtype), float ``scales`` (and
        ``offsets`` or None) [out, in / group_size], as for from_q8."""
        return cls._with_high_bits("q5", 1, codes, scales, offsets, group_size)

    @classmethod
    def from_q6(cls, codes: np.ndarray | torch.Tensor, scales: Groupwise,
                offsets: Groupwise | None, group_size: int) -> QuantizedWeight:
        """``codes`` [out, in] of values -32..31 (any integer dtype; GGUF's Q6_K), float
        ``scales`` (and ``offsets`` or None) [out, in / group_size], as for from_q8."""
        return cls._with_high_bits("q6", 2, codes, scales, offsets, group_size)

    @classmethod
    def _with_high_bits(cls, fmt: str, bits: int, codes: np.ndarray | torch.Tensor,
                        scales: Groupwise, offsets: Groupwise | None,
                        group_size: int) -> QuantizedWeight:
        """q5 (``bits`` 1) or q6 (2): the codes + 8 << bits as q4's nibbles and a plane of
        their ``bits`` high bits (``_high_bit_rule``)."""
        bias = 8 << bits
        codes_t = _integer_codes(fmt, codes, -bias, bias - 1)
        scales_t, offsets_t = _check_groups(fmt, codes_t, scales, offsets, group_size)
        biased = _to_panels((codes_t.to(torch.int16) + bias).to(torch.uint8))  # [P, in, 64]
        half = PANEL // 2
        nibbles = _to_kgroups((biased[..., :half] & 15) | ((biased[..., half:] & 15) << 4), 4)
        num_panels, num_quads, _ = nibbles.shape
        width = 32 * bits
        plane = torch.zeros(num_panels, num_quads, width, dtype=torch.uint8)
        for h in (0, 1):  # low (h = 0) and high (h = 1) columns, by nibble byte b (0..127)
            high = _to_kgroups(biased[..., h * half:(h + 1) * half] >> 4, 4)
            by_run = high.view(num_panels, num_quads, 2 * PANEL // width, width)
            for run in range(2 * PANEL // width):  # b = width * run + plane byte
                plane |= by_run[:, :, run] << (bits * (2 * run + h))
        return cls(fmt, *codes_t.shape, torch.cat((nibbles, plane), dim=2), scales_t,
                   offsets_t, group_size)

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
        num_groups = first.in_features // max(first.group_size, 1)

        def stacked(name: str) -> torch.Tensor | None:
            tensors = [getattr(w, name) for w in weights]
            if tensors[0] is None:
                return None
            if len({(t.dtype, t.shape) for t in tensors}) > 1:  # experts' group floats in
                # different forms (one's all fp16, another's not): float32 for every one
                tensors = [_group_values(t, num_groups) for t in tensors]
            return torch.stack(tensors)
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
        if self.format == "bf16_vnni":  # column 16t + c at (t, q, c, i) of each k block
            tiles = self.codes.view(*self.codes.shape[:2], *_VNNI_TILES)
            pairs = tiles[panel, :, col // _VNNI_COLS, :, col % _VNNI_COLS]  # [T, in / 32, 16, 2]
            return pairs.reshape(len(ids), -1)[:, :self.in_features]
        num_panels, num_quads, width = self.codes.shape
        if self.format == "q8":  # [P, in / 4, 64, 4]: column c's 4 k together
            codes = self.codes.view(num_panels, num_quads, PANEL, 4)[panel, :, col]
        else:  # q4/q5/q6: byte 4j + i holds column j low, column j + 32 high
            half = PANEL // 2
            high = (col >= half).to(torch.uint8).view(-1, 1, 1)
            lanes = self.codes.view(num_panels, num_quads, width // 4, 4)  # q5: 32 + 8 lanes
            codes = (lanes[panel, :, col % half] >> high * 4) & 15  # [T, in / 4, 4]
            bits = _HIGH_BITS.get(self.format)
            if bits:  # byte b = 4 (col % 32) + i: _high_bit_rule
                per_run = 8 * bits  # columns whose nibble bytes one run of the plane covers
                shift = (bits * (2 * (col % half // per_run))).to(torch.uint8).view(-1, 1, 1)
                upper = (lanes[panel, :, half + col % half % per_run] >> (shift + bits * high))
                upper = upper & ((1 << bits) - 1)
                codes = codes.to(torch.int16) + 16 * upper.to(torch.int16) - (8 << bits)
        codes = codes.reshape(len(ids), -1)[:, :self.in_features].float()  # [T, in]
        num_groups = self.in_features // self.group_size
        rows = torch.arange(len(ids))

        def of_rows(t: torch.Tensor) -> torch.Tensor:  # [T, groups, 1]: the ids' group floats
            return _group_values(t[panel], num_groups)[rows, :, col].unsqueeze(-1)

        values = codes.view(len(ids), num_groups, self.group_size) * of_rows(self.scales)
        if self.offsets is not None:
            values += of_rows(self.offsets)
        return values.view(len(ids), self.in_features)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight [out, in] the kernel multiplies by (the reference of the tests), computed
        in float64 and rounded once to ``dtype``."""
        if self.format in HALF_FORMATS:
            values = self.codes.double()  # [P, in, 64]
            if self.format == "bf16":  # [P, in, 32, 2] pairs -> [P, in, 64] in column order
                values = _pair_columns(values, undo=True)
            elif self.format == "bf16_vnni":  # [P, in / 32, 2048] tiles -> [P, in, 64]
                values = _from_vnni_blocks(values, self.in_features)
        else:
            if self.format in _HIGH_BITS:
                codes = _high_bit_codes(self.codes, self.in_features, _HIGH_BITS[self.format])
            else:
                codes = _from_kgroups(self.codes, self.in_features, 4)  # [P, in, 64 or 32]
            if self.format == "q4":
                codes = torch.cat((codes & 15, codes >> 4), dim=-1)  # [P, in, 64]
            # [P, in / G, 64] -> [P, in, 64]: each group's row repeated over its G inputs.
            num_groups = self.in_features // self.group_size

            def per_input(t: torch.Tensor) -> torch.Tensor:
                return _group_values(t, num_groups).double().repeat_interleave(self.group_size, dim=1)

            values = codes.double() * per_input(self.scales)
            if self.offsets is not None:
                values = values + per_input(self.offsets)
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
    (q8/q4's quads: n = 4), zero k padding the last group."""
    num_panels, cols, width = panels.shape
    padded = torch.cat((panels, panels.new_zeros(num_panels, -cols % n, width)), dim=1)
    # [P, in / n, n (k), width] -> [P, in / n, width, n (k)]
    return padded.view(num_panels, -1, n, width).transpose(2, 3).reshape(num_panels, -1, width * n)


def _from_kgroups(groups: torch.Tensor, cols: int, n: int) -> torch.Tensor:
    """_to_kgroups undone: [P, in / n, width * n] -> [P, in, width]."""
    num_panels, num_groups, group_width = groups.shape
    per_k = groups.view(num_panels, num_groups, group_width // n, n).transpose(2, 3)
    return per_k.reshape(num_panels, num_groups * n, group_width // n)[:, :cols]


# bf16_vnni: a k block of 32 of a panel is [4 column tiles t][16 pair rows q][16 columns c][2
# k i], so each B tile of AMX's bf16 tile product (16 pair rows of 16 columns' k pairs) is 1 KiB
# that lies in one piece, and a panel is read in order, one block after another (csrc/bf16_gemm.h:
# with pair rows across the panel, each tile's 16 rows 256 bytes apart, a MoE layer's experts
# streamed at 0.84-0.93x).
_VNNI_BLOCK_K = 32
_VNNI_COLS = 16
_VNNI_TILES = (PANEL // _VNNI_COLS, _VNNI_BLOCK_K // 2, _VNNI_COLS, 2)  # (t, q, c, i)


def _to_vnni_blocks(panels: torch.Tensor) -> torch.Tensor:
    """[P, in, 64] in column order -> [P, ceil(in / 32), 2048], bf16_vnni's tiles (zero k
    padding the last block)."""
    num_panels, cols, _ = panels.shape
    padded = torch.cat((panels, panels.new_zeros(num_panels, -cols % _VNNI_BLOCK_K, PANEL)), dim=1)
    # [P, b, q, i, t, c] -> [P, b, t, q, c, i]
    per_k = padded.view(num_panels, -1, _VNNI_BLOCK_K // 2, 2, PANEL // _VNNI_COLS, _VNNI_COLS)
    return per_k.permute(0, 1, 4, 2, 5, 3).reshape(num_panels, -1, _VNNI_BLOCK_K * PANEL)


def _from_vnni_blocks(blocks: torch.Tensor, cols: int) -> torch.Tensor:
    """_to_vnni_blocks undone: [P, in / 32, 2048] -> [P, in, 64]."""
    num_panels, num_blocks, _ = blocks.shape
    tiles = blocks.view(num_panels, num_blocks, *_VNNI_TILES)  # [P, b, t, q, c, i]
    per_k = tiles.permute(0, 1, 3, 5, 2, 4)  # [P, b, q, i, t, c]
    return per_k.reshape(num_panels, num_blocks * _VNNI_BLOCK_K, PANEL)[:, :cols]


# q5 and q6 hold a code + 8 << bits (0..31, 0..63) as q4's 128 nibble bytes and a plane of
# its ``bits`` high bits (q5: 1, q6: 2), 32 x bits bytes: those of nibble h (0 low, 1 high) of
# nibble byte b lie at bits * (2 run + h) of plane byte b % width, run = b // width (width = 32
# x bits). So a vector's high bits lie at one bit position of the plane's bytes
# (csrc/quant_gemm.cpp's HighBitPanels).
_HIGH_BITS = {"q5": 1, "q6": 2}


def _high_bit_codes(quads: torch.Tensor, cols: int, bits: int) -> torch.Tensor:
    """q5/q6 panels [P, in / 4, 128 + 32 x bits] -> codes [P, in, 64] int16."""
    nibbles = _from_kgroups(quads[..., :2 * PANEL], cols, 4)  # [P, in, 32]
    plane = quads[..., 2 * PANEL:]  # [P, in / 4, width]
    width, mask = 32 * bits, (1 << bits) - 1
    halves = []
    for h in (0, 1):
        runs = [(plane >> (bits * (2 * run + h))) & mask for run in range(2 * PANEL // width)]
        upper = _from_kgroups(torch.cat(runs, dim=2), cols, 4)  # nibble byte b = width * run + byte
        halves.append(((nibbles >> (4 * h)) & 15).to(torch.int16) + 16 * upper.to(torch.int16)
                      - (8 << bits))
    return torch.cat(halves, dim=-1)


def _integer_codes(fmt: str, codes: np.ndarray | torch.Tensor, low: int, high: int) -> torch.Tensor:
    """``codes`` as a tensor, after checking they are integers in ``low..high``."""
    codes_t = torch.as_tensor(codes)
    if codes_t.dtype.is_floating_point or codes_t.dtype.is_complex or codes_t.dtype == torch.bool:
        raise ModelLoadError(f"{fmt} codes must be integers {low}..{high}, got {codes_t.dtype}")
    if codes_t.numel() and not (int(codes_t.min()) >= low and int(codes_t.max()) <= high):
        raise ModelLoadError(f"{fmt} codes must lie in {low}..{high}")
    return codes_t


def _check_groups(fmt: str, codes: torch.Tensor, scales: np.ndarray | torch.Tensor | GroupScales,
                  offsets: np.ndarray | torch.Tensor | GroupScales | None,
                  group_size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """scales and offsets in the kernel's form (``_group_panels``), after checking their shapes
    against the codes'."""
    if codes.dim() != 2:
        raise ModelLoadError(f"{fmt} codes must be a 2-D [out, in] array, got {tuple(codes.shape)}")
    out_features, in_features = codes.shape
    if group_size <= 0 or in_features % group_size:
        raise ModelLoadError(f"{fmt} group size {group_size} does not divide the input size "
                             f"{in_features}; supported: a positive divisor")
    if scales is None:
        raise ModelLoadError(f"{fmt} needs scales")
    expected = (out_features, in_features // group_size)
    return (_group_panels(fmt, "scales", scales, expected),
            None if offsets is None else _group_panels(fmt, "offsets", offsets, expected))


def _group_panels(fmt: str, name: str, value: np.ndarray | torch.Tensor | GroupScales,
                  expected: tuple[int, int]) -> torch.Tensor:
    """A weight's group floats ([out, in / G], plain or as GroupScales) in the smallest of the
    kernel's forms that holds each exactly (csrc/group_scales.h): super-block records
    [P, groups / S, 64 x (2 + S)] uint8 (fp16 d, then S rows of int8 multipliers) where d is
    an fp16 and a super-block spans 2, 4, 8 ... groups; else float16 [P, groups, 64] where every
    float is an fp16; else float32."""
    scales = value if isinstance(value, GroupScales) else GroupScales(value)
    d = torch.as_tensor(scales.d)
    shape_error = ModelLoadError(
        f"{fmt} {name} must be floats shaped {expected} (out, in / group size), or GroupScales "
        f"of int8 multipliers so shaped, got {d.dtype} {tuple(d.shape)}")
    if scales.multipliers is not None:
        multipliers = torch.as_tensor(scales.multipliers)
        per_super = scales.per_super
        if (multipliers.dtype != torch.int8 or tuple(multipliers.shape) != expected
                or not d.dtype.is_floating_point or d.dim() != 2 or d.shape[0] != expected[0]
                or per_super < 1 or d.shape[1] * per_super != expected[1]):
            raise shape_error
        # records where a super-block spans several groups, a power of two of them (the
        # kernel finds a group's record by a shift)
        if per_super > 1 and per_super & (per_super - 1) == 0 and _exact_half(d):
            records = _to_panels(d.half()).view(torch.uint8)  # [P, supers, 128]
            rows = _to_panels(multipliers).view(records.shape[0], records.shape[1], -1)
            return torch.cat((records, rows.view(torch.uint8)), dim=2).contiguous()
        d = torch.as_tensor(scales.values())
    if tuple(d.shape) != expected or not d.dtype.is_floating_point:
        raise shape_error
    d = d.float()
    return _to_panels(d.half() if _exact_half(d) else d)


def _exact_half(t: torch.Tensor) -> bool:
    """Whether every value of ``t`` is a float16 (NaN is not)."""
    return t.dtype == torch.float16 or torch.equal(t.float().half().float(), t.float())


def _group_values(t: torch.Tensor, num_groups: int) -> torch.Tensor:
    """The kernel's group floats ``[..., groups or supers, width]`` (``_group_panels``'s forms)
    -> float32 ``[..., groups, 64]``."""
    if t.dtype != torch.uint8:
        return t.float()
    supers = t.shape[-2]
    d = t[..., :2 * PANEL].contiguous().view(torch.float16).float()  # [..., supers, 64]
    multipliers = t[..., 2 * PANEL:].contiguous().view(torch.int8)
    multipliers = multipliers.reshape(*t.shape[:-2], supers, -1, PANEL).float()  # [.., S, n, 64]
    return (d.unsqueeze(-2) * multipliers).reshape(*t.shape[:-2], num_groups, PANEL)

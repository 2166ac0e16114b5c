"""Block-wise symmetric quantization of what crosses between hosts (ZeRO++'s quantized weights and gradients).

A flat tensor is cut into blocks of :data:`BLOCK` elements; each block keeps one fp32 scale (its largest magnitude
over the largest level) and its elements as whole levels in ``[-levels, levels]``: int8 (127 levels, a byte an
element) or int4 (7 levels, two elements a byte). One packed ``uint8`` buffer holds the levels, then the scales, so a
collective moves a single tensor. Rounding to the nearest level bounds each element's error by half its block's step:
``|x - dequantize(quantize(x))| <= absmax(block) / (2 * levels)``. A block holding an infinity or a NaN dequantizes to
non-finite values throughout, so that a loss scaler still sees the overflow.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 256  # elements per scale: the scales add 4 / 256 bytes an element (1.6% of int8)


@dataclass(frozen=True)
class Format:
    """Levels on each side of zero and elements per byte."""

    bits: int

    @property
    def levels(self) -> int:
        return 2 ** (self.bits - 1) - 1

    @property
    def per_byte(self) -> int:
        return 8 // self.bits

    def packed_bytes(self, numel: int) -> int:
        """Bytes of the packed form of ``numel`` elements (padded to whole blocks)."""
        blocks = -(-numel // BLOCK)
        return blocks * BLOCK // self.per_byte + blocks * 4


INT8 = Format(8)
INT4 = Format(4)


def quantize(rows: torch.Tensor, form: Format) -> torch.Tensor:
    """``rows`` (2-D, floating) packed row by row: a ``uint8`` tensor of ``form.packed_bytes(rows.shape[1])`` bytes
    per row."""
    count, numel = rows.shape
    blocks = -(-numel // BLOCK)
    values = rows.float()
    if blocks * BLOCK != numel:
        values = torch.nn.functional.pad(values, (0, blocks * BLOCK - numel))
    values = values.reshape(count, blocks, BLOCK)
    # the largest magnitude without a tensor of magnitudes; NaN and infinity carry into the scale
    absmax = torch.maximum(values.amax(dim=2, keepdim=True), values.amin(dim=2, keepdim=True).neg())
    scales = absmax / form.levels
    inverse = torch.where(absmax > 0, form.levels / absmax, torch.zeros_like(absmax))  # an all-zero block stays zero
    # |value * inverse| <= levels by construction (a product one ulp above rounds to the level itself): no clamp
    levels = torch.mul(values, inverse).round_().to(torch.int8).view(count, -1)
    packed = torch.empty(count, form.packed_bytes(numel), dtype=torch.uint8, device=rows.device)
    payload = blocks * BLOCK // form.per_byte
    if form.per_byte == 1:
        packed[:, :payload] = levels.view(torch.uint8)
    else:  # two levels a byte, each offset into [1, 15]
        shifted = levels.add_(8).view(torch.uint8)
        packed[:, :payload] = shifted[:, 0::2] | (shifted[:, 1::2] << 4)
    packed[:, payload:] = scales.view(count, blocks).view(torch.uint8)
    return packed


def dequantize(packed: torch.Tensor, form: Format, out: torch.Tensor) -> torch.Tensor:
    """Unpack ``packed`` (2-D, as :func:`quantize` made it) into ``out`` (2-D, ``packed``'s rows of ``out.shape[1]``
    elements, any floating dtype); returns ``out``."""
    count, numel = out.shape
    blocks = -(-numel // BLOCK)
    payload = blocks * BLOCK // form.per_byte
    scales = packed[:, payload:].contiguous().view(torch.float32).view(count, blocks, 1)
    if form.per_byte == 1:
        levels = packed[:, :payload].view(torch.int8)
    else:
        low, high = packed[:, :payload] & 0x0F, packed[:, :payload] >> 4
        levels = torch.stack((low, high), dim=2).view(count, -1).to(torch.int8).sub_(8)
    levels = levels.view(count, blocks, BLOCK)
    if numel == blocks * BLOCK and out.dtype == torch.float32 and out.is_contiguous():
        in_place = out.view(count, blocks, BLOCK)  # no temporary: converted, then scaled, where it stays
        in_place.copy_(levels).mul_(scales)
        return out
    out.copy_(levels.float().mul_(scales).view(count, -1)[:, :numel])
    return out

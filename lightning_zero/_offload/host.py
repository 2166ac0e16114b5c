"""Host memory for offloaded state: copies of device tensors carved out of a few large (pinned) allocations."""

from __future__ import annotations

from typing import Any

import torch

from lightning_zero._grouping import group_by


def host_copies(tensors: list[torch.Tensor], dtype: torch.dtype | None, pin: bool) -> list[torch.Tensor]:
    """Host copies of ``tensors`` (in ``dtype``, or each one's own), carved out of a few large allocations per dtype
    rather than one per tensor (see :func:`pinned_views` for the pinned case)."""
    copies: list[torch.Tensor | None] = [None] * len(tensors)
    by_dtype = group_by(range(len(tensors)), lambda i: dtype or tensors[i].dtype)
    for same_dtype, indices in by_dtype.items():
        numels = [tensors[i].numel() for i in indices]
        if pin:
            parts = pinned_views(numels, same_dtype)
        else:
            parts = list(torch.empty(sum(numels), dtype=same_dtype).split(numels))
        for index, part in zip(indices, parts, strict=True):
            source = tensors[index]
            copies[index] = part.view(source.shape).copy_(source)
    return copies  # type: ignore[return-value]


def pinned_views(numels: list[int], dtype: torch.dtype) -> list[torch.Tensor]:
    """Pinned 1D views of ``numels`` elements each, packed into blocks whose sizes are powers of two: the pinned
    allocator rounds every request up to one, so a single block of 4.3 GB would hold 8 GB of host memory. Largest
    first, each new block is the largest power of two the remaining elements fill (or the tensor's own, rounded up)."""
    views: list[torch.Tensor | None] = [None] * len(numels)
    remaining = sum(numels)
    blocks: list[list[Any]] = []  # [block, elements used]
    for index in sorted(range(len(numels)), key=lambda i: -numels[i]):
        numel = numels[index]
        block = next((b for b in blocks if b[0].numel() - b[1] >= numel), None)
        if block is None:
            size = max(1 << (remaining.bit_length() - 1), 1 << max(numel - 1, 0).bit_length())
            block = [torch.empty(size, dtype=dtype, pin_memory=True), 0]
            blocks.append(block)
        views[index] = block[0][block[1] : block[1] + numel]
        block[1] += numel
        remaining -= numel
    return views  # type: ignore[return-value]

"""Reusable flat communication buffers, so a training step does not allocate (and page-fault) bucket-sized memory."""

from __future__ import annotations

import torch


class BufferPool:
    """Free lists of 1D buffers per (dtype, device): a buffer is lent whole, as a view of the size asked for."""

    def __init__(self) -> None:
        self._free: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        self._lent: dict[int, torch.Tensor] = {}  # data_ptr of a lent view -> the whole buffer behind it

    def acquire(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        free = self._free.setdefault((dtype, device), [])
        fitting = [i for i, b in enumerate(free) if b.numel() >= numel]
        if fitting:  # the smallest that fits: a large buffer stays free for a large request
            buffer = free.pop(min(fitting, key=lambda i: free[i].numel()))
        else:
            buffer = torch.empty(numel, dtype=dtype, device=device)
        view = buffer[:numel]
        self._lent[view.data_ptr()] = buffer
        return view

    def release(self, view: torch.Tensor) -> None:
        buffer = self._lent.pop(view.data_ptr())
        self._free[(buffer.dtype, buffer.device)].append(buffer)

    def nbytes(self) -> int:
        """Bytes held by buffers not lent out right now."""
        return sum(b.numel() * b.element_size() for free in self._free.values() for b in free)

    def clear(self) -> None:
        self._free.clear()

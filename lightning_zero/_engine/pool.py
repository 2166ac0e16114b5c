"""Reusable flat communication buffers, so a training step does not allocate (and page-fault) bucket-sized memory."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


class BufferPool:
    """Free lists of 1D buffers per (dtype, device): a buffer is lent whole, as a view of the size asked for."""

    def __init__(self) -> None:
        self._free: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        self._lent: dict[int, torch.Tensor] = {}  # data_ptr of a lent view -> the whole buffer behind it
        self._derived: dict[tuple[int, int, int], object] = {}  # see ``derived``

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

    def derived(self, view: torch.Tensor, owner: object, make: Callable[[torch.Tensor], T]) -> T:
        """``make(view)`` for a lent ``view`` and its ``owner`` (views of it, say), made once per buffer, size and
        owner and kept while the pool keeps its buffers: a step that lays out a bucket in the same buffer again finds
        them made."""
        key = (view.data_ptr(), view.numel(), id(owner))
        made = self._derived.get(key)
        if made is None:
            made = self._derived[key] = make(view)
        return made  # type: ignore[return-value]

    def clear(self) -> None:
        self._free.clear()
        self._derived.clear()

"""Which optimizer kernels a step on shards runs: torch's per-parameter loop is its default on the CPU and for DTensor
shards; the multi-tensor or fused kernels do the same maths much faster."""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim import Optimizer

FUSED_ON_SHARDS = (torch.optim.Adam, torch.optim.AdamW)  # fused kernels that DTensor shards dispatch


@dataclass(frozen=True)
class KernelChoice:
    """The implementation flag (``"foreach"`` or ``"fused"``) a step sets on the groups that left the choice to
    torch, decided once per optimizer; the groups as configured (and as saved) keep their own settings."""

    key: str

    @classmethod
    def on_shards(cls, optimizer: Optimizer, *, host: bool) -> KernelChoice:
        """The multi-tensor kernels (one DTensor dispatch per operation rather than per parameter and operation) or,
        for a step on the host, the fused ones where the optimizer has them for shards (Adam, AdamW) and every
        parameter it holds is on the host (fused kernels want one device). Call it with the shards in the groups."""
        if not host:
            return cls("foreach")
        on_host = all(p.device.type == "cpu" for group in optimizer.param_groups for p in group["params"])
        return cls("fused" if isinstance(optimizer, FUSED_ON_SHARDS) and on_host else "foreach")

    @contextmanager
    def applied(self, optimizer: Optimizer) -> Generator[None, None, None]:
        """Set the flag for the duration of a step. The groups are looked up now: loading a checkpoint replaces
        them."""
        groups = [g for g in optimizer.param_groups if self.key in g and _left_to_torch(g)]
        previous = [group[self.key] for group in groups]
        for group in groups:
            group[self.key] = True
        try:
            yield
        finally:
            for group, value in zip(groups, previous, strict=True):
                group[self.key] = value



def _left_to_torch(group: dict[str, Any]) -> bool:
    return group.get("foreach") is None and not group.get("fused")

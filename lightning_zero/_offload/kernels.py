"""Which optimizer kernels a host step runs: torch's per-parameter loop is its default on the CPU; the multi-tensor or
fused kernels do the same maths much faster."""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

import torch
from torch.optim import Optimizer

_FUSED_ON_SHARDS = (torch.optim.Adam, torch.optim.AdamW)  # fused kernels that DTensor shards dispatch


def host_kernel(optimizer: Optimizer) -> str:
    """The implementation flag a host step sets on groups that left the choice to torch (whose default on the host
    is a loop over parameters): ``"fused"`` where the optimizer has fused CPU kernels for shards (Adam, AdamW) and
    every parameter it holds now is on the host (fused kernels want one device), else ``"foreach"``."""
    on_host = all(p.device.type == "cpu" for group in optimizer.param_groups for p in group["params"])
    return "fused" if isinstance(optimizer, _FUSED_ON_SHARDS) and on_host else "foreach"


def unchosen_groups(groups: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    """The groups that left the implementation to torch and have a ``key`` (``"foreach"`` or ``"fused"``) flag."""
    return [g for g in groups if key in g and g.get("foreach") is None and not g.get("fused")]


@contextmanager
def implementation(groups: list[dict[str, Any]], key: str) -> Generator[None, None, None]:
    """Set ``key`` on ``groups`` for the duration of a step: the same maths with faster kernels, while the groups
    as configured (and as saved) keep their settings."""
    previous = [group[key] for group in groups]
    for group in groups:
        group[key] = True
    try:
        yield
    finally:
        for group, value in zip(groups, previous, strict=True):
            group[key] = value

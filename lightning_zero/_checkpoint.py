"""Optimizer state in checkpoints: whole tensors on disk, this rank's shards in memory."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from lightning_zero._optimizer import ZeroOptimizer

# Names, per parameter index, of the state entries that were sharded like their parameter when saved.
_SHARDED_KEYS = "lightning_zero_sharded_keys"


def full_optimizer_state(optimizer: ZeroOptimizer) -> dict[str, Any]:
    """The optimizer's ``state_dict`` with every sharded tensor gathered whole (a collective call)."""
    state_dict = optimizer.state_dict()
    sharded_keys: dict[int, list[str]] = {}
    full_state: dict[int, dict[str, Any]] = {}
    for index, param_state in state_dict["state"].items():
        full_state[index] = {}  # a new dict: ``state_dict()`` hands out the optimizer's live per-parameter dicts
        for key, value in param_state.items():
            if isinstance(value, DTensor):
                value = value.full_tensor()
                sharded_keys.setdefault(index, []).append(key)
            full_state[index][key] = value
    return {**state_dict, "state": full_state, _SHARDED_KEYS: sharded_keys}


def _was_sharded(key: str, value: object, shape: torch.Size) -> bool:
    """For checkpoints written without this package: a tensor shaped like its parameter was sharded with it."""
    return isinstance(value, torch.Tensor) and value.shape == shape and key != "step"


def load_full_optimizer_state(optimizer: ZeroOptimizer, state_dict: dict[str, Any]) -> None:
    """Load a ``state_dict`` of whole tensors, keeping of each parameter-shaped tensor only my shard."""
    with optimizer.shards_installed():
        params = [p for group in optimizer.param_groups for p in group["params"]]
    by_shard = {id(s.shard): s for s in optimizer.sharded}
    recorded: dict[int, list[str]] | None = state_dict.get(_SHARDED_KEYS)
    state = {}
    for index, param_state in state_dict["state"].items():
        sharded = by_shard.get(id(params[index]))
        converted = dict(param_state)
        if sharded is not None:
            for key, value in param_state.items():
                if recorded is not None:
                    is_sharded = key in recorded.get(index, ())
                else:
                    is_sharded = _was_sharded(key, value, sharded.spec.shape)
                if is_sharded:
                    local = sharded.spec.take(value, sharded.rank).to(sharded.local.device).clone()
                    converted[key] = sharded.wrap(local)
        state[index] = converted
    clean = {k: v for k, v in state_dict.items() if k != _SHARDED_KEYS}
    optimizer.load_state_dict({**clean, "state": state})

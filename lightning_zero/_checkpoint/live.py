"""What goes into a checkpoint and comes back out of one, for the live module and optimizers of any stage.

Saving never gathers: the model state holds each sharded parameter as the DTensor over this rank's rows, and the
optimizer state keeps its DTensor shards; both are named by parameter, so a checkpoint taken at one world size and
stage loads at another (see :mod:`.directory`). Ordinary single-file Lightning
checkpoints (from ``"ddp"``, or consolidated) load too: each rank keeps its shard of every whole tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim import Optimizer

from lightning_zero._checkpoint import directory as ckpt
from lightning_zero._checkpoint import keys
from lightning_zero._checkpoint.error import CheckpointError
from lightning_zero._checkpoint.ranks import Ranks
from lightning_zero._checkpoint.unpickling import Unpickling
from lightning_zero._engine.engine import ZeroEngine
from lightning_zero._engine.optimizer import ZeroOptimizer


def sharded_model_state(module: nn.Module, engine: ZeroEngine | None) -> dict[str, Any]:
    """``module.state_dict()`` with every sharded parameter replaced by the DTensor over this rank's rows. The values
    alias the live tensors, so loading into this dict loads into the module."""
    state = module.state_dict()
    if engine is None:
        return state
    for name, param in module.named_parameters(remove_duplicate=False):
        sharded = engine.by_param.get(id(param))
        if sharded is not None and name in state:
            state[name] = sharded.wrap(sharded.master)  # the fp32 master where there is one
    return state


def _optimizer_tensors(optimizer: Optimizer) -> list[torch.Tensor]:
    """What the optimizer updates, in its state-dict index order: shards for a ZeRO optimizer."""
    if isinstance(optimizer, ZeroOptimizer):
        with optimizer.shards_installed():
            return [p for group in optimizer.param_groups for p in group["params"]]
    return [p for group in optimizer.param_groups for p in group["params"]]


def _module_param_names(optimizer: Optimizer, names: dict[int, str]) -> list[str]:
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def named_optimizer_state(optimizer: Optimizer, module: nn.Module) -> dict[str, Any]:
    """The optimizer's state dict, parameters named rather than numbered, shards left as DTensors."""
    names = _module_param_names(optimizer, keys.module_names(module))
    return keys.named_optimizer_state(optimizer.state_dict(), names)


def save_directory(checkpoint: dict[str, Any], module: nn.Module, path: Path) -> None:
    """Write Lightning's ``checkpoint`` (model and optimizer states as made by this module) as a directory, with every
    rank of the default process group."""
    rest = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
    shapes = {name: p.shape for name, p in module.named_parameters(remove_duplicate=False)}
    model_state, optimizer_states = checkpoint.get("state_dict", {}), checkpoint.get("optimizer_states", [])
    flat, optimizer_meta = keys.flatten(model_state, optimizer_states, shapes)
    ckpt.save(flat, {"checkpoint": rest, **optimizer_meta}, path, Ranks.of_default_group())


# --- loading a checkpoint directory ----------------------------------------------------------------------------------


def load_directory(
    path: Path,
    module: nn.Module,
    engine: ZeroEngine | None,
    optimizers_for: Callable[[dict[str, Any]], list[Optimizer]],
    weights_only: bool | None,
    strict: bool = True,
) -> dict[str, Any]:
    """Load model and optimizer state from a checkpoint directory into the live objects, laid out for this run;
    return the rest of the Lightning checkpoint. ``optimizers_for``: the optimizers to load, given that rest (a
    Fabric checkpoint records their names). ``weights_only`` is the user's, as Lightning passes it on: what the
    pickled files may import (see :class:`~.unpickling.Unpickling`); ``strict``: whether the module's entries and the
    checkpoint's must match, as in ``load_state_dict``."""
    unpickling = Unpickling.from_weights_only(weights_only)
    meta, metadata, shard_check = ckpt.open_checkpoint(path, Ranks.of_default_group(), unpickling)
    # The shard files are checked while they load: nothing below runs before the verdict but filling the live
    # tensors, which a damaged checkpoint leaves to be discarded with the error.
    with shard_check.overlapping():
        optimizers = optimizers_for(meta["checkpoint"])
        model_target = {keys.model_key(k): v for k, v in sharded_model_state(module, engine).items()}
        model_target = ckpt.model_entries_to_load(model_target, metadata, path, _class_name(module), strict)
        targets = [_optimizer_target(i, opt, module, metadata, meta, path) for i, opt in enumerate(optimizers)]
        flat = dict(model_target)
        for target in targets:
            flat.update(target)
        ckpt.check_compatible(flat, metadata, path)
        ckpt.load(flat, path, metadata, unpickling)
    if engine is not None:
        with torch.no_grad():
            engine.module_from_masters()  # and the rows other ranks own
    for index, (optimizer, target) in enumerate(zip(optimizers, targets, strict=True)):
        groups = meta["param_groups"][index]
        optimizer.load_state_dict(_indexed_state(index, optimizer, module, target, groups, path))
    # Lightning insists on the key; the empty list tells ``load_optimizer_state_dict`` all is loaded already.
    return {**meta["checkpoint"], "optimizer_states": []} if optimizers else meta["checkpoint"]


def _class_name(module: nn.Module) -> str:
    """The module's class as the user wrote it (``fully_shard`` makes it a subclass named ``FSDP<name>``)."""
    return next(cls for cls in type(module).__mro__ if not issubclass(cls, FSDPModule)).__name__


def _optimizer_target(
    index: int, optimizer: Optimizer, module: nn.Module, metadata: Metadata, meta: dict[str, Any], path: Path
) -> dict[str, Any]:
    names = _module_param_names(optimizer, keys.module_names(module))
    tensors = _optimizer_tensors(optimizer)
    sharded = meta["sharded"].get(index, {})
    if index not in meta["param_groups"]:
        raise CheckpointError(
            f"Checkpoint {path} holds no state for optimizer {index}. HINT: it was saved with fewer optimizers, or"
            " with `save_weights_only=True`; load it with `strict=False` loading or from a full checkpoint."
        )
    target: dict[str, Any] = {}
    by_name = dict(zip(names, tensors, strict=True))
    for key, fqn, name in keys.optimizer_entries(metadata.state_dict_metadata, index):
        entry = metadata.state_dict_metadata[key]
        if fqn not in by_name:
            raise CheckpointError(
                f"Checkpoint {path} holds optimizer state for `{fqn}`, which optimizer {index} does not update."
                " HINT: load it with the `configure_optimizers` it was trained with."
            )
        if not isinstance(entry, TensorStorageMetadata):
            target[key] = None
        elif name in sharded.get(fqn, ()):
            target[key] = torch.empty_like(by_name[fqn], dtype=entry.properties.dtype)
        else:
            target[key] = torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
    return target


def _indexed_state(
    index: int, optimizer: Optimizer, module: nn.Module, target: dict[str, Any], groups: list[dict], path: Path
) -> dict[str, Any]:
    module_names = keys.module_names(module)
    position = {name: i for i, name in enumerate(_module_param_names(optimizer, module_names))}
    configured = [[module_names[id(p)] for p in group["params"]] for group in optimizer.param_groups]
    if [g["params"] for g in groups] != configured:
        raise CheckpointError(
            f"Checkpoint {path}: the parameter groups of optimizer {index} differ from the ones configured now."
            " HINT: load it with the `configure_optimizers` it was trained with."
        )
    state: dict[int, dict[str, Any]] = {}
    for key, fqn, name in keys.optimizer_entries(target, index):
        state.setdefault(position[fqn], {})[name] = target[key]
    return {"state": state, "param_groups": [{**g, "params": [position[n] for n in g["params"]]} for g in groups]}


# --- loading a single-file checkpoint --------------------------------------------------------------------------------


def load_full_optimizer_state(optimizer: ZeroOptimizer, state_dict: dict[str, Any]) -> None:
    """Load a ``state_dict`` of whole tensors, keeping of each parameter-shaped tensor only my shard."""
    params = _optimizer_tensors(optimizer)
    by_shard = {id(s.shard): s for s in optimizer.sharded}
    recorded: dict[int, list[str]] | None = state_dict.get(keys.SHARDED_KEYS)
    state = {}
    for index, param_state in state_dict["state"].items():
        sharded = by_shard.get(id(params[index]))
        converted = dict(param_state)
        if sharded is not None:
            for key, value in param_state.items():
                if keys.sharded_with_parameter(recorded, index, key, value, sharded.spec.shape):
                    local = sharded.spec.take(value, sharded.rank).to(sharded.master.device).clone()
                    converted[key] = sharded.wrap(local)
        state[index] = converted
    clean = {k: v for k, v in state_dict.items() if k != keys.SHARDED_KEYS}
    optimizer.load_state_dict({**clean, "state": state})


def load_full_optimizer_state_into_dtensors(optimizer: Optimizer, state_dict: dict[str, Any]) -> None:
    """Stage 3: load a ``state_dict`` of whole tensors into an optimizer over ``fully_shard``'s DTensor parameters;
    each parameter-shaped entry becomes a DTensor laid out like its parameter (this rank's rows, no communication)."""
    params = _optimizer_tensors(optimizer)
    recorded: dict[int, list[str]] | None = state_dict.get(keys.SHARDED_KEYS)
    state = {}
    for index, param_state in state_dict["state"].items():
        param = params[index]
        converted = dict(param_state)
        if isinstance(param, DTensor):
            for key, value in param_state.items():
                if keys.sharded_with_parameter(recorded, index, key, value, param.shape):
                    placed = distribute_tensor(
                        value.to(param.device), param.device_mesh, param.placements, src_data_rank=None
                    )
                    # laid out like the parameter, on its device: a DTensor made by `distribute_tensor` lives on its
                    # mesh's device type, while offloaded shards live on the host
                    converted[key] = torch.empty_like(param, dtype=placed.dtype)
                    converted[key].to_local().copy_(placed.to_local())
        state[index] = converted
    clean = {k: v for k, v in state_dict.items() if k != keys.SHARDED_KEYS}
    optimizer.load_state_dict({**clean, "state": state})

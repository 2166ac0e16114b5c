"""What goes into a checkpoint and comes back out of one, for the live module and optimizers of any mode.

The interface: a mode hands this layer its state as *entries*, named by parameter and full-shaped, each sharded one
as the DTensor over this rank's rows (its placement says which rows), and takes them back the same way:

- the module's state as a state dict whose values alias the live tensors (loading into it loads into the module);
- each optimizer as an :class:`OptimizerEntries`: the optimizer as the mode set it up, and what it updates in its
  state-dict order, the tensors its state is laid out like.

The layer knows no mode: saving never gathers and writes the entries named by parameter, so a checkpoint taken at one
world size and stage loads at another (see :mod:`.directory`); loading fills the entries in place. Whole tensors (an
ordinary single-file Lightning checkpoint from ``"ddp"``, a consolidated one, a foreign format converted to one) take
the one road of :func:`load_full_optimizer_state`: each rank keeps its rows of every entry sharded like its parameter.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_zero._checkpoint import directory as ckpt
from lightning_zero._checkpoint import keys
from lightning_zero._checkpoint.error import CheckpointError, StateNotSaved
from lightning_zero._checkpoint.ranks import Ranks
from lightning_zero._checkpoint.whole import rows_of


@dataclass(frozen=True)
class OptimizerEntries:
    """One optimizer as a mode hands it to a checkpoint: ``optimizer`` (its ``param_groups`` hold the module's
    parameters; its ``state_dict`` and ``load_state_dict`` number them in group order) and ``tensors``, what it
    updates in that order, each full-shaped: a DTensor over this rank's rows where it is sharded; ``state_like``
    gives a loaded state entry laid out like one of them its memory (where the placement keeps optimizer state)."""

    optimizer: Optimizer
    tensors: list[torch.Tensor]
    state_like: Callable[[torch.Tensor, torch.dtype], torch.Tensor]

    @classmethod
    def of(
        cls, optimizer: Optimizer, state_like: Callable[[torch.Tensor, torch.dtype], torch.Tensor]
    ) -> OptimizerEntries:
        """An optimizer that updates the module's parameters themselves."""
        return cls(optimizer, [p for group in optimizer.param_groups for p in group["params"]], state_like)


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
    opened: ckpt.Opened,
    module: nn.Module,
    model_state: dict[str, Any],
    optimizers_for: Callable[[dict[str, Any]], list[OptimizerEntries]],
    strict: bool = True,
) -> dict[str, Any]:
    """Load model and optimizer state from the checkpoint directory ``opened`` into the live entries, laid out for
    this run; return the rest of the Lightning checkpoint. ``model_state``: the module's entries (aliasing its
    tensors); ``optimizers_for``: the optimizers to load, given that rest (a Fabric checkpoint records their names);
    ``strict``: whether the module's entries and the checkpoint's must match, as in ``load_state_dict``."""
    path, meta, metadata = opened.path, opened.meta, opened.metadata
    # The shard files are checked while they load: nothing below runs before the verdict but filling the live
    # tensors, which a damaged checkpoint leaves to be discarded with the error.
    with opened.check.overlapping():
        optimizers = optimizers_for(meta["checkpoint"])
        model_target = {keys.model_key(k): v for k, v in model_state.items()}
        model_target = ckpt.model_entries_to_load(model_target, metadata, path, _class_name(module), strict)
        targets = [_optimizer_target(i, opt, module, metadata, meta, path) for i, opt in enumerate(optimizers)]
        flat = dict(model_target)
        for target in targets:
            flat.update(target)
        ckpt.check_compatible(flat, metadata, path)
        ckpt.load(flat, opened, progress=opened.check.ranks.rank == 0)  # a bar on rank 0's terminal
    for index, (entries, target) in enumerate(zip(optimizers, targets, strict=True)):
        groups = meta["param_groups"][index]
        entries.optimizer.load_state_dict(_indexed_state(index, entries.optimizer, module, target, groups, path))
    # Lightning insists on the key; the empty list tells ``load_optimizer_state_dict`` all is loaded already.
    return {**meta["checkpoint"], "optimizer_states": []} if optimizers else meta["checkpoint"]


def _class_name(module: nn.Module) -> str:
    """The module's class as the user wrote it (``fully_shard`` makes it a subclass named ``FSDP<name>``)."""
    return next(cls for cls in type(module).__mro__ if not issubclass(cls, FSDPModule)).__name__


def _optimizer_target(
    index: int, entries: OptimizerEntries, module: nn.Module, metadata: Metadata, meta: dict[str, Any], path: Path
) -> dict[str, Any]:
    names = _module_param_names(entries.optimizer, keys.module_names(module))
    tensors = entries.tensors
    sharded = meta["sharded"].get(index, {})
    if index not in meta["param_groups"]:
        raise StateNotSaved(
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
            target[key] = entries.state_like(by_name[fqn], entry.properties.dtype)
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


def load_full_optimizer_state(
    entries: OptimizerEntries, state_dict: dict[str, Any], recorded: dict[int, list[str]] | None = None
) -> None:
    """Load a ``state_dict`` of whole tensors into an optimizer of any mode: each entry ``recorded`` (the file's
    :data:`.keys.SHARDED_KEYS` record for this optimizer; inside ``state_dict`` in files of earlier releases) or,
    without a record, shaped like its parameter becomes a DTensor laid out like the tensor the optimizer updates (this
    rank's rows, on that tensor's device, no communication); the rest loads as it is."""
    if recorded is None:
        recorded = state_dict.get(keys.SHARDED_KEYS)
    state = {}
    for index, param_state in state_dict["state"].items():
        param = entries.tensors[index]
        converted = dict(param_state)
        if isinstance(param, DTensor):
            for key, value in param_state.items():
                if keys.sharded_with_parameter(recorded, index, key, value, param.shape):
                    converted[key] = rows_of(value, param)
        state[index] = converted
    clean = {k: v for k, v in state_dict.items() if k != keys.SHARDED_KEYS}
    entries.optimizer.load_state_dict({**clean, "state": state})

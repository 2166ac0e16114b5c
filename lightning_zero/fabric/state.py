"""Fabric's checkpoint ``state`` (a dict of the user's names to a module, optimizers and anything else) in the
checkpoint the Trainer writes, and back.

A Trainer checkpoint names the module's state ``"state_dict"`` and lists the optimizers' in ``"optimizer_states"``;
a Fabric checkpoint is written the same way, with what the Trainer insists on when it resumes (Lightning's version,
and an empty ``"lr_schedulers"``: a Fabric loop keeps its schedulers among its own entries), every other entry of
``state`` under its own name, and a record of the names the modules and optimizers had (:data:`RECORD`). So a
checkpoint of either front end loads in the other: the module gets ``"state_dict"``, the optimizers
``"optimizer_states"`` by their saved names or, without a record, in order. A state of several modules keeps them all
in ``"state_dict"``, each parameter under its module's name (``g.<fqn>``, see :mod:`lightning_zero._core.checkpointed`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning
from lightning.fabric.strategies.strategy import _apply_filter, _validate_keys_for_strict_loading
from lightning.fabric.utilities.types import _Stateful
from torch import nn
from torch.optim import Optimizer

from lightning_zero._checkpoint.error import CheckpointError
from lightning_zero._checkpoint.keys import SHARDED_KEYS

RECORD = "lightning_zero_fabric"  # {"modules": their names in `state`, "optimizers": their names, in saved order}
_MODEL, _OPTIMIZERS, _SCHEDULERS = "state_dict", "optimizer_states", "lr_schedulers"
_RESERVED = (_MODEL, _OPTIMIZERS, _SCHEDULERS, RECORD, SHARDED_KEYS, "pytorch-lightning_version")


@dataclass(frozen=True)
class FabricState:
    """Which names of a Fabric ``state`` dict hold the module and the optimizers."""

    modules: list[str]
    optimizers: list[str]

    @classmethod
    def of(cls, state: dict[str, Any]) -> FabricState:
        modules = [k for k, v in state.items() if isinstance(v, nn.Module)]
        unnamable = [k for k in modules if len(modules) > 1 and (not k or "." in k)]
        if unnamable:
            raise ValueError(
                f"The checkpoint state holds several modules, and names some {unnamable}: each module's parameters"
                " are saved under its name and a dot. HINT: name the modules without dots (`{'generator': ...}`)."
            )
        reserved = [k for k in state if k in _RESERVED]
        if reserved:
            raise ValueError(
                f"The checkpoint state uses the names {reserved}, which the checkpoint format keeps for itself."
                " HINT: rename those entries."
            )
        optimizers = [k for k, v in state.items() if isinstance(v, Optimizer)]
        return cls(modules, optimizers)

    def to_checkpoint(
        self,
        state: dict[str, Any],
        *,
        module_states: dict[str, dict[str, Any]],
        combined: Callable[[dict[str, dict[str, Any]]], dict[str, Any]],
        optimizer_states: list[dict[str, Any]],
        filter: dict[str, Callable[[str, Any], bool]],
    ) -> dict[str, Any]:
        """The checkpoint of ``state``, given its modules' states by name and its optimizers' states as the modes make
        them; ``combined`` makes the modules' states one state dict, once each is filtered."""
        checkpoint: dict[str, Any] = {"pytorch-lightning_version": lightning.__version__, _SCHEDULERS: []}
        for key, value in state.items():
            if key not in self.modules and key not in self.optimizers:
                _apply_filter(key, filter, value.state_dict() if isinstance(value, _Stateful) else value, checkpoint)
        kept: dict[str, Any] = {}
        for key in self.modules:
            _apply_filter(key, filter, module_states[key], kept)
        checkpoint[_MODEL] = combined(kept)
        checkpoint[_OPTIMIZERS] = optimizer_states
        checkpoint[RECORD] = {"modules": list(self.modules), "optimizers": list(self.optimizers)}
        return checkpoint

    def saved_optimizer_order(self, checkpoint: dict[str, Any], path: Path) -> list[str]:
        """The names of ``state``'s optimizers in the order the checkpoint at ``path``, which holds ``checkpoint``
        beyond the states, saved their states: by their names in a Fabric checkpoint, as listed otherwise (a Trainer
        checkpoint). They must be the first ones saved."""
        saved = checkpoint.get(RECORD, {}).get("optimizers")
        if saved is None:
            return list(self.optimizers)
        order = saved[: len(self.optimizers)]
        if sorted(order) != sorted(self.optimizers):
            raise CheckpointError(
                f"Checkpoint {path} holds the optimizers {saved}; the state to load names {self.optimizers}."
                " HINT: load with the names the checkpoint was saved with (the first ones, in order)."
            )
        return order

    def pop_module_states(self, checkpoint: dict[str, Any], path: Path) -> dict[str, dict[str, Any]]:
        """An ordinary file's module states (made :func:`as_saved`), by the names in ``state``: under those names
        (Fabric's own format) or, for a module alone, ``"state_dict"`` (the Trainer's)."""
        states = {}
        for key in self.modules:
            if key in checkpoint:
                states[key] = checkpoint.pop(key)
            elif len(self.modules) == 1 and _MODEL in checkpoint:
                states[key] = checkpoint.pop(_MODEL)
            else:
                also = f" nor `{_MODEL}`" if len(self.modules) == 1 else ""
                raise CheckpointError(
                    f"Checkpoint {path} holds no entry `{key}`{also} for the module. HINT: load it with the names it"
                    " was saved with; a file of one module's state dict alone (`torch.save(model.state_dict(), path)`)"
                    " loads with `fabric.load_raw(path, model)`."
                )
        return states

    def pop_optimizer_states(self, checkpoint: dict[str, Any]) -> dict[str, dict[str, Any]]:
        """An ordinary file's optimizer states, by the names in ``state``."""
        listed = checkpoint.pop(_OPTIMIZERS, [])
        states = {}
        for index, key in enumerate(self.optimizers):
            states[key] = checkpoint.pop(key) if key in checkpoint else listed[index]
        return states

    def pop_records(self, checkpoint: dict[str, Any]) -> dict[str, dict[int, list[str]] | None]:
        """An ordinary file's record of the entries its optimizers sharded (see :data:`.keys.SHARDED_KEYS`), by the
        names in ``state``: a Fabric file keeps it by the optimizers' names, a Trainer's or a consolidated file in the
        order of ``"optimizer_states"``. Call it before :meth:`pop_optimizer_states`."""
        records = checkpoint.pop(SHARDED_KEYS, None)
        if records is None:
            return {}
        if isinstance(records, dict):
            return {key: records.get(key) for key in self.optimizers}
        return dict(zip(self.optimizers, records, strict=False))

    def restore_rest(self, state: dict[str, Any], checkpoint: dict[str, Any], strict: bool) -> dict[str, Any]:
        """Fill ``state``'s other entries from ``checkpoint`` (stateful objects in place); return what remains, less
        what a Fabric checkpoint holds for the format's sake."""
        _drop_format_entries(checkpoint)
        for key in (_MODEL, _OPTIMIZERS):
            checkpoint.pop(key, None)
        others = [k for k in state if k not in self.modules and k not in self.optimizers]
        _validate_keys_for_strict_loading(others, checkpoint.keys(), strict=strict)
        for key in others:
            if key not in checkpoint:
                continue
            if isinstance(state[key], _Stateful):
                state[key].load_state_dict(checkpoint.pop(key))
            else:
                state[key] = checkpoint.pop(key)
        return checkpoint


def raw_module_state(contents: dict[str, Any]) -> dict[str, Any]:
    """The module state in a file ``fabric.load_raw`` reads: the file itself (``torch.save(model.state_dict())``), or
    the ``"state_dict"`` of a Lightning checkpoint (a consolidated one, say): a state dict's values are tensors, never
    a dict, so the two cannot be confused."""
    inner = contents.get(_MODEL)
    return dict(inner) if isinstance(inner, Mapping) else contents


def as_saved(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """A whole checkpoint as Fabric's ``"ddp"`` returns the file it saved: a Fabric checkpoint's module and optimizer
    states back under the names they had in ``state``, without the entries the format added. A Trainer's checkpoint
    is returned as it is."""
    record = checkpoint.get(RECORD)
    if record is None:
        return checkpoint
    contents = dict(checkpoint)
    _drop_format_entries(contents)
    model, optimizers = contents.pop(_MODEL), contents.pop(_OPTIMIZERS, [])
    contents.update(_split(model, _recorded_modules(record)))
    for name, optimizer_state in zip(record["optimizers"], optimizers, strict=False):
        contents[name] = optimizer_state
    if SHARDED_KEYS in contents:  # by the optimizers' names, as the states themselves
        contents[SHARDED_KEYS] = dict(zip(record["optimizers"], contents[SHARDED_KEYS], strict=False))
    return contents


def without_records(contents: dict[str, Any]) -> dict[str, Any]:
    """A file's contents as the user saved them, without this package's record of its sharded entries."""
    return {key: value for key, value in contents.items() if key != SHARDED_KEYS}


def _drop_format_entries(checkpoint: dict[str, Any]) -> None:
    """Remove what a Fabric save adds to the user's entries (the record, Lightning's version, empty schedulers)."""
    if checkpoint.pop(RECORD, None) is not None:
        checkpoint.pop("pytorch-lightning_version", None)
        if checkpoint.get(_SCHEDULERS) == []:
            checkpoint.pop(_SCHEDULERS)


def _recorded_modules(record: dict[str, Any]) -> list[str]:
    """The modules' names a Fabric checkpoint recorded (``"module"``: one name or none, before several were kept)."""
    if "modules" in record:
        return list(record["modules"])
    return [] if record.get("module") is None else [record["module"]]


def _split(model_state: dict[str, Any], modules: list[str]) -> dict[str, dict[str, Any]]:
    """The state dict of the checkpoint's modules by their names: one holds it all; several, each its prefix's."""
    if len(modules) <= 1:
        return {name: model_state for name in modules}
    split: dict[str, dict[str, Any]] = {name: {} for name in modules}
    for key, value in model_state.items():
        module, name = key.split(".", 1)
        split[module][name] = value
    return split

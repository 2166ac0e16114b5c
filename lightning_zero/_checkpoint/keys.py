"""The names inside a checkpoint, built and parsed here alone, and the rule for which optimizer entries are sharded
like their parameter.

A checkpoint directory holds one flat state dict whose keys never nest, so parameter names may hold dots:

- ``model/<fqn>``: a parameter or buffer of the module;
- ``optim/<i>/state/<fqn>/<key>``: entry ``<key>`` (``exp_avg``, ``step``, ...) of optimizer ``i``'s state for the
  parameter named ``<fqn>``.

Optimizer state is named by parameter rather than numbered, so it loads into any layout of the same parameters; an
entry *like its parameter* (a tensor of the parameter's shape, other than ``step``) is sharded with it. A checkpoint
records which entries those were in the directory's metadata; a single file, whose optimizer states are exactly the
``state`` and ``param_groups`` of ``"ddp"``'s, records them under its own top-level :data:`SHARDED_KEYS` only where the
rule applied to the whole tensors would tell otherwise (see :func:`file_record`). Files without a record fall back to
the rule; files of earlier releases kept it inside each optimizer state.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

MODEL = "model/"
# In a single-file checkpoint, at its top level where the rule does not suffice: per optimizer (a list in the order of
# "optimizer_states", or a dict by the optimizers' names in a Fabric file), per parameter index, the state entries
# sharded like it. Files of earlier releases kept one such dict inside each optimizer state, under the same name.
SHARDED_KEYS = "lightning_zero_sharded_keys"

ShardedEntries = dict[int, dict[str, list[str]]]  # per optimizer index, per parameter name: its entries sharded like it


def model_key(fqn: str) -> str:
    return MODEL + fqn


def state_key(index: int, fqn: str, key: str) -> str:
    return f"{_state_prefix(index)}{fqn}/{key}"


def _state_prefix(index: int) -> str:
    return f"optim/{index}/state/"


def model_entries(keys: Iterable[str]) -> Iterator[str]:
    """The parameter and buffer names among a checkpoint's ``keys``."""
    return (key[len(MODEL) :] for key in keys if key.startswith(MODEL))


def optimizer_entries(keys: Iterable[str], index: int) -> Iterator[tuple[str, str, str]]:
    """``(key, fqn, entry)`` for each of optimizer ``index``'s state entries among a checkpoint's ``keys``."""
    prefix = _state_prefix(index)
    for key in keys:
        if key.startswith(prefix):
            fqn, entry = key[len(prefix) :].rsplit("/", 1)  # entry names hold no slash; parameter names may
            yield key, fqn, entry


def like_parameter(entry: str, value: object, shape: torch.Size) -> bool:
    """Whether optimizer state ``entry`` holding ``value`` is shaped, and so sharded, like its parameter."""
    return isinstance(value, DTensor) or (isinstance(value, torch.Tensor) and value.shape == shape and entry != "step")


def sharded_with_parameter(
    recorded: dict[int, list[str]] | None, index: int, entry: str, value: object, shape: torch.Size
) -> bool:
    """Whether entry ``entry`` of parameter ``index``'s state was sharded with it: as ``recorded`` (a single-file
    checkpoint's :data:`SHARDED_KEYS`) where there is a record, by :func:`like_parameter` otherwise."""
    if recorded is not None:
        return entry in recorded.get(index, ())
    return like_parameter(entry, value, shape)


def file_record(
    sharded: dict[str, list[str]], whole: dict[str, Any], shapes: dict[str, torch.Size]
) -> dict[int, list[str]] | None:
    """What a single file records for one optimizer: ``sharded`` (its entries sharded like their parameter, by name)
    by parameter index, or ``None`` where :func:`like_parameter` on the ``whole`` state (named, see
    :func:`named_optimizer_state`) with the parameters' ``shapes`` tells the same, as it does for every optimizer whose
    per-parameter tensors are shaped like the parameter (Adam, AdamW, SGD, ...)."""
    position = positions(whole["param_groups"])
    record = {position[fqn]: list(entries) for fqn, entries in sharded.items() if entries}
    if any(fqn not in shapes for fqn in whole["state"]):  # a parameter a save filter left out: no shape to rule by
        return record
    ruled = {
        fqn: {entry for entry, value in entries.items() if like_parameter(entry, value, shapes[fqn])}
        for fqn, entries in whole["state"].items()
    }
    given = {fqn: set(entries) for fqn, entries in sharded.items() if entries}
    return None if {fqn: entries for fqn, entries in ruled.items() if entries} == given else record


def sharded_entries(named: dict[str, Any], shapes: dict[str, torch.Size]) -> dict[str, list[str]]:
    """The entries of a live named optimizer state that are sharded like their parameter, by parameter name."""
    return {
        fqn: [entry for entry, value in entries.items() if like_parameter(entry, value, shapes[fqn])]
        for fqn, entries in named["state"].items()
    }


# --- the flat state dict ---------------------------------------------------------------------------------------------


def flatten(
    model_state: dict[str, Any], optimizer_states: list[dict[str, Any]], shapes: dict[str, torch.Size]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The flat state dict of a model state dict and named optimizer state dicts (see :func:`named_optimizer_state`),
    and what goes to the directory's metadata: each optimizer's groups and, as :data:`ShardedEntries`, the entries
    sharded like their parameter (``shapes``, by name)."""
    flat: dict[str, Any] = {model_key(fqn): value for fqn, value in model_state.items()}
    sharded: ShardedEntries = {}
    for index, named in enumerate(optimizer_states):
        for fqn, entries in named["state"].items():
            for entry, value in entries.items():
                flat[state_key(index, fqn, entry)] = value
                if like_parameter(entry, value, shapes[fqn]):
                    sharded.setdefault(index, {}).setdefault(fqn, []).append(entry)
    groups = {index: named["param_groups"] for index, named in enumerate(optimizer_states)}
    return flat, {"sharded": sharded, "param_groups": groups}


def named_optimizer_state(state_dict: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """An optimizer ``state_dict`` (parameters as indices in group order) with the parameters named instead."""
    groups = [{**group, "params": [names[i] for i in group["params"]]} for group in state_dict["param_groups"]]
    state = {names[i]: dict(entries) for i, entries in state_dict["state"].items()}
    return {"state": state, "param_groups": groups}


def indexed_optimizer_state(named: dict[str, Any]) -> tuple[dict[str, Any], dict[str, int]]:
    """The inverse of :func:`named_optimizer_state` (indices follow the order of the saved groups), and the index
    given to each name."""
    index: dict[str, int] = {}
    groups = []
    for group in named["param_groups"]:
        ids = []
        for fqn in group["params"]:
            index.setdefault(fqn, len(index))
            ids.append(index[fqn])
        groups.append({**group, "params": ids})
    state = {index[fqn]: entries for fqn, entries in named["state"].items()}
    return {"state": state, "param_groups": groups}, index


def positions(named_groups: list[dict[str, Any]]) -> dict[str, int]:
    """The index :func:`indexed_optimizer_state` gives each parameter name of the named ``param_groups``."""
    return indexed_optimizer_state({"state": {}, "param_groups": named_groups})[1]


def module_names(module: nn.Module) -> dict[int, str]:
    """The name of every parameter, by ``id``; a tied parameter gets its first name."""
    names: dict[int, str] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), name)
    return names

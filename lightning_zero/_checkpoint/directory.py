"""The sharded checkpoint: a directory that every rank writes its own shards into, readable at any world size and
under any stage.

Layout of a checkpoint directory (written by ``torch.distributed.checkpoint``, DCP, plus one file of ours):

- one flat DCP state dict whose keys never nest, so parameter names may hold dots:
  ``model/<fqn>`` a parameter or buffer; ``optim/<i>/state/<fqn>/<key>`` one entry of optimizer ``i``'s state for
  the parameter named ``<fqn>``. Sharded parameters and their parameter-shaped state are saved as DTensors, so DCP
  records global offsets and can hand any rank layout back; everything else is saved once, by rank 0;
- ``lightning_zero.pt``, written last by rank 0: the rest of Lightning's checkpoint (loops, callbacks, schedulers,
  hyper-parameters), each optimizer's parameter groups (parameters listed by name; DCP would flatten them into
  separate entries) and which optimizer entries are shaped like their parameter.

A save writes into a hidden sibling directory and renames it into place once every rank has finished, so a crash
during a save never leaves a directory that looks complete: a complete checkpoint has both ``.metadata`` and
``lightning_zero.pt``.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor

META_FILE = "lightning_zero.pt"
FORMAT_VERSION = 1
MODEL = "model/"


def optim_prefix(index: int) -> str:
    return f"optim/{index}/"


def state_key(index: int, fqn: str, key: str) -> str:
    return f"{optim_prefix(index)}state/{fqn}/{key}"


def is_checkpoint_dir(path: str | os.PathLike) -> bool:
    path = Path(path)
    return (path / META_FILE).is_file() and (path / ".metadata").is_file()


# --- building the flat state dict ------------------------------------------------------------------------------------


def flatten(
    model_state: dict[str, Any], optimizer_states: list[dict[str, Any]], shapes: dict[str, torch.Size]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The flat DCP state dict of a model state dict and named optimizer state dicts (see
    :func:`named_optimizer_state`), and what goes to our metadata file: each optimizer's groups and the record of
    the optimizer entries shaped like their parameter (``shapes``, by name), those a run with more ranks shards."""
    flat: dict[str, Any] = {MODEL + fqn: value for fqn, value in model_state.items()}
    sharded: dict[int, dict[str, list[str]]] = {}
    for index, named in enumerate(optimizer_states):
        for fqn, entries in named["state"].items():
            for key, value in entries.items():
                flat[state_key(index, fqn, key)] = value
                like_param = isinstance(value, torch.Tensor) and value.shape == shapes[fqn] and key != "step"
                if isinstance(value, DTensor) or like_param:
                    sharded.setdefault(index, {}).setdefault(fqn, []).append(key)
    groups = {index: named["param_groups"] for index, named in enumerate(optimizer_states)}
    return flat, {"sharded": sharded, "param_groups": groups}


def named_optimizer_state(state_dict: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """An optimizer ``state_dict`` (parameters as indices in group order) with the parameters named instead."""
    groups = []
    for group in state_dict["param_groups"]:
        groups.append({**group, "params": [names[i] for i in group["params"]]})
    state = {names[i]: dict(entries) for i, entries in state_dict["state"].items()}
    return {"state": state, "param_groups": groups}


def indexed_optimizer_state(named: dict[str, Any]) -> tuple[dict[str, Any], dict[str, int]]:
    """The inverse of :func:`named_optimizer_state` (indices follow the order of the saved groups), and the index
    given to each name."""
    index = {}
    groups = []
    for group in named["param_groups"]:
        ids = []
        for fqn in group["params"]:
            index.setdefault(fqn, len(index))
            ids.append(index[fqn])
        groups.append({**group, "params": ids})
    state = {index[fqn]: entries for fqn, entries in named["state"].items()}
    return {"state": state, "param_groups": groups}, index


# --- saving ----------------------------------------------------------------------------------------------------------


def save(flat: dict[str, Any], meta: dict[str, Any], path: Path, rank: int, barrier: Any) -> None:
    """Write ``flat`` with every rank, then publish ``path`` atomically. ``barrier`` synchronises the ranks."""
    staging = path.parent / f".{path.name}.partial"
    trash = path.parent / f".{path.name}.old"
    if rank == 0:
        for leftover in (staging, trash):  # from a save that crashed
            shutil.rmtree(leftover, ignore_errors=True)
        staging.mkdir(parents=True)
    barrier()
    # what every rank holds alike (buffers, step counters) is written by rank 0, as a single-file checkpoint would be
    dcp.save(flat, checkpoint_id=staging, planner=DefaultSavePlanner(dedup_save_to_lowest_rank=True))
    if rank == 0:
        torch.save({"format": FORMAT_VERSION, **meta}, staging / META_FILE)
        if path.is_dir():
            path.rename(trash)
        elif path.exists():
            path.unlink()
        staging.rename(path)
        shutil.rmtree(trash, ignore_errors=True)
    barrier()


# --- loading ---------------------------------------------------------------------------------------------------------


class CheckpointError(RuntimeError):
    """A checkpoint directory that cannot be loaded as it is."""


def read_meta(path: Path) -> tuple[dict[str, Any], Metadata]:
    """Our metadata file and DCP's, after checking every shard file is present and long enough."""
    if not path.is_dir():
        raise CheckpointError(f"Checkpoint directory {path} does not exist.")
    if not (path / META_FILE).is_file() or not (path / ".metadata").is_file():
        raise CheckpointError(
            f"{path} is not a complete lightning_zero checkpoint: it lacks `{META_FILE}` or `.metadata`, which are"
            " written last. HINT: it is probably from an interrupted save; resume from an earlier checkpoint."
        )
    meta = torch.load(path / META_FILE, map_location="cpu", weights_only=False)
    metadata = FileSystemReader(path).read_metadata()
    needed: dict[str, tuple[int, str]] = {}
    for index, info in (metadata.storage_data or {}).items():
        end = info.offset + info.length
        if end > needed.get(info.relative_path, (0, ""))[0]:
            needed[info.relative_path] = (end, index.fqn)
    for relative, (end, fqn) in needed.items():
        file = path / relative
        if not file.is_file():
            raise CheckpointError(
                f"Checkpoint file {file} is missing; it holds `{fqn}`. HINT: copy the whole checkpoint directory."
            )
        if file.stat().st_size < end:
            raise CheckpointError(
                f"Checkpoint file {file} is truncated ({file.stat().st_size} bytes, {end} needed for `{fqn}`)."
                " HINT: copy the whole directory again, or resume from an earlier checkpoint."
            )
    return meta, metadata


def check_compatible(target: dict[str, Any], metadata: Metadata, path: Path) -> None:
    """Every tensor the target needs exists in the checkpoint with the same global shape."""
    saved = metadata.state_dict_metadata
    for key, value in target.items():
        if key not in saved:
            raise CheckpointError(
                f"Checkpoint {path} has no entry `{key}`. HINT: it was saved from a different model or optimizer"
                " configuration; load it with the module and `configure_optimizers` it was trained with."
            )
        entry = saved[key]
        if isinstance(value, torch.Tensor) and (
            not isinstance(entry, TensorStorageMetadata) or tuple(entry.size) != tuple(value.shape)
        ):
            shape = tuple(entry.size) if isinstance(entry, TensorStorageMetadata) else "not a tensor"
            raise CheckpointError(
                f"Checkpoint {path} holds `{key}` with shape {shape}, the model expects {tuple(value.shape)}."
                " HINT: it was saved from a different model."
            )


def load(target: dict[str, Any], path: Path) -> None:
    """Fill ``target`` (tensors and DTensors laid out for this run) in place from the checkpoint at ``path``."""
    dcp.load(target, checkpoint_id=path)


def model_state_keys(metadata: Metadata) -> Iterator[str]:
    return (key[len(MODEL) :] for key in metadata.state_dict_metadata if key.startswith(MODEL))


def module_names(module: nn.Module) -> dict[int, str]:
    """The name of every parameter, by ``id``; a tied parameter gets its first name."""
    names: dict[int, str] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), name)
    return names

"""Every checkpoint a load is given, opened once and asked the same questions, whatever it is.

Vocabulary:

- *source*: what a checkpoint path names, opened: a checkpoint directory of this package (:mod:`.directory`), a
  DeepSpeed checkpoint (a save directory with ``latest``, one of its tag directories, or a ``.ckpt`` directory of
  Lightning's ``DeepSpeedStrategy``: :mod:`.deepspeed`), or one ordinary ``torch.save`` file.
- *whole*: a Lightning checkpoint of whole tensors, the file ``"ddp"`` writes.
- *live*: the modules and optimizers a load fills, as a front end holds them (:class:`Live`).

:func:`open_checkpoint` decides the kind, once, and opens the source, once. A checkpoint directory is checked there, in
this order: containment (a load opens only the regular files directly inside it), then each small file's size and
CRC-32 against the record before it is parsed, then the layout (every shard file ``.metadata`` names is recorded,
present and long enough for the sizes it declares), every rank agreeing on the verdict; the shard files' own sums are
checked while they load. A DeepSpeed checkpoint is read there, whole; an ordinary file is checked against its own
record when it is read. A front end then asks the source, never its kind: :meth:`Source.whole`,
:meth:`Source.restore`, :meth:`Source.raw`; what a source cannot answer raises a named :class:`CheckpointError`.
"""

from __future__ import annotations

import os
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_zero._checkpoint import directory, keys, publish
from lightning_zero._checkpoint.deepspeed import DeepSpeedCheckpoint, read_deepspeed_checkpoint
from lightning_zero._checkpoint.deepspeed_files import is_deepspeed_checkpoint
from lightning_zero._checkpoint.error import CheckpointError, NoCheckpoint
from lightning_zero._checkpoint.ranks import ALONE, Ranks
from lightning_zero._checkpoint.unpickling import Unpickling
from lightning_zero._checkpoint.whole import check_file

ReadFile = Callable[[Path], Any]  # an ordinary checkpoint file's contents, read as the front end reads one


class LoadsInPlace(Protocol):
    """What fills live shards from a checkpoint directory (:class:`~lightning_zero._core.checkpointed.Checkpointed`)."""

    def load_directory(
        self,
        opened: directory.Opened,
        optimizers_for: Callable[[dict[str, Any]], list[Optimizer]],
        strict: bool = True,
    ) -> dict[str, Any]: ...


@dataclass(frozen=True, kw_only=True)
class Live:
    """The objects a load fills, as a front end holds them."""

    modules: dict[str, nn.Module]
    """The modules, by the names the load was given them under (a DeepSpeed checkpoint fills exactly one)."""
    optimizers_for: Callable[[dict[str, Any]], list[Optimizer]]
    """The optimizers to fill, given the checkpoint's entries beyond the states; none where none are restored."""
    in_place: LoadsInPlace
    """Fills the live shards from a checkpoint directory."""
    take_whole: Callable[[dict[str, Any]], dict[str, Any]]
    """Takes a whole checkpoint: loads its states in place and returns the rest (Fabric), or returns it for
    Lightning's loader to load (the Trainer)."""
    strict: bool
    """As in ``load_state_dict``: the module's entries and the checkpoint's must match."""


class Source(ABC):
    """One opened checkpoint, whatever its kind."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @abstractmethod
    def whole(self, *, optimizer_states: bool = True, progress: bool = False) -> dict[str, Any]:
        """The checkpoint as a whole Lightning checkpoint, read in this process; without ``optimizer_states``, the
        weights and the Lightning entries only. ``progress``: draw a bar on a terminal while it reads."""

    @abstractmethod
    def restore(self, live: Live) -> dict[str, Any]:
        """Fill ``live`` from the checkpoint (a directory's shards in place, laid out for this run; whole tensors
        through ``live.take_whole``); return what ``live.take_whole`` or Lightning's loader still takes."""

    def raw(self) -> Any:
        """The contents of a file of one state dict (``fabric.load_raw``)."""
        raise CheckpointError(
            f"{self.path} is a checkpoint directory, and `fabric.load_raw` reads a file of one state dict. HINT: load"
            " it with `fabric.load(path, {'model': model, ...})`, or consolidate it into one file first"
            " (`python -m lightning_zero consolidate DIR FILE`)."
        )


def open_checkpoint(
    path: Path,
    *,
    ranks: Ranks = ALONE,
    unpickling: Unpickling = Unpickling.TORCH_DEFAULT,
    read_file: ReadFile | None = None,
) -> Source:
    """Open the checkpoint at ``path``, read by ``ranks`` together (collective for a checkpoint directory), its
    pickled entries loaded as ``unpickling`` allows; ``read_file`` reads an ordinary file (``torch.load`` under
    ``unpickling`` if not given). :class:`NoCheckpoint` where nothing is at ``path``."""
    found = _readable(path)
    if found is None:
        if not os.path.lexists(path):
            raise NoCheckpoint(
                f"Checkpoint {path} does not exist. HINT: pass the path a save wrote (a checkpoint directory or file)."
            )
        torch_load = partial(torch.load, map_location="cpu", weights_only=unpickling.weights_only)
        return FileSource(path, read_file or torch_load)
    if is_deepspeed_checkpoint(found):
        return DeepSpeedSource(found, read_deepspeed_checkpoint(found, unpickling))
    return DirectorySource(directory.open_directory(found, ranks, unpickling))


def _readable(path: Path) -> Path | None:
    """The checkpoint directory a load of ``path`` reads (see :func:`.publish.readable`); ``None`` where ``path`` is
    no directory."""
    found = publish.readable(path)
    if found is not None and found != path:
        warnings.warn(
            f"{path} does not exist: a save replacing it stopped between two renames, so the previous checkpoint,"
            f" kept at {found}, is loaded; the next save to {path} moves it back.",
            stacklevel=3,
        )
    return found


class DirectorySource(Source):
    """A checkpoint directory of this package, opened (see :func:`.directory.open_directory`)."""

    def __init__(self, opened: directory.Opened) -> None:
        super().__init__(opened.path)
        self.opened = opened

    def whole(self, *, optimizer_states: bool = True, progress: bool = False) -> dict[str, Any]:
        meta, entries = self.opened.meta, self.opened.metadata.state_dict_metadata
        model_keys = {keys.model_key(fqn): fqn for fqn in keys.model_entries(entries)}
        indices = sorted(meta["param_groups"]) if optimizer_states else []
        optimizer_keys = {i: list(keys.optimizer_entries(entries, i)) for i in indices}
        wanted = [*model_keys, *(key for found in optimizer_keys.values() for key, _, _ in found)]
        read = directory.read_whole(self.opened, wanted, progress=progress)
        checkpoint: dict[str, Any] = dict(meta["checkpoint"])
        checkpoint["state_dict"] = {fqn: read[key] for key, fqn in model_keys.items()}
        if not optimizer_states:
            for key in ("optimizer_states", "lr_schedulers"):
                checkpoint.pop(key, None)
            return checkpoint
        named_states = []
        for i in indices:
            named: dict[str, dict[str, Any]] = {}
            for key, fqn, name in optimizer_keys[i]:
                named.setdefault(fqn, {})[name] = read[key]
            named_states.append({"state": named, "param_groups": meta["param_groups"][i]})
        shapes = {fqn: value.shape for fqn, value in checkpoint["state_dict"].items()}
        # `"ddp"`'s optimizer states, and a record beside them only where the rule would not tell
        sharded = [meta["sharded"].get(i, {}) for i in indices]
        records = [keys.file_record(s, named, shapes) for s, named in zip(sharded, named_states, strict=True)]
        checkpoint["optimizer_states"] = [keys.indexed_optimizer_state(named)[0] for named in named_states]
        if any(record is not None for record in records):
            checkpoint[keys.SHARDED_KEYS] = records
        return checkpoint

    def restore(self, live: Live) -> dict[str, Any]:
        return live.in_place.load_directory(self.opened, live.optimizers_for, live.strict)


class DeepSpeedSource(Source):
    """A DeepSpeed ZeRO checkpoint, read whole when opened (see :func:`.deepspeed.read_deepspeed_checkpoint`)."""

    def __init__(self, path: Path, read: DeepSpeedCheckpoint) -> None:
        super().__init__(path)
        self.read = read

    def whole(self, *, optimizer_states: bool = True, progress: bool = False) -> dict[str, Any]:
        return self.read.lightning_checkpoint(weights_only=not optimizer_states)

    def restore(self, live: Live) -> dict[str, Any]:
        if len(live.modules) != 1:
            raise CheckpointError(
                f"{self.path} is a DeepSpeed checkpoint, of one engine's module, and the load names the modules"
                f" {list(live.modules)}. HINT: load it into the one module it was saved from."
            )
        module = next(iter(live.modules.values()))
        checkpoint = self.read.checkpoint_for(module, live.optimizers_for(self.read.rest), live.strict)
        return live.take_whole(checkpoint)


class FileSource(Source):
    """An ordinary single-file checkpoint, read when asked, once its bytes match the checksums it recorded."""

    def __init__(self, path: Path, read_file: ReadFile) -> None:
        super().__init__(path)
        self._read_file = read_file

    def raw(self) -> Any:
        check_file(self.path)
        return self._read_file(self.path)

    def whole(self, *, optimizer_states: bool = True, progress: bool = False) -> dict[str, Any]:
        checkpoint = dict(self.raw())
        if not optimizer_states:
            for key in ("optimizer_states", "lr_schedulers", keys.SHARDED_KEYS):
                checkpoint.pop(key, None)
        return checkpoint

    def restore(self, live: Live) -> dict[str, Any]:
        return live.take_whole(self.raw())

"""Full checkpoints (``state_dict_type="full"``): one ordinary checkpoint file, written by rank 0 as ``"ddp"`` writes
it, which ``load_from_checkpoint``, a plain ``Trainer`` and any stage at any world size read.

Vocabulary:

- **whole**: a tensor as the unsharded model has it; a DTensor's shards are all-gathered into one.
- **gathering**: every rank walks the same checkpoint structure in the same order and takes part in each tensor's
  all-gather, one tensor at a time, so no rank ever holds more than one whole tensor in flight; rank 0 keeps a host
  copy of each, which together are the file's own tensors.
- **record**: a single file's checksums are the CRC-32 of each of its records, which ``torch.save``'s zip format
  stores in its central directory; :func:`check_file` recomputes them before the file is unpickled (``torch.load``
  itself does not).
"""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from lightning_zero._checkpoint import keys, publish
from lightning_zero._checkpoint.error import DAMAGE_HINT, CheckpointError

_ZIP_MAGIC = b"PK\x03\x04"


def gathered(value: Any, keep: bool) -> Any:
    """``value`` (nested dicts, lists and tuples of a checkpoint) with each tensor whole and on the host, where
    ``keep``; ``None`` for each tensor elsewhere (collective: every rank calls it on the same structure)."""
    if isinstance(value, dict):
        return {k: gathered(v, keep) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(gathered(v, keep) for v in value)
    if isinstance(value, DTensor):
        whole = _whole(value)
        return whole.detach().cpu() if keep else None
    if isinstance(value, torch.Tensor):
        return value.detach().cpu() if keep else None
    return value


def _whole(shard: DTensor) -> torch.Tensor:
    """All-gather ``shard`` on its mesh's device (offloaded shards live on the host while their mesh names the
    accelerator)."""
    device = torch.device(shard.device_mesh.device_type)
    local = shard.to_local()
    if local.device.type != device.type:
        local = local.to(device)
        shard = DTensor.from_local(
            local, shard.device_mesh, shard.placements, shape=shard.shape, stride=shard.stride(), run_check=False
        )
    return shard.full_tensor()


def rows_of(whole: torch.Tensor, like: DTensor) -> DTensor:
    """This rank's rows of ``whole``, laid out as ``like`` (no communication: every rank holds ``whole``), on
    ``like``'s device: offloaded shards live on the host while their mesh names the accelerator. The inverse of
    :func:`_whole`."""
    mesh = like.device_mesh
    placed = distribute_tensor(whole.detach().to(mesh.device_type), mesh, like.placements, src_data_rank=None)
    local = placed.to_local().to(like.to_local().device)
    return DTensor.from_local(local, mesh, like.placements, shape=like.shape, stride=like.stride(), run_check=False)


def whole_optimizer_state(named: dict[str, Any], keep: bool) -> dict[str, Any]:
    """A named optimizer state (see :func:`.keys.named_optimizer_state`) as the state dict of whole tensors, indexed
    by position, that ``"ddp"`` saves: ``state`` and ``param_groups`` (collective)."""
    state = {fqn: gathered(entries, keep) for fqn, entries in named["state"].items()}
    return keys.indexed_optimizer_state({"state": state, "param_groups": named["param_groups"]})[0]


def parameter_shapes(module: nn.Module) -> dict[str, torch.Size]:
    return {name: p.shape for name, p in module.named_parameters(remove_duplicate=False)}


def with_records(
    whole: dict[str, Any], named_states: list[dict[str, Any]], shapes: dict[str, torch.Size]
) -> dict[str, Any]:
    """A whole checkpoint (its ``optimizer_states`` made by :func:`whole_optimizer_state` from the live
    ``named_states``) with the :data:`.keys.SHARDED_KEYS` record where one of its optimizers needs one."""
    records = []
    for named, indexed in zip(named_states, whole.get("optimizer_states", []), strict=False):
        position = keys.positions(named["param_groups"])
        whole_named = {**named, "state": {fqn: indexed["state"][position[fqn]] for fqn in named["state"]}}
        records.append(keys.file_record(keys.sharded_entries(named, shapes), whole_named, shapes))
    if any(record is not None for record in records):
        return {**whole, keys.SHARDED_KEYS: records}
    return whole


def gathered_checkpoint(checkpoint: dict[str, Any], module: nn.Module, keep: bool) -> dict[str, Any]:
    """Lightning's ``checkpoint`` (model and named optimizer states as a mode makes them for ``module``) with its
    tensors whole where ``keep``, and the record of :func:`with_records` (collective)."""
    whole = dict(checkpoint)
    if "state_dict" in checkpoint:
        whole["state_dict"] = gathered(checkpoint["state_dict"], keep)
    named_states = checkpoint.get("optimizer_states", [])
    if named_states:
        whole["optimizer_states"] = [whole_optimizer_state(s, keep) for s in named_states]
    return with_records(whole, named_states, parameter_shapes(module)) if keep else whole


def write_file(path: Path, contents: dict[str, Any]) -> None:
    """Write ``contents`` at ``path`` as one ``torch.save`` file that is never half-written (see
    :func:`.publish.publish_file`), with the CRC-32 of every record (see :func:`check_file`)."""
    path.parent.mkdir(parents=True, exist_ok=True)  # as Lightning's checkpoint IO does
    crc = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(True)  # the records' checksums are the file's only record of its bytes
    try:
        publish.publish_file(path, lambda file: torch.save(contents, file))
    finally:
        torch.serialization.set_crc32_options(crc)


def check_file(path: Path) -> None:
    """Raise :class:`CheckpointError` naming ``path`` and the record if a ``torch.save`` file's bytes differ from the
    CRC-32 it recorded for them. Other files (a legacy ``torch.save``, a file written without checksums) pass: there
    is nothing to check them against."""
    if not zipfile.is_zipfile(path):
        with path.open("rb") as file:
            if file.read(4) == _ZIP_MAGIC:  # a zip file's start without its end: cut short
                raise CheckpointError(f"Checkpoint file {path} is truncated. {DAMAGE_HINT}")
        return
    try:
        with zipfile.ZipFile(path) as archive:
            records = archive.infolist()
            if all(r.CRC == 0 for r in records if r.file_size):  # written with torch's checksums turned off
                return
            damaged = archive.testzip()
    except (zipfile.BadZipFile, OSError) as error:
        raise CheckpointError(f"Checkpoint file {path} cannot be read as a whole: {error}. {DAMAGE_HINT}") from error
    if damaged is not None:
        raise CheckpointError(
            f"Checkpoint file {path} is damaged: its record `{damaged}` differs from the checksum written with it."
            f" {DAMAGE_HINT}"
        )

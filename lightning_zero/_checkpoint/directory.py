"""The sharded checkpoint: a directory that every rank writes its own shards into, readable at any world size and
under any stage.

Layout of a checkpoint directory (written by ``torch.distributed.checkpoint``, DCP, plus two files of ours):

- one flat DCP state dict whose keys never nest, so parameter names may hold dots:
  ``model/<fqn>`` a parameter or buffer; ``optim/<i>/state/<fqn>/<key>`` one entry of optimizer ``i``'s state for
  the parameter named ``<fqn>``. Sharded parameters and their parameter-shaped state are saved as DTensors, so DCP
  records global offsets and can hand any rank layout back; everything else is saved once, by rank 0. DCP writes
  ``__<rank>_0.distcp`` per rank and its index, ``.metadata``;
- ``lightning_zero.pt``, written by rank 0: the rest of Lightning's checkpoint (loops, callbacks, schedulers,
  hyper-parameters), each optimizer's parameter groups (parameters listed by name; DCP would flatten them into
  separate entries) and which optimizer entries are shaped like their parameter;
- ``checksums.json``, written last by rank 0 (format 2 on; earlier checkpoints lack it and load unverified): the
  size and CRC-32 of every other file (see :mod:`.checksums`).

A save writes into a new hidden sibling directory and publishes it once every rank has finished, so the checkpoint's
path names one complete checkpoint, old or new, at every instant (see :mod:`.publish`); one the operating system
refuses raises the same error on every rank and leaves nothing (see :mod:`.disk`). A load treats the directory as
untrusted input: it opens only the regular files directly inside it (see :mod:`.containment`), checks every file
against the record and every size ``.metadata`` declares against the files before allocating (see :mod:`.layout`),
and unpickles nothing but tensors, plain containers and DCP's own classes unless the user trusts the checkpoint (see
:mod:`.unpickling`).
"""

from __future__ import annotations

import io
import os
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, BinaryIO

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor

from lightning_zero import _progress
from lightning_zero._checkpoint import disk, keys, layout, publish
from lightning_zero._checkpoint.checksums import (
    CHECKSUM_FILE,
    ChecksummingWriter,
    FileSum,
    Record,
    share,
    sum_bytes,
    sum_file,
)
from lightning_zero._checkpoint.containment import FOREIGN_HINT, file_size, inside, open_file
from lightning_zero._checkpoint.error import DAMAGE_HINT, CheckpointError
from lightning_zero._checkpoint.ranks import ALONE, Ranks
from lightning_zero._checkpoint.unpickling import (
    RestrictedLoadPlanner,
    Unpickling,
    VerifiedReader,
    load_torch_file,
    read_dcp_metadata,
)
from lightning_zero._threads import in_thread

DCP_METADATA = ".metadata"
META_FILE = "lightning_zero.pt"
_SMALL_FILES = {  # what a load reads whole before any shard, beside the record, each with its role
    DCP_METADATA: "DCP's index of every entry",
    META_FILE: "the rest of Lightning's checkpoint",
}
FORMAT_VERSION = 2  # 2: with checksums.json


def is_checkpoint_dir(path: str | os.PathLike) -> bool:
    path = Path(path)
    return (path / META_FILE).is_file() and (path / DCP_METADATA).is_file()


# --- saving ----------------------------------------------------------------------------------------------------------


def save(flat: dict[str, Any], meta: dict[str, Any], path: Path, ranks: Ranks) -> None:
    """Write ``flat`` with every rank into a new staging directory, then publish it at ``path`` (see
    :mod:`.publish`): ``path`` names a complete checkpoint, the old one or the new, at every instant. Where the
    operating system refuses a write (a full disk, a quota, a read-only filesystem), every rank raises the same
    :class:`CheckpointError` naming it, and the staging directory is gone."""
    staging = Path(ranks.on_first(lambda: str(_prepare(path)), f"prepare a staging directory for {path}"))
    writer = ChecksummingWriter(staging)
    try:
        # what every rank holds alike (buffers, step counters) is written by rank 0, as a single file would be
        dcp.save(flat, storage_writer=writer, planner=DefaultSavePlanner(dedup_save_to_lowest_rank=True))
    except (Exception, CheckpointException) as failure:  # DCP raises on every rank once any rank failed
        _abandon(staging, path, writer.os_error, ranks, failure)
    sums = ranks.all_gather(writer.sums)
    ranks.on_first(lambda: _finish(staging, path, meta, sums), f"publish {path}")


def _abandon(staging: Path, path: Path, os_error: OSError | None, ranks: Ranks, failure: BaseException) -> None:
    """After DCP's save failed on every rank: rank 0 removes the staging directory, and every rank raises the first
    operating-system error any rank met, else ``failure`` (collective)."""
    mine = None if os_error is None else (disk.describe(os_error, staging, ranks.rank), os_error.errno)
    described = ranks.all_gather(mine)
    if ranks.rank == 0:
        _remove_quietly(staging)
    first = next((found for found in described if found is not None), None)
    if first is None:
        raise failure
    raise disk.write_error(path, *first) from (os_error or failure)


def _remove_quietly(staging: Path) -> None:
    """Remove a failed save's staging directory; what cannot be removed now is a leftover the next save reclaims."""
    try:
        publish.remove(staging)
    except OSError as error:
        warnings.warn(f"Could not remove {staging}, left by the failed save: {error}", stacklevel=3)


def _prepare(path: Path) -> Path:
    try:
        publish.recover(path)
        # Leftovers of crashed saves, reclaimed now where they are incomplete (the space of a half-written
        # checkpoint), and every one if a checkpoint is at `path`; a complete leftover with none there waits for
        # this publish. A staging directory of a save still running is no leftover.
        has_checkpoint = path.is_dir()  # `recover` moved a kept copy back, if there was one
        publish.reclaim(path, keep=lambda leftover: not has_checkpoint and is_checkpoint_dir(leftover))
        return publish.make_staging_directory(path)
    except OSError as error:
        raise disk.write_error(path, disk.describe(error, path.parent, 0), error.errno) from error


def _finish(staging: Path, path: Path, meta: dict[str, Any], sums: list[dict[str, FileSum]]) -> None:
    """Rank 0, after every rank has written its files: our metadata, then the record of every file's checksum, then
    the publish; if any fails, the staging directory goes."""
    try:
        _write_own_files_and_publish(staging, path, meta, sums)
    except BaseException as failure:
        _remove_quietly(staging)
        error = disk.os_error_in(failure)
        if error is None:
            raise
        raise disk.write_error(path, disk.describe(error, staging, 0), error.errno) from failure
    try:
        publish.reclaim(path)
    except OSError as error:  # the checkpoint is published; what is left behind only takes space
        warnings.warn(f"Saved {path}, but could not remove what earlier saves left beside it: {error}", stacklevel=2)


def _write_own_files_and_publish(
    staging: Path, path: Path, meta: dict[str, Any], sums: list[dict[str, FileSum]]
) -> None:
    files = {name: file_sum for rank_sums in sums for name, file_sum in rank_sums.items()}
    publish.fsync_file(staging / DCP_METADATA)  # DCP wrote it unsynced (see ChecksummingWriter)
    files[DCP_METADATA] = sum_file(staging / DCP_METADATA)
    buffer = io.BytesIO()
    torch.save({"format": FORMAT_VERSION, **meta}, buffer)
    publish.write_new_file(staging / META_FILE, lambda file: file.write(buffer.getbuffer()))
    files[META_FILE] = sum_bytes(buffer.getbuffer())
    record = Record(files).encode()
    publish.write_new_file(staging / CHECKSUM_FILE, lambda file: file.write(record))
    publish.fsync_directory(staging)
    publish.publish_directory(staging, path)


# --- loading ---------------------------------------------------------------------------------------------------------


class ShardCheck:
    """This rank's share of the shard files (see :func:`.checksums.share`), checked against their
    checksums in a thread while the caller goes on, and the verdict every rank agrees on in :meth:`wait`.

    A resume loads while the check runs: from files not in the page cache, as a new job finds them, the check then
    costs nothing measurable (2 ranks on the 2-core development machine, a 1.69 GiB shard file each: 6.3 s, against
    7.0 s unchecked and 9.0 s checking before loading: the check would read the files from disk before the load
    could start)."""

    def __init__(self, path: Path, record: Record | None, ranks: Ranks) -> None:
        self.ranks = ranks
        self._pending: Future[CheckpointError | None] | None = None
        if record is not None:
            shards = {name: s for name, s in record.files.items() if name not in (DCP_METADATA, META_FILE)}
            mine = share(shards, ranks.rank, ranks.size)
            # a thread of its own, which ends with the check: a pool kept for later would not survive a fork
            self._pending = in_thread(lambda: _checked(lambda: record.check_files(path, mine), path))

    def wait(self) -> None:
        """Return on every rank once every shard file is as written, or raise on every rank the first damage any
        rank found (collective). The check's thread has ended either way."""
        self.ranks.agree(self._verdict())

    def _verdict(self) -> CheckpointError | None:
        """The damage this rank's share of the files shows, once the check's thread has ended."""
        return None if self._pending is None else self._pending.result()

    @contextmanager
    def overlapping(self) -> Iterator[None]:
        """Run the block while the check goes on; if the block fails, a damaged file is the better explanation. DCP
        fails on every rank at once (its ``CheckpointException``), and the ranks then agree on the verdict; any other
        error is this rank's alone (out of memory, say), while its peers are in the load's collectives: it takes only
        this rank's verdict, and never waits for theirs."""
        try:
            yield
        except CheckpointException:  # a BaseException; an interrupt waits for nothing
            self.wait()
            raise
        except Exception as error:
            damage = self._verdict()
            if damage is not None:
                raise damage from error
            raise
        self.wait()


def _checked(action: Callable[[], None], path: Path) -> CheckpointError | None:
    """The error ``action`` met reading the checkpoint at ``path``, as the one every rank will raise."""
    try:
        action()
    except CheckpointError as error:
        return error
    except OSError as error:  # unreadable here (permissions, a vanished file): every rank must still hear of it
        failure = CheckpointError(
            f"Checkpoint {path} cannot be read: {error}. HINT: check that every rank can read the whole directory."
        )
        failure.__cause__ = error
        return failure
    return None


@dataclass(frozen=True)
class Opened:
    """A checkpoint directory once :func:`open_directory` checked it: our metadata (``meta``), DCP's (``metadata``),
    and the check of the shard files' checksums, still running (``check``)."""

    path: Path
    meta: dict[str, Any]
    metadata: Metadata
    check: ShardCheck
    unpickling: Unpickling  # what its pickled entries may import


def open_directory(path: Path, ranks: Ranks = ALONE, unpickling: Unpickling = Unpickling.TORCH_DEFAULT) -> Opened:
    """The checkpoint directory at ``path``, once the small files are checked, every shard file is present and long
    enough, and every rank agrees (collective); the shard files' checksums are then being checked."""
    found: list[Any] = []

    def read() -> None:
        found.extend(_read_small_files(path, ranks, unpickling))
        _check_layout(path, found[1], found[2])

    ranks.agree(_checked(read, path))
    meta, metadata, record = found
    return Opened(path, meta, metadata, ShardCheck(path, record, ranks), unpickling)


def read_meta(
    path: Path, ranks: Ranks = ALONE, unpickling: Unpickling = Unpickling.TORCH_DEFAULT
) -> tuple[dict[str, Any], Metadata]:
    """Our metadata file and DCP's, after checking that every file of the checkpoint is present and, where the
    checkpoint records checksums, unchanged since it was written. Every rank raises the same error, or none does."""
    opened = open_directory(path, ranks, unpickling)
    opened.check.wait()
    return opened.meta, opened.metadata


def _read_small_files(
    path: Path, ranks: Ranks, unpickling: Unpickling
) -> tuple[dict[str, Any], Metadata, Record | None]:
    if not path.is_dir():
        raise CheckpointError(f"Checkpoint directory {path} does not exist.")
    for name, role in _SMALL_FILES.items():
        if not os.path.lexists(path / name):
            raise CheckpointError(
                f"{path} is not a complete lightning_zero checkpoint: it lacks `{name}` ({role}). HINT: copy the"
                " whole checkpoint directory; a checkpoint this release wrote is complete wherever its path exists."
            )
    with ExitStack() as opened:
        # containment: each a regular file directly inside the directory, opened once (the file checked is the file
        # read); then the record; then each file's size against it before a byte is read, and its CRC-32
        record_file = _open_record(path, opened)
        files = {name: opened.enter_context(open_file(path, name, role)) for name, role in _SMALL_FILES.items()}
        record = None if record_file is None else Record.parse(path, record_file.read())
        read = (lambda name, file: file.read()) if record is None else partial(record.read_opened, path)
        contents = {name: read(name, file) for name, file in files.items()}
    metadata = read_dcp_metadata(contents[DCP_METADATA], path / DCP_METADATA)
    meta = load_torch_file(contents[META_FILE], f"file {path / META_FILE}", unpickling)
    if not isinstance(meta, dict) or not {"checkpoint", "param_groups", "sharded"} <= meta.keys():
        raise CheckpointError(f"Checkpoint file {path / META_FILE} is not lightning_zero's metadata. {DAMAGE_HINT}")
    if record is None and meta.get("format", 1) >= 2:
        raise CheckpointError(
            f"Checkpoint file {path / CHECKSUM_FILE} is missing: the checkpoint was written with it. {DAMAGE_HINT}"
        )
    if record is None and ranks.rank == 0:
        warnings.warn(
            f"Checkpoint {path} has no {CHECKSUM_FILE}: it was written before lightning_zero recorded checksums, so"
            " its files load unverified.",
            stacklevel=3,
        )
    return meta, metadata, record


def _open_record(path: Path, opened: ExitStack) -> BinaryIO | None:
    """The record of the checkpoint at ``path``, opened as :mod:`.containment` allows and closed with ``opened``;
    ``None`` where there is none (a checkpoint of format 1)."""
    try:
        return opened.enter_context(open_file(path, CHECKSUM_FILE, "the record of every file's checksum"))
    except FileNotFoundError:
        return None


def _check_layout(path: Path, metadata: Metadata, record: Record | None) -> None:
    """Every file ``.metadata`` names is a file of the checkpoint (see :mod:`.containment`), listed in its record
    where there is one, present, and long enough for its entries; every size ``.metadata`` declares is backed by
    those bytes (see :mod:`.layout`)."""
    sizes: dict[str, int] = {}
    for index, info in (metadata.storage_data or {}).items():
        name = info.relative_path
        if name in sizes:
            continue
        entry = f"`.metadata` (for `{index.fqn}`)"
        inside(path, name, entry)
        if record is not None and name not in record.files:
            raise CheckpointError(
                f"Checkpoint {path}: {entry} names the file {name!r}, which `{CHECKSUM_FILE}` does not list; a load"
                f" reads only files whose checksums are recorded. {FOREIGN_HINT}"
            )
        size = file_size(path, name, entry)
        if size is None:
            raise CheckpointError(f"Checkpoint file {path / name} is missing; it holds `{index.fqn}`. {DAMAGE_HINT}")
        sizes[name] = size
    layout.check_storage(path, metadata, sizes)
    layout.check_entries(path, metadata)


def model_entries_to_load(
    target: dict[str, Any], metadata: Metadata, path: Path, owner: str, strict: bool
) -> dict[str, Any]:
    """The entries of ``target`` (a module's, ``model/<fqn>``; ``owner`` its class) to load from the checkpoint at
    ``path``: with ``strict``, all of them, where the checkpoint holds exactly these (else the error
    ``load_state_dict`` raises, in its words); otherwise those the checkpoint holds."""
    saved = [key for key in metadata.state_dict_metadata if key.startswith(keys.MODEL)]
    if not strict:
        return {key: value for key, value in target.items() if key in metadata.state_dict_metadata}
    missing = [key for key in target if key not in metadata.state_dict_metadata]
    unexpected = [key for key in saved if key not in target]
    if missing or unexpected:
        lines = [
            f"{kind} key(s) in state_dict: {', '.join(quoted)}. "
            for kind, names in (("Missing", missing), ("Unexpected", unexpected))
            if (quoted := [f'"{name}"' for name in keys.model_entries(names)])
        ]
        raise CheckpointError(
            f"Error(s) in loading state_dict for {owner} from checkpoint {path}:\n\t" + "\n\t".join(lines)
            + "\nHINT: load it into the model it was saved from; to load only the entries both hold, pass"
            " `strict=False` (Fabric: `fabric.load(..., strict=False)`; Trainer: set `model.strict_loading = False`)."
        )
    return target


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


def load(
    target: dict[str, Any], opened: Opened, *, no_dist: bool = False, progress: bool = False, verb: str = "loading"
) -> None:
    """Fill ``target`` (tensors and DTensors laid out for this run, ``None`` for a pickled entry) in place from the
    checkpoint ``opened``; non-tensor entries load as its unpickling allows. ``progress``: draw a bar of this rank's
    bytes on a terminal while they load, named ``verb``."""
    path = opened.path
    total = sum(_local_nbytes(value) for value in target.values() if isinstance(value, torch.Tensor))
    try:
        with _progress.progress(total, f"{verb} {path.name}", shown=progress) as advance:
            reader = VerifiedReader(path, opened.metadata)
            planner = RestrictedLoadPlanner(path, opened.unpickling, advance)
            dcp.load(target, storage_reader=reader, planner=planner, no_dist=no_dist)
    except CheckpointException as failure:  # DCP gathers every rank's errors; ours say all there is to say
        for error, _ in failure.failures.values():
            if isinstance(error, CheckpointError):
                raise CheckpointError(str(error)) from None
        raise


def read_whole(opened: Opened, wanted: list[str], *, progress: bool = False) -> dict[str, Any]:
    """The entries ``wanted`` of the checkpoint ``opened``, each tensor assembled whole as it is read, in this process
    alone, once every shard file passed its check. ``progress``: draw a bar on a terminal while they load."""
    entries = opened.metadata.state_dict_metadata
    read = {key: _empty_like(entries[key]) for key in wanted}
    with opened.check.overlapping(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process: the point here
        load(read, opened, no_dist=True, progress=progress, verb="reading")
    return read


def _empty_like(entry: Any) -> torch.Tensor | None:
    """Where an entry of ``.metadata`` loads: an empty tensor of its size, or ``None`` for a pickled object."""
    if isinstance(entry, TensorStorageMetadata):
        return torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
    return None


def _local_nbytes(tensor: torch.Tensor) -> int:
    """The bytes of ``tensor`` this rank holds (a DTensor's local shard)."""
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()

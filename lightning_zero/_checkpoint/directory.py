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
path names one complete checkpoint, old or new, at every instant (see :mod:`.publish`). A load
unpickles nothing but tensors, plain containers and DCP's own classes unless the user trusts the checkpoint (see
:mod:`.unpickling`), and checks every file against the record first.
"""

from __future__ import annotations

import io
import os
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from lightning_zero._checkpoint import publish
from lightning_zero._checkpoint.checksums import (
    CHECKSUM_FILE,
    ChecksummingWriter,
    FileSum,
    Record,
    share,
    sum_bytes,
    sum_file,
)
from lightning_zero._checkpoint.error import DAMAGE_HINT, CheckpointError
from lightning_zero._checkpoint.ranks import ALONE, Ranks
from lightning_zero._checkpoint.unpickling import (
    RestrictedLoadPlanner,
    Unpickling,
    VerifiedReader,
    load_torch_file,
    read_dcp_metadata,
)

DCP_METADATA = ".metadata"
META_FILE = "lightning_zero.pt"
FORMAT_VERSION = 2  # 2: with checksums.json


def is_checkpoint_dir(path: str | os.PathLike) -> bool:
    path = Path(path)
    return (path / META_FILE).is_file() and (path / DCP_METADATA).is_file()


# --- saving ----------------------------------------------------------------------------------------------------------


def save(flat: dict[str, Any], meta: dict[str, Any], path: Path, ranks: Ranks) -> None:
    """Write ``flat`` with every rank into a new staging directory, then publish it at ``path`` (see
    :mod:`.publish`): ``path`` names a complete checkpoint, the old one or the new, at every instant."""
    staging = Path(ranks.on_first(lambda: str(_prepare(path)), f"prepare a staging directory for {path}"))
    writer = ChecksummingWriter(staging)
    # what every rank holds alike (buffers, step counters) is written by rank 0, as a single-file checkpoint would be
    dcp.save(flat, storage_writer=writer, planner=DefaultSavePlanner(dedup_save_to_lowest_rank=True))
    sums = ranks.all_gather(writer.sums)
    ranks.on_first(lambda: _finish(staging, path, meta, sums), f"publish {path}")


def _prepare(path: Path) -> Path:
    publish.recover(path)
    # Leftovers of crashed saves, reclaimed now where they are incomplete (the space of a half-written checkpoint),
    # and every one if a checkpoint is at `path`; a complete leftover with none there waits for this publish.
    has_checkpoint = path.is_dir()  # `recover` moved a kept copy back, if there was one
    publish.reclaim(path, keep=lambda leftover: not has_checkpoint and is_checkpoint_dir(leftover))
    return publish.make_staging_directory(path)


def _finish(staging: Path, path: Path, meta: dict[str, Any], sums: list[dict[str, FileSum]]) -> None:
    """Rank 0, after every rank has written its files: our metadata, then the record of every file's checksum, then
    the publish."""
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
    try:
        publish.reclaim(path)
    except OSError as error:  # the checkpoint is published; what is left behind only takes space
        warnings.warn(f"Saved {path}, but could not remove what earlier saves left beside it: {error}", stacklevel=2)


# --- loading ---------------------------------------------------------------------------------------------------------


def readable_directory(path: Path) -> Path | None:
    """The checkpoint directory a load of ``path`` reads (see :func:`.publish.readable`); ``None``
    where ``path`` is no directory."""
    directory = publish.readable(path)
    if directory is not None and directory != path:
        warnings.warn(
            f"{path} does not exist: a save replacing it stopped between two renames, so the previous checkpoint,"
            f" kept at {directory}, is loaded; the next save to {path} moves it back.",
            stacklevel=2,
        )
    return directory


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
            checker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lightning_zero_checksums")
            self._pending = checker.submit(_checked, lambda: record.check_files(path, mine), path)
            checker.shutdown(wait=False)

    def wait(self) -> None:
        """Return on every rank once every shard file is as written, or raise on every rank the first damage any
        rank found (collective)."""
        self.ranks.agree(None if self._pending is None else self._pending.result())

    @contextmanager
    def overlapping(self) -> Iterator[None]:
        """Run the block while the check goes on; if the block fails, a damaged file is the better explanation."""
        try:
            yield
        except (Exception, CheckpointException):  # DCP's is a BaseException; an interrupt waits for nothing
            self.wait()
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


def open_checkpoint(
    path: Path, ranks: Ranks = ALONE, unpickling: Unpickling = Unpickling.TORCH_DEFAULT
) -> tuple[dict[str, Any], Metadata, ShardCheck]:
    """Our metadata file and DCP's, once the small files are checked, every shard file is present and long enough,
    and every rank agrees (collective); the shard files' checksums are then being checked (the third value)."""
    found: list[Any] = []

    def read() -> None:
        found.extend(_read_small_files(path, ranks, unpickling))
        _check_shard_lengths(path, found[1])

    ranks.agree(_checked(read, path))
    meta, metadata, record = found
    return meta, metadata, ShardCheck(path, record, ranks)


def read_meta(
    path: Path, ranks: Ranks = ALONE, unpickling: Unpickling = Unpickling.TORCH_DEFAULT
) -> tuple[dict[str, Any], Metadata]:
    """Our metadata file and DCP's, after checking that every file of the checkpoint is present and, where the
    checkpoint records checksums, unchanged since it was written. Every rank raises the same error, or none does."""
    meta, metadata, check = open_checkpoint(path, ranks, unpickling)
    check.wait()
    return meta, metadata


def _read_small_files(
    path: Path, ranks: Ranks, unpickling: Unpickling
) -> tuple[dict[str, Any], Metadata, Record | None]:
    if not path.is_dir():
        raise CheckpointError(f"Checkpoint directory {path} does not exist.")
    for name, role in ((DCP_METADATA, "DCP's index of every entry"), (META_FILE, "the rest of Lightning's checkpoint")):
        if not (path / name).is_file():
            raise CheckpointError(
                f"{path} is not a complete lightning_zero checkpoint: it lacks `{name}` ({role}). HINT: copy the"
                " whole checkpoint directory; a checkpoint this release wrote is complete wherever its path exists."
            )
    record = Record.read(path)
    contents = {name: (path / name).read_bytes() for name in (DCP_METADATA, META_FILE)}
    if record is not None:
        for name, data in contents.items():
            record.check_bytes(path, name, data)
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


def _check_shard_lengths(path: Path, metadata: Metadata) -> None:
    """Every shard file is present and long enough for the entries it holds."""
    needed: dict[str, tuple[int, str]] = {}
    for index, info in (metadata.storage_data or {}).items():
        end = info.offset + info.length
        if end > needed.get(info.relative_path, (0, ""))[0]:
            needed[info.relative_path] = (end, index.fqn)
    for relative, (end, fqn) in needed.items():
        file = path / relative
        if not file.is_file():
            raise CheckpointError(f"Checkpoint file {file} is missing; it holds `{fqn}`. {DAMAGE_HINT}")
        size = file.stat().st_size
        if size < end:
            raise CheckpointError(
                f"Checkpoint file {file} is truncated ({size} bytes, {end} needed for `{fqn}`). {DAMAGE_HINT}"
            )


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
    target: dict[str, Any], path: Path, metadata: Metadata, unpickling: Unpickling, *, no_dist: bool = False
) -> None:
    """Fill ``target`` (tensors and DTensors laid out for this run) in place from the checkpoint at ``path``, whose
    ``metadata`` :func:`open_checkpoint` or :func:`read_meta` returned; non-tensor entries load under ``unpickling``."""
    reader, planner = VerifiedReader(path, metadata), RestrictedLoadPlanner(path, unpickling)
    try:
        dcp.load(target, storage_reader=reader, planner=planner, no_dist=no_dist)
    except CheckpointException as failure:  # DCP gathers every rank's errors; ours say all there is to say
        for error, _ in failure.failures.values():
            if isinstance(error, CheckpointError):
                raise CheckpointError(str(error)) from None
        raise

"""A CRC-32 of every file of a checkpoint directory, recorded when it is written and checked before it is read.

Neither DCP nor torch's zip reader checks what it reads: one flipped bit in a shard file (raw tensor bytes) or in a
tensor of ``lightning_zero.pt`` (torch's reader ignores the CRC-32 the zip format stores) loads silently as other
numbers. So each rank sums the files it wrote right after writing them, from the page cache and while the disk syncs
them (:class:`ChecksummingWriter`); rank 0 gathers the sums, adds ``.metadata`` and ``lightning_zero.pt``, and writes
them last as ``checksums.json``, which carries a CRC-32 of its own entries so that damage to the record itself is told
apart from damage to the files it describes.

A load opens the small files once, then checks each one's size against the record before reading it and its CRC-32
once read, where every rank reads them (the bytes checked are the bytes parsed), and spreads the shard files over the
ranks, each read once (:func:`share`).
"""

from __future__ import annotations

import json
import os
import zlib
from concurrent.futures import wait
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from lightning_zero._checkpoint.containment import inside, open_file
from lightning_zero._checkpoint.disk import os_error_in
from lightning_zero._checkpoint.error import DAMAGE_HINT, CheckpointError
from lightning_zero._checkpoint.publish import fsync_file
from lightning_zero._threads import in_thread

CHECKSUM_FILE = "checksums.json"
ALGORITHM = "zlib.crc32"
_CHUNK = 16 * 2**20  # bytes read at a time: large enough that the sum, not Python, sets the pace


class FileSum(NamedTuple):
    size: int  # bytes
    crc32: int


def sum_bytes(data: bytes | memoryview) -> FileSum:
    return FileSum(len(data), zlib.crc32(data))


def sum_file(path: Path) -> FileSum:
    with open(path, "rb", buffering=0) as file:
        return _sum_open_file(file)


def _sum_open_file(file: BinaryIO) -> FileSum:
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    size, crc = 0, 0
    while count := file.readinto(buffer):
        crc = zlib.crc32(view[:count], crc)
        size += count
    return FileSum(size, crc)


def _canonical(files: dict[str, FileSum]) -> bytes:
    entries = {name: {"bytes": s.size, "crc32": f"{s.crc32:08x}"} for name, s in sorted(files.items())}
    return json.dumps(entries, sort_keys=True, separators=(",", ":")).encode()


@dataclass(frozen=True)
class Record:
    """The sums of a checkpoint's files by name, relative to its directory."""

    files: dict[str, FileSum]

    def encode(self) -> bytes:
        """The content of ``checksums.json``."""
        canonical = _canonical(self.files)
        return json.dumps(
            {"algorithm": ALGORITHM, "files": json.loads(canonical), "record_crc32": f"{zlib.crc32(canonical):08x}"},
            indent=1,
        ).encode()

    @classmethod
    def parse(cls, path: Path, data: bytes) -> Record:
        """The record of the checkpoint at ``path`` from the bytes of its ``checksums.json``, once they match their own
        CRC-32. Every file it names is a plain file name (see :mod:`.containment`)."""
        file = path / CHECKSUM_FILE
        try:
            content = json.loads(data)
            if content["algorithm"] != ALGORITHM:
                raise ValueError(f"unknown algorithm {content['algorithm']!r}")
            files = {name: FileSum(int(e["bytes"]), int(e["crc32"], 16)) for name, e in content["files"].items()}
            recorded = int(content["record_crc32"], 16)
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise CheckpointError(f"Checkpoint file {file} cannot be read ({error}). {DAMAGE_HINT}") from None
        if zlib.crc32(_canonical(files)) != recorded:
            raise CheckpointError(
                f"Checkpoint file {file} is damaged: its entries do not match its own CRC-32. {DAMAGE_HINT}"
            )
        for name in files:
            inside(path, name, f"`{CHECKSUM_FILE}`")
        return cls(files)

    def read_opened(self, path: Path, name: str, file: BinaryIO) -> bytes:
        """The bytes of the file ``name`` of the checkpoint at ``path``, opened as ``file``, once its size is the
        recorded one (a larger file is never read) and its bytes are the ones written."""
        expected = self._expected(path, name)
        _check_size(path / name, file, expected)
        data = file.read(expected.size + 1)
        _compare(path / name, expected, sum_bytes(data))
        return data

    def check_files(self, path: Path, names: list[str]) -> None:
        for name in names:
            expected = self._expected(path, name)
            with self._open(path, name, "a shard file", expected) as file:
                _compare(path / name, expected, _sum_open_file(file))

    def _open(self, path: Path, name: str, role: str, expected: FileSum) -> BinaryIO:
        """The file ``name``, opened as :mod:`.containment` allows, once its size is the recorded one."""
        try:
            file = open_file(path, name, f"{role}, listed in `{CHECKSUM_FILE}`")
        except FileNotFoundError:
            raise CheckpointError(
                f"Checkpoint file {path / name} is missing ({expected.size:,} bytes when it was written). {DAMAGE_HINT}"
            ) from None
        try:
            _check_size(path / name, file, expected)
        except CheckpointError:
            file.close()
            raise
        return file

    def _expected(self, path: Path, name: str) -> FileSum:
        if name not in self.files:
            raise CheckpointError(f"Checkpoint {path}: {CHECKSUM_FILE} has no entry for `{name}`. {DAMAGE_HINT}")
        return self.files[name]


def _check_size(path: Path, file: BinaryIO, expected: FileSum) -> None:
    """Raise before a byte of the open ``file`` is read if its size is not the recorded one."""
    size = os.fstat(file.fileno()).st_size
    if size != expected.size:
        _compare(path, expected, FileSum(size, expected.crc32))


def _compare(file: Path, expected: FileSum, actual: FileSum) -> None:
    if actual.size < expected.size:
        raise CheckpointError(
            f"Checkpoint file {file} is truncated: {actual.size:,} bytes, {expected.size:,} when it was written."
            f" {DAMAGE_HINT}"
        )
    if actual.size > expected.size:
        raise CheckpointError(
            f"Checkpoint file {file} has grown: {actual.size:,} bytes, {expected.size:,} when it was written."
            f" {DAMAGE_HINT}"
        )
    if actual.crc32 != expected.crc32:
        raise CheckpointError(
            f"Checkpoint file {file} is damaged: its CRC-32 is {actual.crc32:08x}, {expected.crc32:08x} when it was"
            f" written (same size, {actual.size:,} bytes: bits changed on disk or in a copy). {DAMAGE_HINT}"
        )


def share(files: dict[str, FileSum], rank: int, world_size: int) -> list[str]:
    """The files rank ``rank`` checks: largest first, each to the rank with the fewest bytes so far, so every file is
    read once and the ranks read about as much. The same on every rank."""
    load = [0] * world_size
    mine = []
    for name, file_sum in sorted(files.items(), key=lambda item: (-item[1].size, item[0])):
        reader = load.index(min(load))
        load[reader] += file_sum.size
        if reader == rank:
            mine.append(name)
    return mine


class ChecksummingWriter(FileSystemWriter):
    """DCP's file writer that sums each file this rank wrote (``sums``, by name) while the disk syncs it: DCP's own
    sync is off and done here, a thread per file, so summing from the page cache and waiting for the disk overlap
    instead of adding up (``os.fsync`` and ``zlib.crc32`` both release the GIL). ``.metadata``, which DCP writes
    after this, is synced by the caller."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, sync_files=False)
        self.sums: dict[str, FileSum] = {}
        self.os_error: OSError | None = None  # what stopped this rank's writing, if the operating system did

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[Any]:
        try:
            future = super().write_data(plan, planner)
            written = sorted({result.storage_data.relative_path for result in future.wait()})
            files = {name: Path(self.path) / name for name in written}
            synced = []
            try:
                synced.extend(in_thread(partial(fsync_file, file)) for file in files.values())
                self.sums = {name: sum_file(file) for name, file in files.items()}
            finally:
                wait(synced)  # no thread outlives the save, however it ends
            for sync in synced:
                sync.result()
        except Exception as failure:
            self.os_error = os_error_in(failure)
            raise
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """DCP's coordinator writes ``.metadata``."""
        try:
            super().finish(metadata, results)
        except Exception as failure:
            self.os_error = os_error_in(failure)
            raise

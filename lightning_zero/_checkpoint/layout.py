"""DCP's ``.metadata`` checked against the files it points into, before a load allocates or reads anything by it.

Vocabulary (DCP's own words):

- *entry*: one key of the flat state dict (``model/<fqn>``, ``optim/...``), declared in ``state_dict_metadata``: a
  tensor's global size, dtype and *chunks*, or a non-tensor's bytes.
- *chunk*: a box of the global tensor (``offsets``, ``sizes``, per dimension) that one rank saved.
- *storage*: where a chunk or a non-tensor entry lies, ``storage_data``: a file of the checkpoint, an offset and a
  length. DCP's file format (``torch_save``) stores each chunk as a ``torch.save`` of the chunk, so a storage is a
  little longer than the chunk's raw bytes, never shorter.

The rules, each a :class:`CheckpointError` naming the file and the entry: every size, offset and length is a
non-negative integer; a storage lies inside its file and overlaps no other; the chunks of an entry lie inside its
global size and cover it exactly once; each chunk's raw bytes fit in its storage. Together they bound what a load
allocates by the bytes the checkpoint holds on disk: a ``.metadata`` declaring 2**40 elements, or 8,000 chunks over
one stored tensor, is refused before any tensor exists. :func:`check_stored_chunk` then checks what each storage holds
(the shape and dtype the ``torch.save`` inside declares) before its tensor is loaded.
"""

from __future__ import annotations

import io
import itertools
import math
import os
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from lightning_zero._checkpoint.containment import FOREIGN_HINT
from lightning_zero._checkpoint.error import DAMAGE_HINT, CheckpointError


def _refuse(path: Path, what: str) -> CheckpointError:
    return CheckpointError(f"Checkpoint {path}: {what}. {FOREIGN_HINT}")


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _counts(values: object) -> tuple[int, ...] | None:
    """``values`` as a tuple of non-negative integers; ``None`` if it is not one."""
    if not isinstance(values, Sequence) or not all(_is_count(v) for v in values):
        return None
    return tuple(values)


def check_storage(path: Path, metadata: Metadata, file_sizes: dict[str, int]) -> None:
    """Every storage lies inside its file (``file_sizes``: by name, every file ``storage_data`` names) and overlaps
    no other storage."""
    by_file: dict[str, list[tuple[int, int, str]]] = {}
    for index, info in (metadata.storage_data or {}).items():
        fqn = getattr(index, "fqn", index)
        if not _is_count(info.offset) or not _is_count(info.length):
            raise _refuse(path, f"`.metadata` stores `{fqn}` at offset {info.offset!r}, length {info.length!r}")
        if getattr(info, "transform_descriptors", None):
            raise _refuse(path, f"`.metadata` stores `{fqn}` transformed ({info.transform_descriptors!r})")
        end, size = info.offset + info.length, file_sizes[info.relative_path]
        if end > size:
            raise CheckpointError(
                f"Checkpoint file {path / info.relative_path} is truncated ({size} bytes, {end} needed for `{fqn}`)."
                f" {DAMAGE_HINT}"
            )
        by_file.setdefault(info.relative_path, []).append((info.offset, end, fqn))
    for name, ranges in by_file.items():
        ranges.sort()
        for (_, end, first), (start, _, second) in itertools.pairwise(ranges):
            if start < end:
                raise _refuse(path, f"`.metadata` stores `{first}` and `{second}` over the same bytes of `{name}`")


def check_entries(path: Path, metadata: Metadata) -> None:
    """Every entry's chunks lie inside it, cover it exactly once and fit in their storage (see the module's rules);
    call after :func:`check_storage`."""
    storage = metadata.storage_data or {}
    for fqn, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, BytesStorageMetadata):
            if MetadataIndex(fqn) not in storage:
                raise _refuse(path, f"`.metadata` declares `{fqn}` but stores it nowhere")
        elif isinstance(entry, TensorStorageMetadata):
            _check_tensor(path, fqn, entry, storage)
        else:
            raise _refuse(path, f"`.metadata` declares `{fqn}` as a {type(entry).__name__}")


def _check_tensor(path: Path, fqn: str, entry: TensorStorageMetadata, storage: dict[MetadataIndex, Any]) -> None:
    size = _counts(entry.size)
    dtype = getattr(entry.properties, "dtype", None)
    if size is None or not isinstance(dtype, torch.dtype):
        raise _refuse(path, f"`.metadata` declares `{fqn}` of size {entry.size!r} and dtype {dtype!r}")
    boxes: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    covered = 0
    for chunk in entry.chunks:
        offsets, sizes = _counts(chunk.offsets), _counts(chunk.sizes)
        if offsets is None or sizes is None or len(offsets) != len(size) or len(sizes) != len(size):
            raise _refuse(path, f"`.metadata` declares a chunk of `{fqn}` at {chunk.offsets!r} of size {chunk.sizes!r}")
        if any(o + s > whole for o, s, whole in zip(offsets, sizes, size, strict=True)):
            raise _refuse(
                path, f"`.metadata` declares a chunk of `{fqn}` at {offsets} of size {sizes}, outside its size {size}"
            )
        info = storage.get(MetadataIndex(fqn, chunk.offsets))
        if info is None:
            raise _refuse(path, f"`.metadata` declares a chunk of `{fqn}` at {offsets} but stores it nowhere")
        raw = math.prod(sizes) * dtype.itemsize
        if raw > info.length:
            raise _refuse(
                path,
                f"`.metadata` declares a chunk of `{fqn}` at {offsets} of {raw:,} bytes ({sizes}, {dtype}), stored in"
                f" {info.length:,} bytes of `{info.relative_path}`",
            )
        covered += math.prod(sizes)
        boxes.append((offsets, sizes))
    if covered != math.prod(size):
        raise _refuse(
            path,
            f"`.metadata` declares `{fqn}` of size {size} ({math.prod(size):,} elements) in chunks of"
            f" {covered:,} elements",
        )
    overlap = _first_overlap(boxes)
    if overlap is not None:
        raise _refuse(path, f"`.metadata` declares chunks of `{fqn}` at {overlap[0]} and {overlap[1]} that overlap")


def _first_overlap(
    boxes: list[tuple[tuple[int, ...], tuple[int, ...]]],
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The offsets of two boxes that share an element, if any: a sweep along dimension 0, comparing only boxes whose
    rows meet (none, for DCP's row shards)."""
    solid = sorted((b for b in boxes if all(b[1])), key=lambda b: b[0])
    if solid and not solid[0][0]:  # 0-dim: one element, so any two boxes share it
        return (solid[0][0], solid[1][0]) if len(solid) > 1 else None
    active: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    for offsets, sizes in solid:
        active = [b for b in active if b[0][0] + b[1][0] > offsets[0]]
        for other_offsets, other_sizes in active:
            if all(
                o < p + q and p < o + s
                for o, s, p, q in zip(offsets[1:], sizes[1:], other_offsets[1:], other_sizes[1:], strict=True)
            ):
                return other_offsets, offsets
        active.append((offsets, sizes))
    return None


# --- what one storage holds ------------------------------------------------------------------------------------------


class StorageWindow(io.RawIOBase):
    """The ``length`` bytes at ``offset`` of the open file ``base`` as a file of their own, every seek and read kept
    inside them (DCP's own view misplaces seeks from the end, which reading a zip's directory needs)."""

    def __init__(self, base: IO[bytes], offset: int, length: int) -> None:
        super().__init__()
        self.base, self.offset, self.length = base, offset, length
        self.position = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        start = {os.SEEK_SET: 0, os.SEEK_CUR: self.position, os.SEEK_END: self.length}[whence]
        self.position = min(max(start + offset, 0), self.length)
        return self.position

    def tell(self) -> int:
        return self.position

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer)[: self.length - self.position]
        self.base.seek(self.offset + self.position)
        count = self.base.readinto(view) or 0
        self.position += count
        return count


def expected_chunks(metadata: Metadata) -> dict[int, tuple[str, ChunkStorageMetadata, torch.dtype]]:
    """Per storage (by ``id`` of its ``storage_data`` value), the tensor chunk it must hold: its entry, its box, its
    dtype."""
    storage = metadata.storage_data or {}
    expected = {}
    for fqn, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            for chunk in entry.chunks:
                expected[id(storage[MetadataIndex(fqn, chunk.offsets)])] = (fqn, chunk, entry.properties.dtype)
    return expected


def check_stored_chunk(
    stream: IO[bytes], file: Path, fqn: str, chunk: ChunkStorageMetadata, dtype: torch.dtype
) -> None:
    """``stream``, one storage of ``file``, is a ``torch.save`` of exactly the chunk ``.metadata`` declares: every
    record stored uncompressed, and one tensor of the chunk's shape and dtype over a storage of its bytes. Read from
    the zip's directory and pickle alone (``map_location="meta"`` allocates nothing), so that loading it allocates
    no more than the chunk; ``stream`` is left at its start."""
    try:
        compressed = [i.filename for i in zipfile.ZipFile(stream).infolist() if i.compress_type != zipfile.ZIP_STORED]
        stream.seek(0)
        declared = None if compressed else torch.load(stream, map_location="meta", weights_only=True)
    except Exception as error:
        raise CheckpointError(
            f"Checkpoint file {file}: the storage of `{fqn}` at {tuple(chunk.offsets)} cannot be read as a tensor"
            f" ({type(error).__name__}: {error}). {FOREIGN_HINT}"
        ) from None
    finally:
        stream.seek(0)
    expected = (tuple(chunk.sizes), dtype, math.prod(chunk.sizes) * dtype.itemsize)
    found = (
        None
        if not isinstance(declared, torch.Tensor)
        else (tuple(declared.shape), declared.dtype, declared.untyped_storage().nbytes())
    )
    if found != expected:
        held = (
            f"compressed records {compressed}"
            if compressed
            else (
                f"a {type(declared).__name__}" if found is None else f"shape {found[0]}, {found[1]}, {found[2]:,} bytes"
            )
        )
        raise CheckpointError(
            f"Checkpoint file {file}: the storage of `{fqn}` at {tuple(chunk.offsets)} holds {held}; `.metadata`"
            f" declares shape {expected[0]}, {dtype}, {expected[2]:,} bytes. {FOREIGN_HINT}"
        )

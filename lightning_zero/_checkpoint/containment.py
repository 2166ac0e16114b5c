"""The files a load opens: regular files directly inside the checkpoint directory, and nothing else.

A checkpoint directory names its own files in two places, ``checksums.json`` (each file's sum) and DCP's
``.metadata`` (the file each entry is stored in). Both are input: a directory copied from elsewhere could name
``/etc/passwd``, ``../other-run/__0_0.distcp`` or a link to either, and reading it would leak that file's size, spend
the time to read it, or load another checkpoint's weights. So every name must be a plain file name (no separator, not
``.`` or ``..``), and what it names must be a regular file, opened without following a link (``O_NOFOLLOW``) and
without waiting on a FIFO (``O_NONBLOCK``), then checked with ``fstat``: the file checked is the file read.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import BinaryIO

from lightning_zero._checkpoint.error import CheckpointError

# What a checkpoint that was altered to read elsewhere should be met with.
FOREIGN_HINT = (
    "HINT: lightning_zero writes no such checkpoint: it was altered since it was written; do not load it, resume from"
    " another one."
)


def _why_not_a_plain_name(name: object) -> str | None:
    if not isinstance(name, str) or not name:
        return "not a file name"
    if name in (".", ".."):
        return "not a file"
    if "\0" in name:
        return "a name with a NUL byte"
    if os.path.isabs(name):
        return "an absolute path"
    if "/" in name or (os.altsep is not None and os.altsep in name) or os.sep in name:
        return "a path through other directories"
    return None


def inside(directory: Path, name: object, entry: str) -> Path:
    """The path of the file ``name`` that ``entry`` (what names it, for the error) names in the checkpoint at
    ``directory``; :class:`CheckpointError` unless ``name`` is a plain file name."""
    reason = _why_not_a_plain_name(name)
    if reason is not None:
        raise CheckpointError(
            f"Checkpoint {directory}: {entry} names {name!r}, {reason}; a load reads only the files directly inside"
            f" the checkpoint directory. {FOREIGN_HINT}"
        )
    return directory / str(name)


def open_file(directory: Path, name: object, entry: str) -> BinaryIO:
    """Open the file ``name`` of the checkpoint at ``directory`` for reading: a regular file directly inside it, not
    a link (:func:`inside`); ``FileNotFoundError`` where there is none."""
    path = inside(directory, name, entry)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as error:
        if os.path.islink(path):  # ELOOP, or EMLINK on some systems
            raise CheckpointError(
                f"Checkpoint file {path} ({entry}) is a symbolic link; a load reads only the checkpoint's own files."
                f" {FOREIGN_HINT}"
            ) from None
        raise error
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CheckpointError(
            f"Checkpoint file {path} ({entry}) is not a regular file; a load reads only the checkpoint's own files."
            f" {FOREIGN_HINT}"
        )
    return os.fdopen(fd, "rb")


def file_size(directory: Path, name: object, entry: str) -> int | None:
    """The size of the regular file ``name`` directly inside the checkpoint at ``directory``, opened as a load would
    open it; ``None`` where there is no such file."""
    try:
        with open_file(directory, name, entry) as file:
            return os.fstat(file.fileno()).st_size
    except FileNotFoundError:
        return None

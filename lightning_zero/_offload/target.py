"""Where the optimizer lives when it is offloaded, and the checks on the options that say so."""

from __future__ import annotations

import os
import tempfile
import warnings
from enum import Enum
from pathlib import Path

from lightning_zero._files import nameless_file


class OffloadError(RuntimeError):
    """The offload directory cannot hold what it must."""


class OffloadTarget(Enum):
    """Where the optimizer's state and step live."""

    DEVICE = "device"  # with the parameters: no offload
    CPU = "cpu"  # masters, gradient copies, optimizer state and the step in host memory
    DISK = "disk"  # as CPU, in memory-mapped files under the offload directory


def check_directory(option: str, directory: Path) -> Path:
    """``directory`` must exist and take new files, or training would fail (or lose state) later."""
    if directory.exists() and not directory.is_dir():
        raise OffloadError(
            f"`{option}={str(directory)!r}` is a file, not a directory. HINT: point `{option}` at a directory on a"
            f" local disk with room for the optimizer state, such as `{directory.parent}` (the file's own)."
        )
    if not directory.is_dir():
        raise OffloadError(
            f"`{option}={str(directory)!r}` is not an existing directory. HINT: create it (`mkdir -p {directory}`)"
            " or point it at a directory on a local disk with room for the optimizer state."
        )
    filesystem = memory_filesystem(directory)
    if filesystem is not None:
        warnings.warn(_in_memory(option, directory, filesystem), stacklevel=4)
    try:
        os.close(nameless_file(directory))  # as the state's files will be made
    except OSError as error:
        raise OffloadError(
            f"`{option}={str(directory)!r}` is not writable: {error.strerror}. HINT: choose a directory this process"
            " can create files in."
        ) from error
    return directory


def _in_memory(option: str, directory: Path, filesystem: str) -> str:
    """The warning for ``directory`` on a memory ``filesystem``: the temporary directory is where ``"zero3_infinity"``
    puts its files when no ``offload_dir`` is given, so there the user may not know they chose it."""
    where, hint = f"`{option}={str(directory)!r}`", f"point `{option}` at a directory on a local disk"
    if directory.resolve() == Path(tempfile.gettempdir()).resolve():
        where += ', the temporary directory where `"zero3_infinity"` puts its files unless told otherwise,'
        hint = (
            f"{hint}, e.g. `Zero3Strategy(offload_parameters='disk', offload_dir='/path/on/disk')` in place of"
            ' `"zero3_infinity"`, or start Python with `TMPDIR` set to a directory on a local disk'
        )
    return (
        f"{where} is on a {filesystem} filesystem, which lives in memory: what is offloaded there takes host memory as"
        f" before. HINT: {hint}."
    )


_IN_MEMORY = ("tmpfs", "ramfs")


def memory_filesystem(directory: Path) -> str | None:
    """The type of the filesystem holding ``directory`` if it lives in memory (tmpfs, ramfs), from the mount table
    (Linux); ``None`` otherwise, or where there is no such table."""
    try:
        mounts = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return None
    path = str(directory.resolve())
    best, kind = "", None
    for line in mounts:
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, fields[2]
    return kind if kind in _IN_MEMORY else None

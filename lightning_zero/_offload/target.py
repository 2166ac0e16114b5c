"""Where the optimizer lives when it is offloaded, and the checks on the options that say so."""

from __future__ import annotations

import tempfile
from enum import Enum
from pathlib import Path


class OffloadError(RuntimeError):
    """The offload directory cannot hold what it must."""


class OffloadTarget(Enum):
    """Where the optimizer's state and step live."""

    DEVICE = "device"  # with the parameters: no offload
    CPU = "cpu"  # masters, gradient copies, optimizer state and the step in host memory
    DISK = "disk"  # as CPU, with the optimizer state in memory-mapped files under the offload directory


def check_directory(option: str, directory: Path) -> Path:
    """``directory`` must exist and take new files, or training would fail (or lose state) later."""
    if not directory.is_dir():
        raise OffloadError(
            f"`{option}={str(directory)!r}` is not an existing directory. HINT: create it (`mkdir -p {directory}`)"
            " or point it at a directory on a local disk with room for the optimizer state."
        )
    try:
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".lightning_zero-probe-"):
            pass
    except OSError as error:
        raise OffloadError(
            f"`{option}={str(directory)!r}` is not writable: {error.strerror}. HINT: choose a directory this process"
            " can create files in."
        ) from error
    return directory

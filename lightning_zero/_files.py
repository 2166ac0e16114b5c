"""Memory-mapped files whose space is reserved when they are created.

A *named* file (:func:`reserved_mapping`) is for other processes to open; a *nameless* one
(:func:`nameless_mapping`) is for this process alone, and nothing of it outlives the process, however it ends: the
kernel frees a file that has no name once its last descriptor and mapping are gone, at any exit, SIGKILL included.
"""

from __future__ import annotations

import errno
import mmap
import os
import tempfile
from pathlib import Path

# O_TMPFILE where the filesystem lacks it: EOPNOTSUPP, or EISDIR from kernels that predate it (O_DIRECTORY is in it)
_NO_TMPFILE = (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL)


def reserved_mapping(path: Path, size: int) -> mmap.mmap:
    """A new file of ``size`` bytes at ``path``, mapped shared. Its space is reserved now, so a full disk (or
    ``/dev/shm``) raises ``OSError`` here instead of SIGBUS at a later write; on failure no file is left."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        return _map_reserved(fd, size)
    except OSError:
        path.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)


def nameless_mapping(directory: Path, size: int) -> tuple[int, mmap.mmap]:
    """A new file of ``size`` bytes on ``directory``'s filesystem, with no name, mapped shared, and its descriptor
    (the caller closes it: the file lives until then and its mapping is gone); its space is reserved now, as in
    :func:`reserved_mapping`."""
    fd = nameless_file(directory)
    try:
        return fd, _map_reserved(fd, size)
    except OSError:
        os.close(fd)
        raise


def nameless_file(directory: Path) -> int:
    """A descriptor of a new, empty file on ``directory``'s filesystem that has no name: ``O_TMPFILE``, or where the
    filesystem lacks it a file unlinked right after it is created (only a kill in between leaves it, empty)."""
    fd = tmpfile(directory, os.O_RDWR, 0o600)
    if fd is not None:
        return fd
    fd, name = tempfile.mkstemp(dir=directory, prefix=".lightning_zero-")
    os.unlink(name)
    return fd


def tmpfile(directory: Path, flags: int, mode: int) -> int | None:
    """A descriptor of a new file on ``directory``'s filesystem that has no name (``O_TMPFILE``, opened with
    ``flags``); ``None`` where the system or the filesystem lacks ``O_TMPFILE``."""
    tmpfile_flag = getattr(os, "O_TMPFILE", 0)
    if not tmpfile_flag:
        return None
    try:
        return os.open(directory, tmpfile_flag | flags, mode)
    except OSError as error:
        if error.errno not in _NO_TMPFILE:
            raise
        return None


def _map_reserved(fd: int, size: int) -> mmap.mmap:
    os.posix_fallocate(fd, 0, size)
    return mmap.mmap(fd, size)

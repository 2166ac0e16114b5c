"""Writing back one byte range of a file, not the whole file: Linux's ``sync_file_range`` through ``ctypes``.

``fdatasync`` writes every dirty page of a file and waits for all of them, so retiring one range of a file whose
other ranges are still being written waits for those too. :func:`start_writeback` starts the writeback of a range's
dirty pages and returns at once; :func:`wait_written` waits until the range is on the disk (it starts what is not
started yet first). Neither commits the file's metadata: the offload files have no names and are never read after
the process, so only the pages matter. Where the C library has no ``sync_file_range`` (not Linux), starting does
nothing and waiting is ``fdatasync``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections.abc import Callable

# <fcntl.h>
_WAIT_BEFORE = 1  # wait for a writeback of the range already under way
_WRITE = 2  # start writing back its dirty pages
_WAIT_AFTER = 4  # wait for that writeback to finish


def _bind() -> Callable[[int, int, int, int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    function = getattr(ctypes.CDLL(name, use_errno=True), "sync_file_range", None)
    if function is None:
        return None
    function.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    function.restype = ctypes.c_int
    return function


_sync_file_range = _bind()


def _call(fd: int, offset: int, length: int, flags: int) -> None:
    assert _sync_file_range is not None
    if _sync_file_range(fd, offset, length, flags) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"sync_file_range: {os.strerror(error)}")


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Start writing back the dirty pages of ``length`` bytes of ``fd`` from ``offset``; returns at once."""
    if _sync_file_range is not None:
        _call(fd, offset, length, _WRITE)


def wait_written(fd: int, offset: int, length: int) -> None:
    """Return once ``length`` bytes of ``fd`` from ``offset`` are on the disk."""
    if _sync_file_range is None:
        os.fdatasync(fd)
        return
    _call(fd, offset, length, _WAIT_BEFORE | _WRITE | _WAIT_AFTER)


def ranged() -> bool:
    """Whether a range is written back alone here (``sync_file_range``), not its whole file."""
    return _sync_file_range is not None

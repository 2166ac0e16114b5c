"""Memory-mapped files whose space is reserved when they are created."""

from __future__ import annotations

import mmap
import os
from pathlib import Path


def reserved_mapping(path: Path, size: int) -> mmap.mmap:
    """A new file of ``size`` bytes at ``path``, mapped shared. Its space is reserved now, so a full disk (or
    ``/dev/shm``) raises ``OSError`` here instead of SIGBUS at a later write; on failure no file is left."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
        return mmap.mmap(fd, size)
    except OSError:
        path.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)

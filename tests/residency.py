"""Which pages of a file are in the page cache, as ``mincore`` reports them: the file is mapped for reading (which
reads nothing), asked, and unmapped."""

from __future__ import annotations

import ctypes
import mmap

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
_libc.mmap.restype = ctypes.c_void_p
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte))
_MAP_FAILED = ctypes.c_void_p(-1).value


def resident_pages(fd: int, offset: int, length: int) -> list[bool]:
    """For each page of ``length`` bytes of ``fd`` from ``offset`` (page-aligned), whether it is in the page cache."""
    address = _libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, offset)
    if address in (None, _MAP_FAILED):
        raise OSError(ctypes.get_errno(), "mmap failed")
    try:
        pages = -(-length // mmap.PAGESIZE)
        vector = (ctypes.c_ubyte * pages)()
        if _libc.mincore(address, length, vector) != 0:
            raise OSError(ctypes.get_errno(), "mincore failed")
        return [bool(byte & 1) for byte in vector]
    finally:
        _libc.munmap(address, length)


def resident_bytes(fd: int, offset: int, length: int) -> int:
    """Bytes of ``length`` bytes of ``fd`` from ``offset`` that are in the page cache."""
    return sum(resident_pages(fd, offset, length)) * mmap.PAGESIZE

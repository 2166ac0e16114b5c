"""What a save says when the operating system refuses to write it: the error, the file, and what to do.

torch's zip writer reports a failed write as ``RuntimeError: [enforce fail at inline_container.cc:...] unexpected
pos ...``, keeping the ``OSError`` only as the exception's context, and DCP gathers every rank's failure into one
``CheckpointException`` whose copies on other ranks lose that context. So each rank finds the ``OSError`` behind its
own failure (:func:`os_error_in`) where it happens, and a save raises :func:`write_error`'s message on every rank.
"""

from __future__ import annotations

import errno
from pathlib import Path

from lightning_zero._checkpoint.error import CheckpointError

_HINTS = {
    errno.ENOSPC: "free space on that filesystem, or save to another one (`ModelCheckpoint(dirpath=...)`)",
    errno.EDQUOT: "free space within your quota on that filesystem, or save to another one",
    errno.EFBIG: (
        "raise the file size limit (`ulimit -f`: the limit of this process; the filesystem's largest file), or save"
        " to another filesystem"
    ),
    errno.EROFS: "save to a writable directory (`ModelCheckpoint(dirpath=...)`), or remount this one read-write",
}


def os_error_in(failure: BaseException) -> OSError | None:
    """The ``OSError`` ``failure`` is, or was raised while handling (its ``__cause__`` or ``__context__`` chain)."""
    seen: set[int] = set()
    error: BaseException | None = failure
    while error is not None and id(error) not in seen:
        if isinstance(error, OSError):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def describe(error: OSError, where: Path, rank: int) -> str:
    """What rank ``rank`` met writing under ``where`` (the file, where the error names none)."""
    file = error.filename or where
    return f"rank {rank} could not write {file}: [Errno {error.errno}] {error.strerror or error}"


def write_error(path: Path, what: str, error_number: int | None) -> CheckpointError:
    """The error a save of ``path`` raises on every rank once ``what`` (:func:`describe`) stopped it."""
    hint = _HINTS.get(error_number or 0, "check that every rank can write to that directory")
    return CheckpointError(
        f"Saving checkpoint {path} failed: {what}. Whatever {path} held before is unchanged, and this save left"
        f" nothing behind. HINT: {hint}."
    )

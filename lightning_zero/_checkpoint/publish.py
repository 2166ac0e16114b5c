"""Putting a finished checkpoint in place so that its path always names one complete checkpoint, old or new.

Vocabulary:

- *target*: the path the user names (``trainer.save_checkpoint(target)``, ``ModelCheckpoint``'s file names).
- *staging*: a new hidden sibling, ``.NAME.partial-<saver>-<random>-<host>``, created exclusively (never through a
  link planted at a guessable name) and filled completely before it is published; ``<saver>`` is the process that
  created it (see :mod:`lightning_zero._creator`), ``<host>`` the machine it runs on.
- *kept copy*: ``.NAME.old``, the previous checkpoint while a filesystem that cannot swap two directories (NFS, some
  FUSE filesystems) replaces it by two renames.
- *leftovers*: staging directories and kept copies of saves that died; the next save to the same target removes them.
  A staging directory whose saver is alive, or cannot be told dead (another host, another PID namespace), is no
  leftover: another job saving to the same target is using it. Names of earlier releases record no saver and are
  leftovers.

A publish swaps staging and target in one ``renameat2(RENAME_EXCHANGE)`` (Linux), then removes the old checkpoint,
now at the staging name; a first publish renames with ``RENAME_NOREPLACE``. Where the filesystem refuses the swap (or
the system has no ``renameat2``), the target is renamed to the kept copy, staging to the target, then the kept copy
is removed. A first publish that finds a target published meanwhile (another job saving to the same path) swaps with
it instead. Between those two renames no target exists, so the *recovery rule* applies: a kept copy with no target is
the checkpoint (:func:`readable` loads it, :func:`recover`, at the next save, moves it back), and a kept copy beside a
target is the replaced one. Nothing is removed before its replacement is published. Removal never follows a link.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import secrets
import shutil
import socket
import stat
import sys
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from lightning_zero._creator import Creator
from lightning_zero._files import tmpfile

_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2
# for a libc without the renameat2 wrapper (glibc before 2.28)
_SYS_RENAMEAT2 = {"x86_64": 316, "aarch64": 276, "riscv64": 276, "ppc64le": 357, "s390x": 347}
# what a filesystem answers when it does not know a flag of renameat2
_UNSUPPORTED = frozenset({errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP})



def _libc_renameat2() -> Callable[[bytes, bytes, int], int] | None:
    if sys.platform != "linux":
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    function = getattr(libc, "renameat2", None)
    if function is not None:
        function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
        function.restype = ctypes.c_int
        return lambda source, target, flags: function(_AT_FDCWD, source, _AT_FDCWD, target, flags)
    number = _SYS_RENAMEAT2.get(platform.machine())
    if number is None:
        return None
    syscall = libc.syscall
    syscall.restype = ctypes.c_long
    return lambda source, target, flags: syscall(
        ctypes.c_long(number), ctypes.c_int(_AT_FDCWD), ctypes.c_char_p(source), ctypes.c_int(_AT_FDCWD),
        ctypes.c_char_p(target), ctypes.c_uint(flags),
    )


_renameat2_call = _libc_renameat2()


def renameat2(source: Path, target: Path, flags: int) -> None:
    """Linux's ``renameat2``; ``OSError(ENOSYS)`` where there is none."""
    if _renameat2_call is None:
        raise OSError(errno.ENOSYS, "renameat2 is not available", str(source), None, str(target))
    if _renameat2_call(os.fsencode(source), os.fsencode(target), flags) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), str(source), None, str(target))


def exchange(staging: Path, target: Path) -> None:
    renameat2(staging, target, _RENAME_EXCHANGE)


def rename_new(source: Path, target: Path) -> None:
    """Rename ``source`` to ``target``, which must not exist."""
    try:
        renameat2(source, target, _RENAME_NOREPLACE)
    except OSError as error:
        if error.errno not in _UNSUPPORTED:
            raise
        if os.path.lexists(target):
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(target)) from None
        os.rename(source, target)


def remove(path: Path) -> None:
    """Delete ``path``, a directory tree, a file or a link; a link goes, never what it points to (``shutil.rmtree``
    walks by file descriptor and never follows links inside the tree either)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISDIR(mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def fsync_file(path: Path) -> None:
    """Wait until the content of the file ``path`` is on disk."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_directory(path: Path) -> None:
    """Make the renames and creations inside ``path`` durable; a filesystem that cannot sync a directory skips it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# --- names -----------------------------------------------------------------------------------------------------------


def kept_copy(target: Path) -> Path:
    return target.parent / f".{target.name}.old"


def _staging_prefix(target: Path) -> str:
    return f".{target.name}.partial"


def _host() -> str:
    """This machine's name, as a staging name records it (characters a file name keeps plainly)."""
    name = "".join(c for c in socket.gethostname() if c.isalnum() or c in ".-_")
    return name or "unknown-host"


def _saver_is_alive(staging: Path, target: Path) -> bool:
    """Whether the save that created ``staging`` may still be running: its saver is recorded, is another process
    (this one saves one checkpoint at a time, so its own are a failed save's), and is not known dead (a saver on
    another host, or of another PID namespace, cannot be told dead)."""
    prefix = _staging_prefix(target) + "-"
    saver = Creator.of(staging.name, prefix)
    if saver is None:
        return False  # an earlier release's name, or this release's where /proc cannot tell: never alive
    me = Creator.this_process()
    host = staging.name.removeprefix(prefix).split("-", 4)[-1]
    if me is None or host != _host() or saver.namespace != me.namespace:
        return True
    return saver != me and not saver.is_dead()


def _is_real_directory(path: Path) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False


def leftovers(target: Path) -> list[Path]:
    """Staging directories of ``target``'s saves (``.NAME.partial`` of earlier releases included) and its kept copy,
    whatever they are now: a link planted at one of these names is a leftover too, removed as a link."""
    prefix = _staging_prefix(target)
    try:
        names = os.listdir(target.parent)
    except FileNotFoundError:
        return []
    found = [n for n in names if n == prefix or n.startswith(prefix + "-") or n == kept_copy(target).name]
    return [target.parent / name for name in sorted(found)]


def make_staging_directory(target: Path) -> Path:
    """A new, empty staging directory for ``target``, created by this call (``mkdir`` fails on any existing name, a
    link included, rather than following it), with the permissions any new directory gets; its name records this
    process as its saver."""
    target.parent.mkdir(parents=True, exist_ok=True)
    saver = Creator.this_process()
    for _ in range(100):
        token = secrets.token_hex(8)
        mark = token if saver is None else f"{saver.tag}-{token}-{_host()}"
        staging = target.parent / f"{_staging_prefix(target)}-{mark}"
        try:
            os.mkdir(staging, 0o777)
        except FileExistsError:
            continue
        return staging
    raise FileExistsError(errno.EEXIST, "no free staging name", str(target.parent / _staging_prefix(target)))


# --- the recovery rule -----------------------------------------------------------------------------------------------


def readable(target: Path) -> Path | None:
    """The directory a load of ``target`` reads: ``target``, or the kept copy while a publish by two renames stopped
    between them left no target; ``None`` where ``target`` is not a directory (a file loads as a file)."""
    if target.is_dir():
        return target
    if not os.path.lexists(target) and _is_real_directory(kept_copy(target)):
        return kept_copy(target)
    return None


def recover(target: Path) -> None:
    """Before a save: a kept copy with no target is the checkpoint, moved back; beside a target it was replaced, and
    goes."""
    kept = kept_copy(target)
    if not _is_real_directory(kept):
        return
    if os.path.lexists(target):
        remove(kept)
    else:
        rename_new(kept, target)
        fsync_directory(target.parent)


def reclaim(target: Path, keep: Callable[[Path], bool] = lambda _: False) -> None:
    """Remove ``target``'s leftovers, except those ``keep`` holds on to; a staging directory of a save that may still
    be running is none."""
    for leftover in leftovers(target):
        if not keep(leftover) and not _saver_is_alive(leftover, target):
            remove(leftover)


# --- publishing ------------------------------------------------------------------------------------------------------


def publish_directory(staging: Path, target: Path) -> None:
    """Put the complete directory ``staging`` at ``target`` and remove what ``target`` held. Call :func:`recover`
    first: the kept copy's name must be free."""
    if not os.path.lexists(target):
        try:
            rename_new(staging, target)
        except FileExistsError:  # another job's save published there meanwhile: replace it as any checkpoint
            pass
        else:
            fsync_directory(target.parent)
            return
    try:
        exchange(staging, target)
    except OSError as error:
        if error.errno not in _UNSUPPORTED:
            raise
        kept = kept_copy(target)
        os.rename(target, kept)
        fsync_directory(target.parent)
        os.rename(staging, target)
        fsync_directory(target.parent)
        remove(kept)
        return
    fsync_directory(target.parent)
    remove(staging)  # the old checkpoint, swapped to the staging name


def write_new_file(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """Create ``path``, which must not exist (``FileExistsError``, also for a link there: it is never followed), write
    it and sync it; on failure no file is left."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    try:
        with os.fdopen(fd, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
    except BaseException:
        os.unlink(path)
        raise


def publish_file(output: Path, write: Callable[[BinaryIO], None]) -> None:
    """Write ``output`` through a new file beside it, then rename that over ``output``: ``output`` is never
    half-written, and a link at ``output`` is replaced, not written through. The new file has no name while it is
    written (``O_TMPFILE``), so a process killed meanwhile leaves nothing; it gets a random name only to be renamed.
    Where the filesystem lacks ``O_TMPFILE`` it is written under that name (see :func:`write_new_file`)."""
    staging = _link_nameless(output, write)
    if staging is None:
        staging = _new_name(output, lambda name: write_new_file(name, write))
    try:
        os.replace(staging, output)
    except BaseException:
        staging.unlink(missing_ok=True)
        raise
    fsync_directory(output.parent)


def _link_nameless(output: Path, write: Callable[[BinaryIO], None]) -> Path | None:
    """Write a nameless file beside ``output``, sync it and give it a new random name; None where the filesystem (or
    the system: no ``/proc``) cannot."""
    fd = tmpfile(output.parent, os.O_WRONLY | os.O_CLOEXEC, 0o666)
    if fd is None:
        return None
    with os.fdopen(fd, "wb") as file:
        write(file)
        file.flush()
        os.fsync(file.fileno())
        source = f"/proc/self/fd/{file.fileno()}"
        if not os.path.exists(source):  # no /proc: rewritten under a name
            return None
        directory = os.open(output.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:  # a directory descriptor makes os.link call linkat, which follows /proc's link to the file
            return _new_name(output, lambda name: os.link(source, name.name, dst_dir_fd=directory))
        finally:
            os.close(directory)


def _new_name(output: Path, create: Callable[[Path], None]) -> Path:
    """``create`` a file at a fresh random hidden name beside ``output``; that name."""
    for _ in range(100):
        staging = output.parent / f".{output.name}.{secrets.token_hex(8)}.partial"
        try:
            create(staging)
        except FileExistsError:
            continue
        return staging
    raise FileExistsError(errno.EEXIST, "no free staging name", str(output))

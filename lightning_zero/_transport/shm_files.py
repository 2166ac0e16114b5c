"""Names in ``/dev/shm`` that say which process created them, and the reclaiming of those whose creator is dead.

The shared-memory channel's segments, FIFOs and gather ring must have names while the peers open them; they are
unlinked once every rank holds them, but a rank killed in that window (or while a peer never arrives) leaves them
behind, and ``/dev/shm`` is memory. So each name starts with its *creator*, and every channel that opens first removes
the entries of this user whose creator is dead.

Words used below:

- *creator*: the process that made an entry, as its *PID namespace* (the inode of ``/proc/self/ns/pid``: where the
  PID means that process; containers sharing ``/dev/shm`` with ``--ipc=host`` each have their own), its PID, and its
  *start time* (clock ticks after boot, from ``/proc/<pid>/stat``), which tells a reused PID apart.
- *dead*: no process with that PID, or one that started at another time, or a zombie. Entries of another PID
  namespace, of another user, or whose creator cannot be told (unreadable ``/proc``) are never touched.

A name reads ``lightning_zero-<namespace>-<pid>-<start>-<token>...``, the token drawn per channel. The channel also
learns its peers' creators from their names, and watches them while it waits.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from pathlib import Path

DIRECTORY = Path("/dev/shm")
PREFIX = "lightning_zero-"


@dataclass(frozen=True)
class Creator:
    """The process that created an entry, as its name records it."""

    namespace: int  # inode of its PID namespace
    pid: int  # in that namespace
    start: int  # clock ticks after boot at which it started

    @classmethod
    def this_process(cls) -> Creator | None:
        """This process, or None where ``/proc`` cannot tell (its entries are then never reclaimed)."""
        try:
            return cls(os.stat("/proc/self/ns/pid").st_ino, os.getpid(), _start_time(os.getpid()))
        except (OSError, ValueError, IndexError):
            return None

    @classmethod
    def of(cls, name: str) -> Creator | None:
        """The creator written in an entry's ``name``; None for a name of another form."""
        fields = name.removeprefix(PREFIX).split("-")
        if not name.startswith(PREFIX) or len(fields) < 4 or not all(f.isdigit() for f in fields[:3]):
            return None
        return cls(int(fields[0]), int(fields[1]), int(fields[2]))

    def is_dead(self) -> bool:
        """Whether this creator, of this process's PID namespace, is known to be gone (a zombie counts as gone)."""
        try:
            stat = Path(f"/proc/{self.pid}/stat").read_text()
        except FileNotFoundError:
            return True
        except OSError:  # /proc hides other users' processes (hidepid): cannot tell, so alive
            return False
        state, start = _state_and_start(stat)
        return state in ("Z", "X") or start != self.start


def new_prefix() -> str:
    """The start of the paths of this process's entries for one channel: its creator, then a fresh token."""
    creator = Creator.this_process()
    token = secrets.token_hex(6)
    if creator is None:
        return f"{DIRECTORY}/{PREFIX}{token}"
    return f"{DIRECTORY}/{PREFIX}{creator.namespace}-{creator.pid}-{creator.start}-{token}"


def reclaim() -> None:
    """Unlink the entries of ``/dev/shm`` that this user's dead processes of this PID namespace left. Safe beside live
    runs: their creators are alive, so nothing of theirs is touched."""
    me = Creator.this_process()
    if me is None:
        return
    try:
        entries = list(os.scandir(DIRECTORY))
    except OSError:
        return
    for entry in entries:
        creator = Creator.of(entry.name)
        if creator is None or creator.namespace != me.namespace:
            continue
        try:
            if entry.stat(follow_symlinks=False).st_uid == os.getuid() and creator.is_dead():
                os.unlink(entry.path)
        except OSError:  # another run reclaimed it first
            continue


def _start_time(pid: int) -> int:
    return _state_and_start(Path(f"/proc/{pid}/stat").read_text())[1]


def _state_and_start(stat: str) -> tuple[str, int]:
    """Fields 3 and 22 of a ``/proc/<pid>/stat`` line, counted after the command name (which may hold spaces)."""
    fields = stat.rsplit(")", 1)[-1].split()
    return fields[0], int(fields[19])

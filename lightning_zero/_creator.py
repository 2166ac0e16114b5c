"""Which process created a file, written into its name, and whether that process is dead: what lets a run remove
what crashed runs left behind (``/dev/shm`` entries, checkpoint staging directories) and never what a live run uses.

Words used below:

- *creator*: the process that made an entry, as its *PID namespace* (the inode of ``/proc/self/ns/pid``: where the
  PID means that process; containers sharing a directory each have their own), its PID, and its *start time* (clock
  ticks after boot, from ``/proc/<pid>/stat``), which tells a reused PID apart.
- *dead*: no process with that PID, or one that started at another time, or a zombie. A creator of another PID
  namespace, or one that cannot be told (unreadable ``/proc``), is never taken for dead.

A name holds its creator as ``<namespace>-<pid>-<start>`` right after a prefix of its own kind.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass
from pathlib import Path


class Liveness(enum.Enum):
    """What ``/proc`` tells of a creator."""

    RUNNING = "running"  # alive and not stopped: running, sleeping or waiting, in Python or native code
    STOPPED = "stopped"  # SIGSTOP, a debugger
    DEAD = "dead"  # gone, a zombie, or its PID reused
    UNKNOWN = "unknown"  # another PID namespace, or `/proc` hidden


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

    @property
    def tag(self) -> str:
        """How a name records this creator."""
        return f"{self.namespace}-{self.pid}-{self.start}"

    @classmethod
    def from_tag(cls, tag: str) -> Creator | None:
        """The creator :attr:`tag` recorded; None for a tag of another form."""
        fields = tag.split("-")
        if len(fields) != 3 or not all(f.isdigit() for f in fields):
            return None
        return cls(int(fields[0]), int(fields[1]), int(fields[2]))

    @classmethod
    def of(cls, name: str, prefix: str) -> Creator | None:
        """The creator recorded in ``name`` right after ``prefix``; None for a name of another form."""
        fields = name.removeprefix(prefix).split("-")
        if not name.startswith(prefix) or len(fields) < 4 or not all(f.isdigit() for f in fields[:3]):
            return None
        return cls(int(fields[0]), int(fields[1]), int(fields[2]))

    def is_dead(self) -> bool:
        """Whether this creator, of this process's PID namespace, is known to be gone (a zombie counts as gone)."""
        return self.liveness() is Liveness.DEAD

    def liveness(self) -> Liveness:
        """What ``/proc`` says of this creator, taken to be of this process's PID namespace."""
        try:
            stat = Path(f"/proc/{self.pid}/stat").read_text()
        except FileNotFoundError:
            return Liveness.DEAD
        except OSError:  # /proc hides other users' processes (hidepid): cannot tell
            return Liveness.UNKNOWN
        state, start = _state_and_start(stat)
        if state in ("Z", "X") or start != self.start:
            return Liveness.DEAD
        return Liveness.STOPPED if state in ("T", "t") else Liveness.RUNNING


def main_thread(pid: int) -> tuple[str, float] | None:
    """The state (``R`` running or runnable, ``S`` sleeping, ``D`` waiting on the disk, ...) of the main thread of
    process ``pid`` (of this PID namespace) and the CPU time it has used, in user and kernel mode; None where ``/proc``
    cannot tell."""
    try:
        fields = Path(f"/proc/{pid}/task/{pid}/stat").read_text().rsplit(")", 1)[-1].split()
        return fields[0], (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _start_time(pid: int) -> int:
    return _state_and_start(Path(f"/proc/{pid}/stat").read_text())[1]


def _state_and_start(stat: str) -> tuple[str, int]:
    """Fields 3 and 22 of a ``/proc/<pid>/stat`` line, counted after the command name (which may hold spaces)."""
    fields = stat.rsplit(")", 1)[-1].split()
    return fields[0], int(fields[19])

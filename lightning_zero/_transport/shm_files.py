"""Names in ``/dev/shm`` that say which process created them, and the reclaiming of those whose creator is dead.

The shared-memory channel's segments, FIFOs and gather ring must have names while the peers open them; they are
unlinked once every rank holds them, but a rank killed in that window (or while a peer never arrives) leaves them
behind, and ``/dev/shm`` is memory. So each name starts with its *creator*, and every channel that opens first removes
the entries of this user whose creator is dead.

The creator and its death are :mod:`lightning_zero._creator`'s; entries of another PID namespace, of another user, or
whose creator cannot be told are never touched.

A name reads ``lightning_zero-<namespace>-<pid>-<start>-<token>...``, the token drawn per channel. The channel also
learns its peers' creators from their names, and watches them while it waits.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from lightning_zero._creator import Creator

DIRECTORY = Path("/dev/shm")
PREFIX = "lightning_zero-"


def new_prefix() -> str:
    """The start of the paths of this process's entries for one channel: its creator, then a fresh token."""
    creator = Creator.this_process()
    token = secrets.token_hex(6)
    if creator is None:
        return f"{DIRECTORY}/{PREFIX}{token}"
    return f"{DIRECTORY}/{PREFIX}{creator.tag}-{token}"


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
        creator = Creator.of(entry.name, PREFIX)
        if creator is None or creator.namespace != me.namespace:
            continue
        try:
            if entry.stat(follow_symlinks=False).st_uid == os.getuid() and creator.is_dead():
                os.unlink(entry.path)
        except OSError:  # another run reclaimed it first
            continue

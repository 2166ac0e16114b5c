"""Why a rank failed, told to the other ranks at once, so that they stop waiting for it and their errors name the
cause, not only the rank.

A rank's exception (its own error, ``MemoryError`` included) ends it, but its peers would learn of it only once its
process has exited (seconds of teardown later): as a dead peer (:func:`.peers.exited`), a connection gloo lost, a
collective that failed. So each rank *announces* its failure as soon as the front end sees it, under its own key in
the default process group's store (the rendezvous' TCP store, which every rank reaches); a rank waiting in a
shared-memory collective reads the announcements of the peers it waits for at each of its polls, and a rank that
fails *notes* on its own exception what the other ranks announced that differs from it (ranks that all raised the
same error need no note). Python 3.10 has no notes (PEP 678 came with 3.11): there the note is written to stderr,
above the traceback that follows.

Keys hold the *run* (the count of ``fit`` calls of this process that set up a strategy, equal on every rank), so that
a rank still tearing down a failed run is never taken for a failure of the next one.

The store lives in rank 0's process: once rank 0 has exited, the others cannot read its announcement, and their errors
name rank 0 without the cause (its own log has it). Announcing and reading never raise: a rank out of memory may not
manage either, and its error must stay the one the user sees.
"""

from __future__ import annotations

import sys

import torch.distributed as dist

from lightning_zero._transport.c10d_private import default_store
from lightning_zero._transport.peers import PeerError, ranks

_KEY = "lightning_zero/failure/{run}/{rank}"
_LONGEST = 2000  # characters of an announced error: its type and message, never a whole traceback
_run = 0  # the run under way in this process


def start_run(number: int) -> None:
    """At the set-up of run ``number``: announcements of earlier runs are no longer read."""
    global _run
    _run = number


def announce(error: BaseException) -> None:
    """Tell the other ranks that this rank fails with ``error``."""
    store = default_store()
    if store is not None:
        try:
            store.set(_KEY.format(run=_run, rank=dist.get_rank()), _described(error))
        except Exception:  # out of memory (a MemoryError), the store gone: the peers then name the rank alone
            return


def announced(rank: int) -> str | None:
    """The failure global rank ``rank`` announced in this run, if it did."""
    store = default_store()
    key = _KEY.format(run=_run, rank=rank)
    try:
        return store.get(key).decode() if store is not None and store.check([key]) else None
    except Exception:  # rank 0, which holds the store, has exited
        return None


def failed(where: str, rank: int, peer: int, failure: str, pids: dict[int, int]) -> PeerError:
    """The error of ``rank`` whose ``peer`` (its PID named where in ``pids``) announced ``failure`` while ``rank``
    waited for it."""
    return PeerError(
        f"lightning_zero's {where} on rank {rank} stopped: {ranks([peer], pids)} failed while this rank waited for it,"
        f" with {failure}. HINT: rank {peer}'s own log shows where; this rank's error is only its consequence."
    )


def note_other_failures(error: BaseException) -> None:
    """Add to ``error`` (shown below its traceback) the failures the other ranks announced that differ from it."""
    if not dist.is_initialized():
        return
    own = _described(error)
    me = dist.get_rank()
    for rank in range(dist.get_world_size()):
        failure = announced(rank) if rank != me else None
        if failure is not None and failure != own:
            add_note(error, f"lightning_zero: rank {rank} failed too, with {failure}")


def add_note(error: BaseException, note: str) -> None:
    if sys.version_info >= (3, 11):
        error.add_note(note)
    else:  # no notes: the traceback printed later would not show it
        print(note, file=sys.stderr)


def _described(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"[:_LONGEST]

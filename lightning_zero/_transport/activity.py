"""What this rank is doing, as the stall watchdog (:mod:`lightning_zero._watchdog`) tells its peers: the last labelled
point it reached (:mod:`.labels`) and where its main thread is now.

Words used below:

- *entered*: the label of the last collective of this package, ``fully_shard`` unit gather or reduction, or meeting
  point (the end of a forward of the whole module) this rank started. Recording it is one assignment; nothing else
  happens on a step that does not stall.
- *place*: where the main thread is, read from its innermost Python frame only when the watchdog looks (about once a
  second): *waiting* in this package's collectives, in *torch*'s (a frame of ``torch/distributed``: Lightning's
  barriers and broadcasts, ``fully_shard``'s own collectives), *left* (its script ended: it waits for its peers at
  exit), or *busy* (anywhere else: computing, reading data, writing a file).
- *still*: how long the main thread has stayed in the same frame call, entering no labelled point meanwhile, as the
  watchdog measured it.
- *unwatched*: the watchdog's thread failed; the next labelled point this rank enters raises its error, so that the
  run fails rather than goes on without a watchdog (:func:`unwatched`).
"""

from __future__ import annotations

import enum
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import torch

from lightning_zero._transport import labels

_TRANSPORT = str(Path(__file__).parent)
_TORCH_DISTRIBUTED = str(Path(torch.__file__).parent / "distributed")
# the frames a user's line is looked for beyond: torch's and this package's
_NOT_USERS = (str(Path(torch.__file__).parent), str(Path(__file__).parents[1]))

BEFORE_ANY = labels.label("its start: no collective of lightning_zero yet")
_entered = BEFORE_ANY
_count = 0  # points entered so far: a main thread whose frame looks unchanged but that entered one has moved on
_left = False  # the script ended: the exit hook waits for the peers
_unwatched: BaseException | None = None  # the error the next point entered raises: the watchdog stopped


class Place(enum.Enum):
    WAITING = "waiting"  # in a collective of this package
    TORCH = "torch"  # in a collective of torch's (or its own code in torch.distributed)
    LEFT = "left"  # at exit, waiting for the peers to end too
    BUSY = "busy"  # anywhere else


def entered(label: int) -> None:
    """This rank starts the collective or reaches the meeting point ``label`` says."""
    global _entered, _count
    if _unwatched is not None:
        raise _unwatched.with_traceback(None)
    _entered = label
    _count += 1


def begin_run() -> None:
    """A run begins: nothing entered yet, and watched."""
    global _entered, _unwatched
    _entered = BEFORE_ANY
    _unwatched = None


def unwatched(error: BaseException) -> None:
    """The watchdog's thread stopped with ``error`` (a :class:`WatchdogError`): raised at the next point entered."""
    global _unwatched
    _unwatched = error


class WatchdogError(RuntimeError):
    """The stall watchdog itself failed: the run stops rather than go on unwatched."""


def leaving() -> None:
    """The script ended; the process waits at exit for its peers."""
    global _left
    _left = True


@dataclass(frozen=True)
class Sample:
    """One look at the main thread: its innermost frame call (by identity and code, and the count of points entered:
    the same call, still waiting, if unchanged; a call repeated at the same address counts as another through the
    collectives it enters) and where that is."""

    frame_key: tuple[int, int, int]
    place: Place
    where: str  # "file:line (function)" of the frame outside torch and this package nearest the innermost one
    call: str  # for Place.TORCH: the function of torch.distributed entered from outside it


def sample(skipping: str = "") -> Sample | None:
    """Where the main thread is now, its frames under the directory ``skipping`` left out (the watchdog's own, when
    it asks a round from the main thread); None if it has no Python frame (it is finishing)."""
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    while skipping and frame is not None and frame.f_code.co_filename.startswith(skipping):
        frame = frame.f_back
    if frame is None:
        return None
    key = (id(frame), id(frame.f_code), _count)
    file = frame.f_code.co_filename
    if _left:
        key = (0, 0, -1)  # the exit's wait, polling the store, stays one wait
        place = Place.LEFT
    elif file.startswith(_TRANSPORT):
        place = Place.WAITING
    elif file.startswith(_TORCH_DISTRIBUTED):
        place = Place.TORCH
    else:
        place = Place.BUSY
    return Sample(key, place, _caller(frame), _torch_call(frame) if place is Place.TORCH else "")


def doing() -> str:
    """The words of the label last entered."""
    return labels.words(_entered)


def _caller(frame: FrameType | None) -> str:
    while frame is not None and frame.f_code.co_filename.startswith(_NOT_USERS):
        frame = frame.f_back
    if frame is None:
        return "?"
    return f"{frame.f_code.co_filename}:{frame.f_lineno} ({frame.f_code.co_name})"


def _torch_call(frame: FrameType | None) -> str:
    """The outermost torch.distributed function of the innermost run of them: the collective called."""
    name = ""
    while frame is not None and frame.f_code.co_filename.startswith(_TORCH_DISTRIBUTED):
        if frame.f_code.co_name != "wrapper":  # c10d's logging decorator
            name = frame.f_code.co_name
        frame = frame.f_back
    return name

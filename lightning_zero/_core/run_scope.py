"""A run's scope: what one run puts into the process for itself (the stall watchdog's watch, the c10d logger's witness
of timeouts, a warnings filter, ``fully_shard``'s rebound collectives, the placement's files) ends with the run, once,
under either front end.

Words used below:

- *run*: one ``fit``, ``validate``, ``test`` or ``predict`` of a Trainer, or one Fabric from its ``launch()``. Runs are
  numbered in the process, equal on every rank (each rank makes the same calls); the store keys of the ranks' failures
  and of the watchdog's verdicts carry that number, so a run never reads an earlier one's.
- *end*: the Trainer ends a run in its strategy's ``teardown``. Fabric has no teardown call, so a Fabric run ends at the
  first of what its users do: the next run beginning (another ``Fabric``), the process group destroyed
  (``destroy_process_group``, seen by the watchdog's thread within a tick), the last module it set up going away (the
  user dropped it with the ``Fabric``), the process's exit.
- *undo*: what the end does, each once, the last registered first. One that would keep the run's objects alive (a
  mode's teardown: its placement holds the module's shards) is held weakly and skipped once they are gone; the
  process-wide ones (a logger handler, a warnings filter) are held strongly, so that they go even then. An end may come
  on the watchdog's thread (the group destroyed) or in a garbage collection (the last module gone).
"""

from __future__ import annotations

import enum
import itertools
import threading
import weakref
from collections.abc import Callable
from types import MethodType

Undo = Callable[[], object]


class RunState(enum.Enum):
    OPEN = "open"
    ENDED = "ended"


class RunScope:
    """Run ``number``'s undos, and what ends it."""

    def __init__(self, number: int) -> None:
        self.number = number
        self.state = RunState.OPEN
        self._undos: list[Undo | weakref.WeakMethod[Undo]] = []
        self._anchors = 0  # objects alive whose going ends the run
        self._lock = threading.Lock()  # ends may come from the main thread, the watchdog's and a collection at once

    def on_end(self, undo: Undo, *, weakly: bool = False) -> None:
        """Call ``undo`` when the run ends; ``weakly`` (a bound method): only while its object is alive."""
        if weakly:
            assert isinstance(undo, MethodType), "only a bound method can be held weakly"
            self._undos.append(weakref.WeakMethod(undo))
        else:
            self._undos.append(undo)

    def anchor(self, obj: object) -> None:
        """The run ends once ``obj``, and every object anchored before it, is gone."""
        self._anchors += 1
        weakref.finalize(obj, self._anchor_gone)

    def _anchor_gone(self) -> None:
        self._anchors -= 1
        if self._anchors == 0:
            self.end()

    def end(self) -> None:
        """Undo what the run put into the process (once; later calls do nothing)."""
        with self._lock:
            if self.state is RunState.ENDED:
                return
            self.state = RunState.ENDED
            undos, self._undos = self._undos[::-1], []
        for undo in undos:
            call = undo() if isinstance(undo, weakref.WeakMethod) else undo
            if call is not None:
                call()


_NUMBERS = itertools.count(1)
_CURRENT: RunScope | None = None


def begin() -> RunScope:
    """A new run, after ending the one under way (a Fabric run ends when the next begins)."""
    global _CURRENT
    end_current()
    _CURRENT = RunScope(next(_NUMBERS))
    return _CURRENT


def end_current() -> None:
    """End the run under way, if one is (at the process's exit, at the latest)."""
    if _CURRENT is not None:
        _CURRENT.end()

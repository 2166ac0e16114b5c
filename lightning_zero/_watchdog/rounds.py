"""The store protocol of the stall watchdog: a *round* put to every rank through the default process group's store
(the rendezvous' TCP store, which exists already), and the *verdict* it leads to. What an answer says and what a
verdict means are :mod:`.verdicts`' job; here, the keys, and who writes, reads and waits for what.

Words used below:

- *round* ``n``: asked by one rank (its *asker*) by counting ``asked`` up; every rank *answers* it within a tick of its
  watchdog (or as soon as its interpreter runs again). Rounds are numbered for the whole job, whichever run of the
  process asked them, so that a rank answers every round asked, even while it sets up a run or waits at its exit.
- *scope*: what a verdict belongs to: one run of the process (``run <n>``: a second ``fit`` in the same process, after
  a verdict or none, starts with none), or ``exit`` (the ranks' wait for each other at their exit). The first verdict
  written in a scope is the scope's, and every rank raises it; its writer counts ``asked`` up once more, so that every
  rank looks (a round nobody asked, answered all the same).
- *window*: how long the asker waits for every answer: the strategy's ``stall_after``. A rank that has not answered by
  then gave no sign of life for that long, and is *missing*.
- *place*: where a rank runs (its host and its process), written once as its watchdog starts, so that the words about a
  missing rank can say whether its process is stopped, gone or running (:mod:`.verdicts`).

Traffic: each rank's watchdog reads one counter a tick; a round costs every rank one write and one count, and its asker
one read of one counter every :data:`POLL_SECONDS`, then one read per rank: O(N) in the number of ranks, not O(N^2).
Every store call that fails (the store is gone: rank 0, which holds it, exited) raises :class:`StoreGone`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, TypeVar

from torch.distributed import Store

POLL_SECONDS = 0.05
EXIT = "exit"
_KEY = "lightning_zero/watch"
T = TypeVar("T")


class StoreGone(Exception):
    """The store could not be reached: the rank that holds it (rank 0) exited, or the process group is gone."""


def run_scope(number: int) -> str:
    return f"run {number}"


class Rounds:
    """This rank's end of the protocol, for a group of ``size`` ranks."""

    def __init__(self, store: Store, rank: int, size: int) -> None:
        self.store, self.rank, self.size = store, rank, size

    def latest(self) -> int:
        """The last round asked in the job (0: none yet)."""
        return self._call(self.store.add, f"{_KEY}/asked", 0)

    def ask(self) -> int:
        """A new round: its number."""
        return self._call(self.store.add, f"{_KEY}/asked", 1)

    def answer(self, number: int, answer: dict[str, Any]) -> None:
        self._call(self.store.set, f"{_KEY}/round/{number}/{self.rank}", json.dumps(answer))
        self._call(self.store.add, f"{_KEY}/round/{number}/answers", 1)

    def answered(self, number: int) -> int:
        """How many ranks answered round ``number`` so far."""
        return self._call(self.store.add, f"{_KEY}/round/{number}/answers", 0)

    def answers(self, number: int) -> dict[int, dict[str, Any]]:
        """The answers to round ``number`` in so far, by rank."""
        found = {}
        for rank in range(self.size):
            key = f"{_KEY}/round/{number}/{rank}"
            if self._call(self.store.check, [key]):
                found[rank] = json.loads(self._call(self.store.get, key))
        return found

    def verdict(self, scope: str) -> dict[str, Any] | None:
        """The verdict written in ``scope``, if one was."""
        key = f"{_KEY}/{scope}/verdict"
        return json.loads(self._call(self.store.get, key)) if self._call(self.store.check, [key]) else None

    def decide(self, scope: str, found: dict[str, Any]) -> dict[str, Any]:
        """Write ``found`` as ``scope``'s verdict unless one was written first; the verdict of ``scope``, either way.
        Every rank is told to look (``asked`` counted up)."""
        written = self._call(self.store.compare_set, f"{_KEY}/{scope}/verdict", "", json.dumps(found))
        self._call(self.store.add, f"{_KEY}/asked", 1)
        return json.loads(written)

    def publish_place(self, place: dict[str, Any]) -> None:
        self._call(self.store.set, f"{_KEY}/place/{self.rank}", json.dumps(place))

    def place_of(self, rank: int) -> dict[str, Any] | None:
        key = f"{_KEY}/place/{rank}"
        return json.loads(self._call(self.store.get, key)) if self._call(self.store.check, [key]) else None

    def count_exit(self) -> None:
        """This rank reached its exit (once per process)."""
        self._call(self.store.add, f"{_KEY}/exited", 1)

    def exited(self) -> int:
        """How many ranks reached their exit."""
        return self._call(self.store.add, f"{_KEY}/exited", 0)

    @staticmethod
    def _call(method: Callable[..., T], *args: Any) -> T:
        try:
            return method(*args)
        except (RuntimeError, OSError) as error:  # torch's DistStoreError and DistNetworkError are RuntimeErrors
            raise StoreGone(str(error)) from error

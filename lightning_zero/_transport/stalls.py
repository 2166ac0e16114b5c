"""The job's verdict on a stall, as the collectives ask for it: whether the ranks went different ways or a peer stopped,
so that a collective that fails or waits reports that rather than its own symptom.

The stall watchdog (:mod:`lightning_zero._watchdog`) reaches the verdict; it sits above this room, so it registers its
*judge* here as a run begins (:func:`judged_by`) and the collectives below ask through this module, never importing
it. Without a judge (one rank, no run under way) there is no verdict.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeVar

from lightning_zero._transport.labels import DivergedError
from lightning_zero._transport.peers import PeerError

StallError = DivergedError | PeerError
T = TypeVar("T")


class Judge(Protocol):
    def verdict(self) -> StallError | None:
        """The verdict this rank took already (no store access: a waiting collective asks every second)."""

    def check_now(self, ask: bool) -> StallError | None:
        """The job's verdict, read from the store if a peer reached one; where ``ask``, a round asked at once if none
        was."""


_judge: Judge | None = None


def judged_by(judge: Judge | None) -> None:
    """The judge of the run under way (``None`` once it ended)."""
    global _judge
    _judge = judge


def verdict() -> StallError | None:
    return None if _judge is None else _judge.verdict()


def check_now(ask: bool) -> StallError | None:
    return None if _judge is None else _judge.check_now(ask)


def as_verdict(collective: Callable[[], T]) -> T:
    """``collective()``, whose failure once the stall watchdog released it (a peer's verdict closed its connections)
    raises the verdict instead, the backend's error as its cause: for the collectives of torch that the package runs
    through (``fully_shard``'s own, in torch 2.8), whose errors would say only "Connection closed by peer"."""
    try:
        return collective()
    except RuntimeError as error:
        if isinstance(error, StallError):
            raise
        found = check_now(ask=False)
        if found is not None:
            raise found from error
        raise

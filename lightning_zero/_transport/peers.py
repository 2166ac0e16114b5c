"""How long a rank waits for its peers in this package's collectives, and what it says when one fails to come.

A collective waits for its peers as long as the process group's *timeout*: the one it was created with
(``init_process_group(timeout=...)``, which Lightning's strategies pass from their own ``timeout``), the limit of gloo's
and NCCL's own collectives too. It is read from the group, never from a setting of this package, so that every group
keeps its own.

A peer can fail to come in two ways: it *stalled* (alive, but not in this collective: stopped, stuck, or running other
collectives), reported once the timeout has passed; or it *exited*, reported as soon as that is seen.

A timeout in one of torch's own collectives can be *swallowed* by its caller: Lightning broadcasts a SIGTERM flag at
the start of every training step and ignores that broadcast's errors. Gloo then fails its next collective with that
peer at once (it closed the connection), but the shared-memory channel would wait a second timeout. So the timeouts of
torch's collectives are *witnessed* here (:func:`timeouts_witnessed`), from the record torch keeps of every collective
that raised, and the channel reports a stalled peer at once after one.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Generator
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

# how gloo says a peer did not arrive in time: "Timed out waiting 5000ms for recv operation to complete" in a wait, or
# "Application timeout caused pair closure" when the next message to that peer is posted
_GLOO_TIMED_OUT = re.compile("timed out|timeout", re.IGNORECASE)


# how gloo says a peer's connection ended (its process exited or closed it): "Connection closed by peer", "reset"
_CONNECTION_LOST = re.compile("connection (closed|reset) by peer", re.IGNORECASE)


class PeerError(RuntimeError):
    """A collective that cannot complete because a peer rank stalled or exited."""


class _TimeoutWitness(logging.Handler):
    """Keeps the last timeout among the collectives of torch that raised in this process: torch logs each one, with its
    error, to its c10d logger (at DEBUG, not propagated, so nothing is printed)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.count = 0  # timeouts seen so far
        self.last = ""  # the last one: "`<collective>`: <error>"

    def emit(self, record: logging.LogRecord) -> None:
        entry = record.msg
        if isinstance(entry, dict) and _GLOO_TIMED_OUT.search(str(entry.get("error", ""))):
            self.count += 1
            self.last = f"`{entry.get('func_name')}`: {entry['error']}"


_WITNESS = _TimeoutWitness()


def witness_timeouts() -> None:
    """Start witnessing the timeouts of torch's collectives (idempotent); where torch keeps no such record, none are."""
    from torch.distributed import c10d_logger

    logger = getattr(c10d_logger, "_c10d_logger", None)
    if isinstance(logger, logging.Logger) and _WITNESS not in logger.handlers:
        logger.addHandler(_WITNESS)


def stop_witnessing_timeouts() -> None:
    """Take the witness off torch's c10d logger (at a run's teardown: the logger is the process's, not the run's)."""
    from torch.distributed import c10d_logger

    logger = getattr(c10d_logger, "_c10d_logger", None)
    if isinstance(logger, logging.Logger):
        logger.removeHandler(_WITNESS)


def timeouts_witnessed() -> int:
    """How many of torch's collectives have timed out in this process so far (compare two counts to tell whether one
    did in between)."""
    return _WITNESS.count


def last_timeout() -> str:
    """The last of torch's collectives that timed out in this process, and its error."""
    return _WITNESS.last


def group_timeout(group: ProcessGroup) -> timedelta:
    """``group``'s timeout, as its CPU backend holds it; torch's default where a backend keeps it elsewhere."""
    try:
        return group._get_backend(torch.device("cpu")).options._timeout
    except (AttributeError, RuntimeError):
        return dist.default_pg_timeout


def stalled(
    where: str, rank: int, missing: str, timeout: timedelta, pids: list[int], earlier: str | None = None
) -> PeerError:
    """The error of ``rank`` that waited ``timeout`` for the peers ``missing`` names (see :func:`ranks`), whose
    ``pids`` are known; ``earlier``: the swallowed timeout of torch's collective in which it waited."""
    dump = "".join(f" or `py-spy dump --pid {pid}`" for pid in pids)
    swallowed = f", in an earlier collective that its caller went past ({earlier})" if earlier else ""
    return PeerError(
        f"lightning_zero's {where} on rank {rank} gave up: {missing} did not arrive within {_seconds(timeout)}, the"
        f" process group's timeout (the strategy's `timeout`){swallowed}. HINT: a rank that does not arrive is alive"
        f" but elsewhere: stopped (SIGSTOP, a debugger), stuck, or in other collectives; its log{dump} shows where."
        " If steps legitimately take longer, pass a larger `timeout` to the strategy."
    )


def exited(where: str, rank: int, peer: int, pids: dict[int, int]) -> PeerError:
    """The error of ``rank`` whose ``peer`` exited while ``rank`` waited for it (its PID named where in ``pids``)."""
    return PeerError(
        f"lightning_zero's {where} on rank {rank} stopped: {ranks([peer], pids)} exited while this rank waited for"
        f" it. HINT: rank {peer}'s own log says why it ended (an exception, or a kill: out of memory, the job"
        " scheduler); this rank's error is only its consequence."
    )


def failed(where: str, rank: int, peers: list[int], error: BaseException) -> PeerError:
    """The error of ``rank`` whose exchange with ``peers`` failed in the backend (a connection lost: a peer exited)."""
    return PeerError(
        f"lightning_zero's {where} on rank {rank} with {ranks(peers)} failed: {error}. HINT: a peer that exits or"
        " loses its connection fails the exchange; the other ranks' logs say why."
    )


@contextmanager
def naming_peers(where: str, group: ProcessGroup) -> Generator[None, None, None]:
    """Gloo's errors in ``group``'s collectives inside, which do not say which peer nor what to do, as the errors above
    (gloo does not say which peer either: every other rank is named)."""
    try:
        yield
    except PeerError:
        raise
    except RuntimeError as error:
        me = group.rank()
        others = [rank for rank in range(group.size()) if rank != me]
        if _GLOO_TIMED_OUT.search(str(error)):
            raise stalled(where, me, ranks(others, one_of=True), group_timeout(group), []) from error
        raise failed(where, me, others, error) from error


def timed_out(error: PeerError) -> bool:
    """Whether ``error`` is gloo's own timeout: the process group's ``timeout`` ran out waiting for a peer."""
    return _caused_by(error, _GLOO_TIMED_OUT)


def connection_lost(error: PeerError) -> bool:
    """Whether ``error`` is gloo's lost connection to a peer (its process exited, or it closed the connection)."""
    return _caused_by(error, _CONNECTION_LOST)


def _caused_by(error: PeerError, gloo_says: re.Pattern[str]) -> bool:
    return error.__cause__ is not None and gloo_says.search(str(error.__cause__)) is not None


def ranks(peers: list[int], pids: dict[int, int] | None = None, one_of: bool = False) -> str:
    """``"rank 1 (PID 123)"``, ``"ranks 1, 2"`` or, where the backend does not say which, ``"one of ranks 1, 2"``."""
    named = [f"{p}" + (f" (PID {pids[p]})" if pids and p in pids else "") for p in peers]
    if len(named) == 1:
        return f"rank {named[0]}"
    return f"{'one of ' if one_of else ''}ranks {', '.join(named)}"


def _seconds(timeout: timedelta) -> str:
    return f"{timeout.total_seconds():g} s"

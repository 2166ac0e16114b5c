"""The stall watchdog: on every transport (gloo across hosts, NCCL, the shared-memory channel), ranks that run different
code or a peer that stopped fail within ``stall_after`` seconds on every rank, with an error naming what each rank was
doing, instead of waiting the process group's timeout (30 minutes by default).

Words used below:

- *round*: a question put to every rank through the default process group's store (the rendezvous' TCP store, which
  exists already): each rank *answers* with what it is doing (:mod:`.activity`), and the first rank to have every
  answer, or to have waited :data:`ANSWER_SECONDS` for them, writes the round's *verdict*, which every rank reads: so
  every rank raises the same error.
- *stall*: this rank's main thread has stayed in one call of a collective (this package's, torch's) or at exit,
  waiting for its peers, for ``stall_after`` seconds; it then asks a round. A rank also asks one when one of this
  package's collectives fails (:func:`check_now`), and when it receives SIGTERM or SIGINT while blocked in one (still
  in the same call :data:`SIGNAL_GRACE_SECONDS` later: otherwise the signal's own handler, Lightning's, runs).
- *verdict*: :class:`~.labels.DivergedError` when the ranks wait in different collectives (code that differs between
  ranks); :class:`~.peers.PeerError` when a rank did not answer (stopped by SIGSTOP or a debugger, hung without
  letting Python run) or received a signal; none when a rank is busy elsewhere (slower, not stuck): the round is asked
  again after another ``stall_after``.
- *release*: where a verdict is reached, the collective the main thread is blocked in is made to fail: on gloo by
  closing this process's connections to its peers (a receive posted here and abandoned at once closes the connection
  with that peer: ``abort()`` leaves a blocked gloo collective waiting), on NCCL by aborting the communicator. The
  error the main thread then sees is replaced by the verdict in this package's collectives, noted beside it in
  torch's; a main thread still blocked :data:`GRACE_SECONDS` later ends the process with status 1.

Cost on a step that does not stall: one assignment per collective (:func:`.activity.entered`), and a thread that
wakes once a :data:`tick <TICK_SECONDS>` to look at the main thread's frame and read one counter in the store.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import select
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from lightning_zero._threads import in_thread
from lightning_zero._transport import activity, failures, labels, launched, peers
from lightning_zero._transport.activity import Place
from lightning_zero._transport.torch_private import default_store, process_groups

DEFAULT_STALL_AFTER = 60.0
TICK_SECONDS = 1.0  # at most; a smaller `stall_after` wakes the thread 4 times within it
ANSWER_SECONDS = 5.0  # how long a round waits for every rank's answer
GRACE_SECONDS = 10.0  # how long a released main thread may stay blocked before the process ends
SIGNAL_GRACE_SECONDS = 5.0  # how long a signal's own handler may take to run before a blocked main thread is released
_KEY = "lightning_zero/watch"
_VERDICT = f"{_KEY}/verdict"
_FOREIGN_TAG = 0x5A0DD06  # the tag of the receive that closes a gloo connection: no collective of torch's uses it


@dataclass
class _Stillness:
    """Since when the main thread has stayed in one frame call."""

    key: tuple[int, int, int] | None = None
    since: float = 0.0


class Watchdog:
    """One per process, started with the first run's process group (:func:`start`)."""

    def __init__(self, stall_after: float) -> None:
        self.stall_after = stall_after
        self.verdict: labels.DivergedError | peers.PeerError | None = None
        self._still = _Stillness()
        self._asked_at = -math.inf  # when this rank last asked a round
        self._answered = 0  # the last round this rank answered
        self._seen = 0  # the last round this rank collected
        self._signalled: int | None = None  # a SIGTERM or SIGINT received while blocked
        # a signal received while the main thread was in a collective, the call it was in, and when
        self._pending_signal: tuple[int, tuple[int, int, int], float] | None = None
        self._released: tuple[tuple[int, int, int] | None, float] | None = None  # the blocked frame, and when
        self._lock = threading.Lock()  # rounds are asked from this thread and from a failed collective's
        self._wakeup = _signal_pipe()
        self._stopping = False

    @property
    def tick(self) -> float:
        return min(TICK_SECONDS, self.stall_after / 4)

    def run(self) -> None:
        while not self._stopping:
            signum = self._sleep()
            sample = activity.sample()
            if sample is None:
                continue
            now = time.monotonic()
            if sample.frame_key != self._still.key:
                self._still = _Stillness(sample.frame_key, now)
            if self._released is not None:
                self._end_if_still_blocked(sample)
                continue
            blocked = sample.place is not Place.BUSY
            if signum is not None and blocked:
                self._pending_signal = (signum, sample.frame_key, now)
            if self._pending_signal is not None:
                signum, frame_key, received = self._pending_signal
                if frame_key != sample.frame_key:  # the main thread moved on: its own handler deals with the signal
                    self._pending_signal = None
                elif now - received >= SIGNAL_GRACE_SECONDS:
                    self._signalled = signum
                    self.ask()
                    continue
            asked = _store_int(f"{_KEY}/asked")
            if asked is not None and asked != self._seen:
                self._round(asked)
            elif blocked and now - self._still.since >= self.stall_after and now - self._asked_at >= self.stall_after:
                self.ask()

    def ask(self) -> None:
        """Put a round to every rank, answer it, and reach its verdict."""
        self._asked_at = time.monotonic()
        store = default_store()
        if store is None:
            return
        with contextlib.suppress(Exception):  # the store is gone (rank 0 exited): nothing to coordinate
            self._round(store.add(f"{_KEY}/asked", 1))

    def adopt(self) -> None:
        """Take the job's verdict, if a rank wrote one."""
        store = default_store()
        if store is None:
            return
        with self._lock, contextlib.suppress(Exception):  # the store is gone
            if self.verdict is None and store.check([_VERDICT]):
                self._reach(json.loads(store.get(_VERDICT).decode()))

    def _round(self, number: int) -> None:
        """Answer round ``number``, collect every answer, and take the verdict: the first any round reached (one key
        for the whole job, so every rank raises the same error whichever round it collected)."""
        store = default_store()
        if store is None or self.verdict is not None:
            return
        size = dist.get_world_size()
        with self._lock:
            try:
                self._seen = max(self._seen, number)
                self._answer_up_to(number)
                keys = [f"{_KEY}/{number}/{rank}" for rank in range(size)]
                deadline = time.monotonic() + ANSWER_SECONDS
                while not store.check(keys) and not store.check([_VERDICT]) and time.monotonic() < deadline:
                    time.sleep(0.05)
                    self._answer_up_to(store.add(f"{_KEY}/asked", 0))  # a peer asked a round of its own meanwhile
                if store.check([_VERDICT]):
                    agreed = store.get(_VERDICT).decode()
                else:
                    answers = {rank: json.loads(store.get(key)) for rank, key in enumerate(keys) if store.check([key])}
                    found = _verdict_of(answers, size, self.tick)
                    agreed = "" if found is None else store.compare_set(_VERDICT, "", json.dumps(found)).decode()
            except Exception:  # the store is gone
                return
            if agreed:
                self._reach(json.loads(agreed))

    def _answer_up_to(self, number: int) -> None:
        """Answer every round up to ``number`` not answered yet (ranks that ask at once ask different rounds)."""
        store = default_store()
        if store is None or number <= self._answered:
            return
        answer = json.dumps(self._answer())
        for unanswered in range(self._answered + 1, number + 1):
            store.set(f"{_KEY}/{unanswered}/{dist.get_rank()}", answer)
        self._answered = number

    def _answer(self) -> dict[str, object]:
        sample = activity.sample()
        place = sample.place if sample is not None else Place.BUSY
        return {
            "doing": activity.doing(),
            "place": place.value,
            "where": sample.where if sample is not None else "?",
            "call": sample.call if sample is not None else "",
            "seconds": time.monotonic() - self._still.since,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "signal": signal.Signals(self._signalled).name if self._signalled is not None else "",
        }

    def _reach(self, found: dict[str, object]) -> None:
        """Take the job's verdict: tell the user, and release the collective the main thread is blocked in."""
        me = dist.get_rank()
        self.verdict = _error(found, me)
        print(f"lightning_zero (rank {me}): {type(self.verdict).__name__}: {self.verdict}", file=sys.stderr, flush=True)
        self._released = (self._still.key, time.monotonic())
        release()

    def _end_if_still_blocked(self, sample: activity.Sample) -> None:
        """After the release: a main thread still in the frame it was blocked in :data:`GRACE_SECONDS` later is stuck
        where no release reaches; the process ends."""
        assert self._released is not None
        blocked_in, since = self._released
        if sample.frame_key != blocked_in:
            self._released = (None, since)  # it moved on: it raises, as it should
        elif time.monotonic() - since >= GRACE_SECONDS:
            _end_process(128 + self._signalled if self._signalled is not None else 1)

    def _sleep(self) -> int | None:
        """Sleep a tick, or less if a signal arrives: the signal's number, then."""
        if self._wakeup is None:
            time.sleep(self.tick)
            return None
        ready, _, _ = select.select([self._wakeup], [], [], self.tick)
        if not ready:
            return None
        with contextlib.suppress(BlockingIOError):
            received = os.read(self._wakeup, 64)
            for signum in received:
                if signum in (signal.SIGTERM, signal.SIGINT):
                    return signum
        return None


_WATCHDOG: Watchdog | None = None


def start(stall_after: float) -> None:
    """Watch this process's collectives (once its default process group exists), with the bound ``stall_after``:
    the first call starts the thread, later ones (later runs) set the bound."""
    global _WATCHDOG
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    if _WATCHDOG is None:
        _WATCHDOG = Watchdog(stall_after)
        in_thread(_WATCHDOG.run)
    _WATCHDOG.stall_after = stall_after


def verdict() -> labels.DivergedError | peers.PeerError | None:
    """The error every rank raises, once a round reached one."""
    return None if _WATCHDOG is None else _WATCHDOG.verdict


def check_now(ask: bool) -> labels.DivergedError | peers.PeerError | None:
    """After one of this package's collectives failed: the job's verdict if a rank reached one already (a peer that
    released its connections wrote it first); else, where ``ask`` (the failure is not a lost connection: a peer may
    have gone elsewhere), a round asked at once, and its verdict."""
    if _WATCHDOG is None:
        return None
    if _WATCHDOG.verdict is None:
        _WATCHDOG.adopt()
    if _WATCHDOG.verdict is None and ask:
        _WATCHDOG.ask()
    return _WATCHDOG.verdict


def note_verdict(error: BaseException) -> None:
    """Add the verdict to ``error``, the one a collective of torch's raised once released (Lightning's, say), where it
    is another error."""
    found = verdict()
    if found is not None and found is not error and found is not error.__cause__:
        failures.add_note(error, f"lightning_zero: {type(found).__name__}: {found}")


def at_exit(failed: bool) -> labels.DivergedError | peers.PeerError | None:
    """At exit, before the process group goes: count this rank among those that reached their exit and, unless it
    ``failed`` (its peers hear of that through :mod:`.failures`), wait until every rank has, or a verdict (a peer still
    blocked in a collective this rank will never enter, one that stopped). The store lives in rank 0's process, so
    rank 0 must not leave while the others may still ask."""
    store = default_store()
    if _WATCHDOG is None or store is None:
        return None
    activity.leaving()
    with contextlib.suppress(Exception):  # the store is gone: rank 0 exited
        store.add(f"{_KEY}/exited", 1)
        size = dist.get_world_size()
        while not failed and _WATCHDOG.verdict is None and store.add(f"{_KEY}/exited", 0) < size:
            time.sleep(0.1)
    if not failed:  # a peer that reached the verdict may have counted itself before this rank's thread looked
        _WATCHDOG.adopt()
    return _WATCHDOG.verdict


def stop() -> None:
    """At exit: the thread ends at its next tick."""
    if _WATCHDOG is not None:
        _WATCHDOG._stopping = True


def release() -> None:
    """Make the collective this process's main thread is blocked in fail (see the module's docstring)."""
    for group in process_groups():
        try:
            backend = dist.get_backend(group)
        except (RuntimeError, ValueError):
            continue
        if backend == "gloo":
            _close_connections(group)
        else:
            with contextlib.suppress(Exception):  # NCCL: its communicator aborted; an unknown backend: left alone
                group.abort()


def _close_connections(group: ProcessGroup) -> None:
    me = dist.get_rank()
    for peer in dist.get_process_group_ranks(group):
        if peer == me:
            continue
        with contextlib.suppress(Exception):
            work = dist.irecv(torch.empty(1), src=peer, group=group, tag=_FOREIGN_TAG)
            work.wait(timeout=timedelta(milliseconds=1))


def _verdict_of(answers: dict[int, dict], size: int, tick: float) -> dict[str, object] | None:
    """The verdict of a round with these ``answers`` (rank -> answer) among ``size`` ranks: what every rank turns into
    its error, or None."""
    missing = [rank for rank in range(size) if rank not in answers]
    signalled = [rank for rank, a in answers.items() if a["signal"]]
    if missing or signalled:
        return {"kind": "peer", "missing": missing, "signalled": signalled, "answers": answers}
    waits = {
        (a["place"], a["doing"] if a["place"] != Place.LEFT.value else "", a["call"])
        for a in answers.values()
        if a["place"] != Place.BUSY.value and a["seconds"] >= tick
    }
    if len(waits) > 1:
        return {"kind": "diverged", "answers": answers}
    return None


def _error(found: dict, me: int) -> labels.DivergedError | peers.PeerError:
    answers = {int(rank): answer for rank, answer in found["answers"].items()}
    doing = {rank: _described(answer) for rank, answer in answers.items()}
    if found["kind"] == "diverged":
        return labels.diverged_between(me, doing)
    return peer_error(me, found["missing"], found["signalled"], doing, answers)


def peer_error(
    me: int, missing: list[int], signalled: list[int], doing: dict[int, str], answers: dict[int, dict]
) -> peers.PeerError:
    what = "; ".join(f"rank {rank}: {doing[rank]}" for rank in sorted(doing))
    if signalled:
        rank = signalled[0]
        return peers.PeerError(
            f"lightning_zero on rank {me} stopped: rank {rank} received {answers[rank]['signal']} while blocked in a"
            f" collective ({what}). HINT: the job is being stopped (the scheduler, `timeout`, Ctrl-C); every rank"
            " leaves now rather than waiting for it."
        )
    announced = {rank: failure for rank in missing if (failure := failures.announced(rank)) is not None}
    if announced:
        rank, failure = next(iter(announced.items()))
        return failures.failed("stall watchdog", me, rank, failure, {})
    return peers.PeerError(
        f"lightning_zero's stall watchdog on rank {me} gave up: {peers.ranks(missing)} did not answer within"
        f" {ANSWER_SECONDS:g} s after a collective had waited the strategy's `stall_after` for it. Where the others"
        f" are: {what or 'none answered'}. HINT: a rank that does not answer is stopped (SIGSTOP, a debugger) or hung"
        " in native code without letting Python run; `py-spy dump --pid <PID>` on its host shows where."
        " A rank that legitimately takes longer needs a larger `stall_after`."
    )


def _described(answer: dict) -> str:
    doing, seconds = answer["doing"], f"{answer['seconds']:.0f} s"
    match Place(answer["place"]):
        case Place.WAITING:
            return f"{doing} (waiting in it for {seconds})"
        case Place.TORCH:
            return f"{doing}, then torch's `{answer['call']}` called at {answer['where']} (waiting for {seconds})"
        case Place.LEFT:
            return f"{doing}, then the end of its script (waiting at exit for the others)"
        case Place.BUSY:
            return f"{doing}, then busy at {answer['where']} for {seconds}"


def _store_int(key: str) -> int | None:
    store = default_store()
    if store is None:
        return None
    try:
        return store.add(key, 0)
    except Exception:  # the store is gone
        return None


def _signal_pipe() -> int | None:
    """The read end of a pipe Python writes each signal's number to as it arrives, even while the main thread is
    blocked in native code (where its own handlers cannot run); None off the main thread or where a wakeup fd is set
    already (an event loop's)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    read, write = os.pipe()
    os.set_blocking(read, False)
    os.set_blocking(write, False)
    try:
        earlier = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    except ValueError:
        earlier = -2
    if earlier != -1:
        if earlier >= 0:
            signal.set_wakeup_fd(earlier)
        os.close(read)
        os.close(write)
        return None
    return read


def _end_process(status: int) -> NoReturn:
    """The main thread stays blocked after its collective was released: leave, after what the exit hook would do that
    matters to others (the shared memory unmapped, the peers told)."""
    from lightning_zero._transport import shared_memory

    with contextlib.suppress(Exception):
        shared_memory.close_all(failed=True)
    launched.end_started_ranks()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)

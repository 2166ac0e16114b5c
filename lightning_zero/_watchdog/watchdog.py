"""The stall watchdog's thread, and when a rank asks a round (the other jobs: see :mod:`lightning_zero._watchdog`).

Words used below:

- *watcher*: this process's thread and what outlives a run on one process group: the rounds it answered, the signal
  pipe. Started by the first run on a group; stopped at the process's exit, or when the group is destroyed (it then
  ends the run under way: what Fabric users do at the end of a script); started again by a later run if it stopped.
- *watch*: one run's watching (:class:`Watch`): its scope, its bound ``stall_after``, the verdict it reached, the
  release under way. A run begins with a fresh watch (:func:`begin_run`) and inherits nothing from the one before,
  verdict or round; outside a run (after a Trainer's teardown, at the exit) the watch is the exit scope's, which takes
  only the verdicts of the ranks' wait at their exit.
- *stall*: this rank's main thread has stayed in one call of a collective (this package's, torch's) for ``stall_after``
  seconds: its thread asks a round. A rank also asks one when one of this package's collectives fails
  (:meth:`Watcher.check_now`), when it receives SIGTERM or SIGINT while blocked (still in the same call
  :data:`SIGNAL_GRACE_SECONDS` later: otherwise the signal's own handler, Lightning's, runs), and after each
  ``stall_after`` it waits at its exit for the others (:func:`at_exit`, from the main thread: the exit's wait does not
  rely on the thread).
- *failure*: an exception on the thread itself is named on stderr with its traceback, announced to the peers
  (:mod:`lightning_zero._transport.failures`), and raised by the next collective this rank enters: the run fails
  rather than goes on unwatched.

Cost on a step that does not stall: one assignment per collective (:func:`lightning_zero._transport.activity.entered`)
and a thread that wakes once a tick to look at the main thread's frame and read one counter in the store.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import math
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist
from torch.distributed import ProcessGroup, Store

from lightning_zero._threads import in_thread
from lightning_zero._transport import activity, failures, stalls
from lightning_zero._transport.activity import Place, WatchdogError
from lightning_zero._transport.c10d_private import default_store
from lightning_zero._transport.stalls import StallError
from lightning_zero._watchdog import verdicts
from lightning_zero._watchdog.ending import FrameKey, Released, end_process
from lightning_zero._watchdog.release import release
from lightning_zero._watchdog.rounds import EXIT, POLL_SECONDS, Rounds, StoreGone, run_scope
from lightning_zero._watchdog.signals import SignalPipe

DEFAULT_STALL_AFTER = 60.0
TICK_SECONDS = 1.0  # at most; a smaller `stall_after` wakes the thread 4 times within it
SIGNAL_GRACE_SECONDS = 5.0  # how long a signal's own handler may take to run before a blocked main thread is released
LOOK_SECONDS = 1.0  # how often an asker looks whether the ranks it waits for are gone (a round ends early then)
EXIT_POLL_SECONDS = 0.1  # how often a rank at its exit looks whether every rank reached its own
_HERE = str(Path(__file__).parent)  # the watchdog's own frames, left out when it looks at the main thread


@dataclass
class Stillness:
    """Since when the main thread has stayed in one frame call."""

    key: FrameKey | None = None
    since: float = 0.0


@dataclass
class Watch:
    """One run's watching (or, outside a run, the exit's): see the module's words."""

    scope: str
    stall_after: float
    takes: tuple[str, ...]  # the scopes whose verdicts it takes
    verdict: StallError | None = None
    asked_at: float = -math.inf  # when this rank last asked a round, or answered one
    signalled: int | None = None  # a SIGTERM or SIGINT received while blocked, acted on
    pending_signal: tuple[int, FrameKey, float] | None = None  # received while blocked: the call it was in, and when
    released: Released | None = None

    @property
    def tick(self) -> float:
        return min(TICK_SECONDS, self.stall_after / 4)

    @classmethod
    def of_exit(cls, stall_after: float) -> Watch:
        return cls(EXIT, stall_after, (EXIT,))


class Watcher:
    """The watchdog of this process on ``group`` (see the module's words); the collectives' judge
    (:class:`lightning_zero._transport.stalls.Judge`)."""

    def __init__(self, group: ProcessGroup, store: Store, stall_after: float, answered: int = 0) -> None:
        self.group = weakref.ref(group)
        self.rank = dist.get_rank()
        self.size = dist.get_world_size()
        self.rounds = Rounds(store, self.rank, self.size)
        self.watch = Watch.of_exit(stall_after)
        self.last: Watch | None = None  # the last run's watch, once it ended
        self.failure: BaseException | None = None
        self.answered = answered  # the last round this rank answered
        self._on_group_gone: Callable[[], None] = _nothing
        self._still = Stillness()
        self._seen = 0  # the last round number this rank looked at
        self._taken: dict[str, StallError] = {}  # the verdict taken in each scope
        self._lock = threading.RLock()  # rounds are answered and verdicts reached from this thread and the main one
        self._stopping = threading.Event()
        self._pipe = SignalPipe.install()
        self._thread = in_thread(self._run)

    @property
    def alive(self) -> bool:
        return not self._thread.done()

    # --- runs ---------------------------------------------------------------------------------------------------------

    def begin(self, watch: Watch, on_group_gone: Callable[[], None]) -> None:
        self.watch = watch
        self._on_group_gone = on_group_gone

    def end_run(self) -> None:
        if self.watch.scope != EXIT:
            self.last = self.watch
            self.watch = Watch.of_exit(self.watch.stall_after)
        self._on_group_gone = _nothing

    # --- the collectives' judge ---------------------------------------------------------------------------------------

    def verdict(self) -> StallError | None:
        return self.watch.verdict

    def check_now(self, ask: bool) -> StallError | None:
        watch = self.watch
        with contextlib.suppress(StoreGone):
            self._adopt(watch)
            if watch.verdict is None and ask:
                self.ask(watch, self._still_for())
        return watch.verdict

    # --- the thread ---------------------------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            with contextlib.suppress(StoreGone):
                self.rounds.publish_place(verdicts.place())
            while not self._stopping.is_set():
                signum = self._sleep(self.watch.tick)
                if not dist.is_initialized() or dist.group.WORLD is not self.group():
                    self._on_group_gone()  # Fabric's end of a run: the user destroyed the process group
                    return
                self._look(signum)
        except BaseException as error:  # whatever it is, the run must not go on unwatched
            self._fail(error)

    def _look(self, signum: int | None) -> None:
        """One tick: follow the rounds, then decide whether to ask one."""
        sample = activity.sample(skipping=_HERE)
        if sample is None:
            return
        now = time.monotonic()
        if sample.frame_key != self._still.key:
            self._still = Stillness(sample.frame_key, now)
        watch = self.watch
        try:
            self._follow(watch)
            if watch.released is not None:
                if watch.released.stuck(sample.frame_key):
                    end_process(128 + watch.signalled if watch.signalled is not None else 1)
                return
            if watch.verdict is not None:
                return
            blocked = sample.place is not Place.BUSY
            if signum is not None and blocked:
                watch.pending_signal = (signum, sample.frame_key, now)
            if watch.pending_signal is not None:
                signalled, frame_key, received = watch.pending_signal
                if frame_key != sample.frame_key:  # the main thread moved on: its own handler deals with the signal
                    watch.pending_signal = None
                elif now - received >= SIGNAL_GRACE_SECONDS:
                    watch.signalled, watch.pending_signal = signalled, None
                    self.ask(watch, now - self._still.since, stalled_in=frame_key)
                    return
            # at its exit a rank asks from the main thread (`at_exit`); outside a run no stall is asked about
            stalled = blocked and sample.place is not Place.LEFT and now - self._still.since >= watch.stall_after
            if stalled and watch.scope != EXIT and now - watch.asked_at >= watch.stall_after:
                self.ask(watch, now - self._still.since, stalled_in=self._still.key)
        except StoreGone:  # rank 0 exited: nothing to coordinate
            return

    def _sleep(self, seconds: float) -> int | None:
        if self._pipe is None:
            self._stopping.wait(seconds)
            return None
        return self._pipe.received(seconds)

    def _fail(self, error: BaseException) -> None:
        self.failure = error
        print(
            f"lightning_zero (rank {self.rank}): the stall watchdog stopped with {type(error).__name__}: {error}\n"
            f"{traceback.format_exc()}",
            file=sys.stderr,
            flush=True,
        )
        stopped = WatchdogError(
            f"lightning_zero's stall watchdog on rank {self.rank} stopped with {type(error).__name__}: {error} (its"
            " traceback is printed above); the run stops rather than go on without it. HINT: this is a fault of"
            " lightning_zero's own: report it with that traceback."
        )
        activity.unwatched(stopped)
        failures.announce(stopped)

    def stop(self) -> None:
        """End the thread (it ends within a tick, or a round's poll) and close the signal pipe (on the main thread)."""
        self._stopping.set()
        with contextlib.suppress(concurrent.futures.TimeoutError):
            self._thread.result(timeout=2 * TICK_SECONDS + 1)
        if self._pipe is not None:
            self._pipe.close()

    # --- rounds -------------------------------------------------------------------------------------------------------

    def _follow(self, watch: Watch) -> None:
        """A round asked or a verdict written since the last look: take the verdict, answer the rounds."""
        latest = self.rounds.latest()
        if latest == self._seen:
            return
        self._seen = latest
        self._adopt(watch)
        self._answer_up_to(latest, watch)

    def _adopt(self, watch: Watch) -> None:
        """Take a verdict written in a scope ``watch`` takes, if one was (told and released once per scope: the exit's
        may have been taken in the run before)."""
        with self._lock:
            for scope in watch.takes:
                if watch.verdict is not None:
                    return
                if scope in self._taken:
                    watch.verdict = self._taken[scope]
                    return
                found = self.rounds.verdict(scope)
                if found is not None:
                    self._reach(watch, found, scope)

    def _answer_up_to(self, number: int, watch: Watch) -> None:
        """Answer every round up to ``number`` not answered yet (ranks that ask at once ask different rounds)."""
        with self._lock:
            if number <= self.answered:
                return
            answer = verdicts.answer(activity.sample(skipping=_HERE), self._still_for(), watch.signalled)
            for unanswered in range(self.answered + 1, number + 1):
                self.rounds.answer(unanswered, answer)
            self.answered = number
            watch.asked_at = time.monotonic()  # taking part in a round counts as asking one

    def ask(self, watch: Watch, still: float, stalled_in: FrameKey | None = None) -> StallError | None:
        """Put a round to every rank, answer it, wait for the answers (the window: ``stall_after``; less once every
        rank that has not answered is gone), and reach its verdict; ``still``: how long this rank has waited.
        ``stalled_in``: the call of the main thread's whose stall the thread asks about; once the main thread left it
        the stall is over, whatever the round would have found (a peer silent in the window may have answered the
        collective meanwhile and held its interpreter again since, in the next run even): no verdict."""
        asked_at = time.monotonic()
        watch.asked_at = asked_at
        number = self.rounds.ask()
        self._answer_up_to(number, watch)
        deadline, next_look = asked_at + watch.stall_after, asked_at + LOOK_SECONDS
        while self.rounds.answered(number) < self.size and watch.verdict is None and not self._stopping.is_set():
            now = time.monotonic()
            if now >= deadline:
                break
            if now >= next_look:
                next_look = now + LOOK_SECONDS
                self._adopt(watch)  # another round reached a verdict
                if self._missing_are_gone(number) or self._left(stalled_in):
                    break
            self._answer_up_to(self.rounds.latest(), watch)  # a peer asked a round of its own meanwhile
            time.sleep(POLL_SECONDS)
        if watch.verdict is None and self._left(stalled_in):
            return None
        if watch.verdict is not None:
            return watch.verdict
        answers = self.rounds.answers(number)
        missing = [rank for rank in range(self.size) if rank not in answers]
        places = {rank: self.rounds.place_of(rank) for rank in missing}
        failed = {rank: failure for rank in missing if (failure := failures.announced(rank)) is not None}
        asked = {"rank": self.rank, "window": watch.stall_after, "waited": time.monotonic() - asked_at, "still": still}
        found = verdicts.verdict_of(answers, self.size, watch.tick, places, failed, asked)
        if found is not None:
            self._reach(watch, self.rounds.decide(watch.scope, found), watch.scope)
        return watch.verdict

    def _left(self, stalled_in: FrameKey | None) -> bool:
        """Whether the main thread is no longer in the call ``stalled_in`` (never, for a round asked without one)."""
        if stalled_in is None:
            return False
        now = activity.sample(skipping=_HERE)
        return now is None or now.frame_key != stalled_in

    def _missing_are_gone(self, number: int) -> bool:
        """Whether every rank that has not answered round ``number`` exited or announced a failure: waiting longer
        for them tells nothing more."""
        missing = [rank for rank in range(self.size) if rank not in self.rounds.answers(number)]
        return all(
            failures.announced(rank) is not None
            or verdicts.silence_of(self.rounds.place_of(rank), cpu=False) is verdicts.Silence.EXITED
            for rank in missing
        )

    def _reach(self, watch: Watch, found: dict, scope: str) -> None:
        """Take ``scope``'s verdict ``found``: tell the user, and release the collective the main thread is blocked
        in."""
        with self._lock:
            if watch.verdict is not None:
                return
            mine = verdicts.answer(activity.sample(skipping=_HERE), self._still_for(), watch.signalled)
            watch.verdict = self._taken[scope] = verdicts.error_of(found, self.rank, mine)
            print(
                f"lightning_zero (rank {self.rank}): {type(watch.verdict).__name__}: {watch.verdict}",
                file=sys.stderr,
                flush=True,
            )
            watch.released = Released(self._still.key, time.monotonic())
            release()

    def _still_for(self) -> float:
        """How long the main thread has stayed in the call it is in now (0 if it moved since the last look)."""
        now = activity.sample(skipping=_HERE)
        return time.monotonic() - self._still.since if now is not None and now.frame_key == self._still.key else 0.0

    # --- the exit -----------------------------------------------------------------------------------------------------

    def at_exit(self, failed: bool) -> StallError | None:
        """See :func:`at_exit`."""
        self.end_run()
        watch = self.watch
        if self.last is not None and self.last.verdict is None:  # its last run's verdict, if it never took it
            watch.takes = (EXIT, self.last.scope)
        self.rounds.count_exit()
        if failed:
            self._adopt(watch)  # its error may be a verdict's symptom (gloo's "Connection closed"): printed beside it
            return None
        waiting_since = time.monotonic()
        watch.asked_at = waiting_since
        left = activity.sample(skipping=_HERE)  # the exit's wait is one call, whether the thread looks or not
        self._still = Stillness(left.frame_key if left is not None else None, waiting_since)
        while watch.verdict is None and self.rounds.exited() < self.size:
            self._follow(watch)  # the thread may have failed: the main thread answers the others' rounds too
            self._adopt(watch)
            if watch.verdict is None and time.monotonic() - watch.asked_at >= watch.stall_after:
                self.ask(watch, time.monotonic() - waiting_since)
            time.sleep(EXIT_POLL_SECONDS)
        self._adopt(watch)  # a peer that reached the verdict may have counted itself before this rank looked
        return watch.verdict


def _nothing() -> None:
    """No run under way: a destroyed process group ends none."""


_WATCHER: Watcher | None = None


def begin_run(number: int, stall_after: float, on_group_gone: Callable[[], None]) -> None:
    """Run ``number`` of this process begins on the default process group: watched afresh, with the bound
    ``stall_after``; ``on_group_gone`` ends the run if the group is destroyed before its end. The watcher starts with
    the first run on a group (again, if it stopped). Nothing to watch on one rank."""
    global _WATCHER
    activity.begin_run()
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    store, group = default_store(), dist.group.WORLD
    if store is None or group is None:
        return
    answered = 0
    if _WATCHER is not None and (not _WATCHER.alive or _WATCHER.group() is not group):
        answered = _WATCHER.answered if _WATCHER.group() is group else 0  # rounds of the same store stay answered
        _WATCHER.stop()
        _WATCHER = None
    if _WATCHER is None:
        _WATCHER = Watcher(group, store, stall_after, answered)
    scope = run_scope(number)
    _WATCHER.begin(Watch(scope, stall_after, (scope, EXIT)), on_group_gone)
    stalls.judged_by(_WATCHER)


def end_run() -> None:
    """The run under way ended: outside a run, only the verdicts of the ranks' exit are taken, and no stall is asked
    about."""
    if _WATCHER is not None:
        _WATCHER.end_run()


def note_verdict(error: BaseException) -> None:
    """Add the verdict to ``error``, the one a collective of torch's raised once released (Lightning's, say), where it
    is another error."""
    found = _WATCHER.check_now(ask=False) if _WATCHER is not None else None
    if found is not None and found is not error and found is not error.__cause__:
        failures.add_note(error, f"lightning_zero: {type(found).__name__}: {found}")


def at_exit(failed: bool) -> StallError | None:
    """At exit, before the process group goes: count this rank among those that reached their exit and, unless it
    ``failed`` (its peers hear of that through :mod:`lightning_zero._transport.failures`), wait until every rank has,
    or a verdict (a peer still blocked in a collective this rank will never enter, one that stopped or is gone). The
    main thread asks a round itself after each ``stall_after`` of waiting, so the wait ends whether the thread runs or
    not. The store lives in rank 0's process, so rank 0 must not leave while the others may still ask."""
    if _WATCHER is None:
        return None
    activity.leaving()
    try:
        return _WATCHER.at_exit(failed)
    except StoreGone:  # rank 0 exited
        return None


def stop() -> None:
    """At exit, or before a new watcher: the thread ends and the signal pipe is closed."""
    global _WATCHER
    if _WATCHER is not None:
        _WATCHER.stop()
        _WATCHER = None
    stalls.judged_by(None)

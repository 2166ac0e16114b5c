"""What a round's answers mean, and the words every rank raises once a verdict is reached.

Words used below:

- *answer*: what a rank says of itself when a round reaches it (:func:`answer`): the last labelled point it entered
  (:mod:`lightning_zero._transport.activity`), where its main thread is (*waiting* in this package's collectives, in
  *torch*'s, *left* at its exit, or *busy* anywhere else) and for how long it has stayed there, its host and process,
  and a signal it received while blocked.
- *missing*: a rank that did not answer within the round's window, so gave no sign of life for that long. Its *silence*
  is what can be told of it from the asker's host (:class:`Silence`): its process exited, is stopped, or runs while its
  interpreter does not (native code holding the GIL: an extension call that does not release it, or a hang there). A
  silent rank whose main thread computes (uses the CPU: an extension computing while it holds the GIL) gives that
  sign of life, and is waited for as a busy one is; on another host or PID namespace nothing can be told.
- *verdict*: :class:`~lightning_zero._transport.labels.DivergedError` when the ranks wait in different places (code
  that differs between ranks); :class:`~lightning_zero._transport.peers.PeerError` when a rank is missing, failed (it
  announced its error) or received a signal while blocked; none when every rank answered and none is stuck elsewhere
  (a rank busy computing is slower, not stuck: the round is asked again after another ``stall_after``).

Every rank raises the verdict's error in its own words (:func:`error_of`): how long it waited, where, and for whom.
"""

from __future__ import annotations

import enum
import os
import signal
import socket
import time
from typing import Any

from lightning_zero._creator import Creator, Liveness, main_thread
from lightning_zero._transport import activity, failures, labels, peers
from lightning_zero._transport.activity import Place
from lightning_zero._transport.stalls import StallError

Answer = dict[str, Any]


class Silence(enum.Enum):
    """What the asker's host can tell of a missing rank's process."""

    EXITED = "exited"
    STOPPED = "stopped"
    HELD = "held"  # running, its interpreter silent and its main thread idle: native code blocked while holding it
    COMPUTING = "computing"  # its interpreter silent, its main thread computing in native code: busy, waited for
    UNKNOWN = "unknown"  # another host or PID namespace


COMPUTING_LOOK_SECONDS = 0.5  # how long the main thread of a silent rank is watched for work
COMPUTING_LOOKS = 5  # looks at its state in that time


def place() -> dict[str, Any]:
    """Where this rank runs, as :mod:`.rounds` publishes it."""
    me = Creator.this_process()
    return {"host": socket.gethostname(), "pid": os.getpid(), "creator": None if me is None else me.tag}


def silence_of(where: dict[str, Any] | None, *, cpu: bool = True) -> Silence:
    """What this host can tell of the process a rank published as its place (``None``: none published); without
    ``cpu``, a running process is not watched for CPU use (taken as held)."""
    if where is None or where["host"] != socket.gethostname() or where["creator"] is None:
        return Silence.UNKNOWN
    mine, theirs = Creator.this_process(), Creator.from_tag(where["creator"])
    if mine is None or theirs is None or theirs.namespace != mine.namespace:
        return Silence.UNKNOWN
    match theirs.liveness():
        case Liveness.DEAD:
            return Silence.EXITED
        case Liveness.STOPPED:
            return Silence.STOPPED
        case Liveness.RUNNING:
            return Silence.COMPUTING if cpu and _computing(theirs.pid) else Silence.HELD
        case Liveness.UNKNOWN:
            return Silence.UNKNOWN


def _computing(pid: int) -> bool:
    """Whether the main thread of process ``pid`` computes over :data:`COMPUTING_LOOK_SECONDS`: running or waiting for
    a core at one of its looks, or using CPU time between them (native code that holds the interpreter while it works),
    as opposed to one blocked, sleeping or deadlocked while holding it (it sleeps, and uses none). On a loaded host a
    computing thread may get little CPU time, but stays runnable."""
    looks = []
    for _ in range(COMPUTING_LOOKS):
        looks.append(main_thread(pid))
        time.sleep(COMPUTING_LOOK_SECONDS / COMPUTING_LOOKS)
    seen = [look for look in looks if look is not None]
    return any(state == "R" for state, _ in seen) or (len(seen) > 1 and seen[-1][1] > seen[0][1])


def answer(sample: activity.Sample | None, still_for: float, signalled: int | None) -> Answer:
    """This rank's answer: its main thread as ``sample`` saw it, there for ``still_for`` seconds."""
    return {
        "doing": activity.doing(),
        "place": (sample.place if sample is not None else Place.BUSY).value,
        "where": sample.where if sample is not None else "?",
        "call": sample.call if sample is not None else "",
        "seconds": still_for,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "signal": signal.Signals(signalled).name if signalled is not None else "",
    }


def verdict_of(
    answers: dict[int, Answer],
    size: int,
    tick: float,
    places: dict[int, dict[str, Any] | None],
    failed: dict[int, str],
    asked: dict[str, Any],
) -> dict[str, Any] | None:
    """The verdict of a round with these ``answers`` (rank -> answer) among ``size`` ranks, where each missing rank
    runs (``places``) and the failures ranks announced (``failed``); ``asked``: the round's asker (``rank``), its
    ``window`` and how long it ``waited`` for the answers. None: no rank is stuck."""
    missing = [rank for rank in range(size) if rank not in answers]
    signalled = [rank for rank, a in answers.items() if a["signal"]]
    silent = {str(rank): _missing(places.get(rank)) for rank in missing if rank not in failed}
    if all(entry["silence"] == Silence.COMPUTING.value for entry in silent.values()):  # busy in native code
        silent, missing = {}, [rank for rank in missing if rank in failed]
    if missing or signalled:
        announced = {str(rank): failed[rank] for rank in missing if rank in failed}
        return {"kind": "peer", "missing": silent, "failed": announced, "signalled": signalled, "answers": answers,
                "asked": asked}  # fmt: skip
    waits = {
        (a["place"], a["doing"] if a["place"] != Place.LEFT.value else "", a["call"])
        for a in answers.values()
        if a["place"] != Place.BUSY.value and a["seconds"] >= tick
    }
    if len(waits) > 1:
        return {"kind": "diverged", "answers": answers, "asked": asked}
    return None


def _missing(where: dict[str, Any] | None) -> dict[str, Any]:
    return {"silence": silence_of(where).value, "pid": where["pid"] if where else None}


def error_of(found: dict[str, Any], me: int, mine: Answer | None = None) -> StallError:
    """The error rank ``me`` raises for the verdict ``found``; ``mine``: its own answer now, which says how long it has
    waited and where."""
    answers = {int(rank): a for rank, a in found["answers"].items()}
    doing = {rank: described(a) for rank, a in answers.items()}
    if found["kind"] == "diverged":
        return labels.diverged_between(me, doing)
    what = "; ".join(f"rank {rank}: {doing[rank]}" for rank in sorted(doing))
    if found["signalled"]:
        rank = found["signalled"][0]
        return peers.PeerError(
            f"lightning_zero on rank {me} stopped: rank {rank} received {answers[rank]['signal']} while blocked in a"
            f" collective ({what}). HINT: the job is being stopped (the scheduler, `timeout`, Ctrl-C); every rank"
            " leaves now rather than waiting for it."
        )
    if found["failed"]:
        rank, failure = next(iter(found["failed"].items()))
        return failures.failed("stall watchdog", me, int(rank), failure, {})
    missing = {int(rank): entry for rank, entry in found["missing"].items()}
    return missing_error(me, missing, mine or answers.get(me), found["asked"], what)


def missing_error(
    me: int, missing: dict[int, dict[str, Any]], mine: Answer | None, asked: dict[str, Any], what: str
) -> peers.PeerError:
    """The error of rank ``me`` when the ranks ``missing`` (rank -> its silence and PID) gave no sign of life for the
    round's window."""
    rank = min(r for r, entry in missing.items() if entry["silence"] != Silence.COMPUTING.value)  # one stuck
    silence, pid = Silence(missing[rank]["silence"]), missing[rank]["pid"]
    who = peers.ranks(sorted(missing), {r: e["pid"] for r, e in missing.items() if e["pid"] is not None})
    window, silent_for = asked["window"], asked["waited"]
    dump = f"`py-spy dump --native --pid {pid if pid is not None else '<PID>'}`"
    match silence:
        case Silence.EXITED:
            why = (
                f"rank {rank}'s process is gone: it ended without reaching its exit hook (killed: SIGKILL, out of"
                " memory)"
            )
            hint = f"rank {rank}'s own log, or the kernel's (`dmesg`: the OOM killer), says why it ended"
        case Silence.STOPPED:
            why = f"rank {rank}'s process is stopped (SIGSTOP, a debugger)"
            hint = f"continue it (`kill -CONT {pid}`) or detach its debugger"
        case Silence.HELD:
            why = (
                f"rank {rank}'s process runs, but its interpreter ran no Python for those {silent_for:.0f} s: native"
                " code holds it (an extension call that does not release the GIL), or is hung there"
            )
            hint = (
                f"{dump} shows where; a rank that legitimately holds the interpreter that long needs a `stall_after`"
                f" above it (now {window:g} s)"
            )
        case Silence.UNKNOWN:
            why = (
                f"from rank {asked['rank']}'s host nothing tells whether rank {rank} is stopped (SIGSTOP, a debugger),"
                " gone, or holds its interpreter in native code (an extension call that does not release the GIL)"
            )
            hint = (
                f"{dump} on rank {rank}'s host shows where; a rank that legitimately holds its interpreter that long"
                f" needs a `stall_after` above it (now {window:g} s)"
            )
    asker = asked["rank"]
    if me in missing:  # this rank's interpreter runs again: the others gave up on it meanwhile
        return peers.PeerError(
            f"lightning_zero's stall watchdog on rank {asker} gave up on this rank, {who}: it gave no sign of life for"
            f" the {silent_for:.0f} s after rank {asker} asked where every rank was, having waited {asked['still']:.0f}"
            f" s for it; {why}. Where the others are: {what or 'none answered'}. HINT: {hint}."
        )
    they = "it" if len(missing) == 1 else "they"
    return peers.PeerError(
        f"lightning_zero's stall watchdog on rank {me} gave up on {who}: {_waited(me, mine, asked)}, and {they} gave"
        f" no sign of life for the {silent_for:.0f} s after rank {asker} asked where every rank was; {why}. Where the"
        f" others are: {what or 'none answered'}. HINT: {hint}."
    )


def _waited(me: int, mine: Answer | None, asked: dict[str, Any]) -> str:
    """How long rank ``me`` has waited, and where (its answer ``mine``)."""
    if mine is None:
        return f"rank {asked['rank']} had waited {asked['still']:.0f} s"
    seconds = f"{mine['seconds']:.0f} s"
    match Place(mine["place"]):
        case Place.WAITING:
            return f"rank {me} has waited {seconds} in {mine['doing']}"
        case Place.TORCH:
            return f"rank {me} has waited {seconds} in torch's `{mine['call']}` called at {mine['where']}"
        case Place.LEFT:
            return f"rank {me} has waited {seconds} at its exit"
        case Place.BUSY:
            return f"rank {asked['rank']} had waited {asked['still']:.0f} s (rank {me} was busy)"


def described(answer: Answer) -> str:
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

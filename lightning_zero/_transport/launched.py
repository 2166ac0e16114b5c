"""The ranks this process started as copies of its script (Lightning's launcher for ``devices=N`` outside torchrun):
the job's exit status is this process's, so it must not end before them, nor with 0 when one of them failed.

Lightning watches them only while this process runs (a thread that kills every rank once one fails), so a rank that
failed after this one finished its work (one that generated longer, or raised in its own teardown) used to leave the
job with this process's 0 and its outputs lost. So at its exit, once its process groups are closed (a rank still
waiting for this one in a collective then fails at once, not after the timeout), this process waits for each rank it
started, as torchrun waits for its workers, and, if one failed, ends with status 1 and a line naming it.

A process that is itself failing does not wait for them without a limit: a rank stopped (SIGSTOP) or hung would keep
the job alive past its own error. As torchrun's agent does, it gives them :data:`GRACE_SECONDS` to end by themselves
(a peer blocked in a collective with this process fails as soon as its connections close), then sends SIGTERM, and
SIGKILL after as long again. One that is not failing waits :data:`EXIT_SECONDS` for them at most: by then every rank
reached its exit (the stall watchdog's wait there), and only their teardown is left.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

GRACE_SECONDS = 5.0
# how long the ranks this process started may take to end once it reached its exit: they reached theirs already (the
# stall watchdog's exit wait), and have only their teardown left
EXIT_SECONDS = 60.0
_STARTED: list[list[subprocess.Popen]] = []  # the launchers' lists of the processes they started, filled as they do


def started(procs: list[subprocess.Popen]) -> None:
    """``procs``: the processes a launcher started, ranks 1, 2, ... of this node, in order."""
    _STARTED.append(procs)


class RecordsStartedRanks:
    """Placed before a front end's Lightning ``_SubprocessScriptLauncher``: the ranks it starts are recorded, for
    :func:`wait_for_started_ranks`."""

    procs: list[subprocess.Popen]

    def _call_children_scripts(self) -> None:
        super()._call_children_scripts()  # type: ignore[misc]
        started(self.procs)


def end_started_ranks() -> None:
    """This process fails: the ranks it started that are still running get a grace period, then SIGTERM, then
    SIGKILL (which ends a stopped process too)."""
    procs = [proc for started in _STARTED for proc in started]
    for ending in (None, signal.SIGTERM, signal.SIGKILL):
        running = [proc for proc in procs if proc.poll() is None]
        if not running:
            return
        for proc in running:
            stopped = _stopped(proc)  # it would neither end nor act on SIGTERM until continued
            if stopped or ending is not None:
                sent = signal.SIGKILL if stopped else ending
                how = "is stopped" if stopped else f"still runs {GRACE_SECONDS:g} s after this one failed"
                print(f"lightning_zero: rank {_rank_of(proc)} (PID {proc.pid}), started by this process, {how}:"
                      f" sending it {sent.name}.", file=sys.stderr, flush=True)  # fmt: skip
                proc.send_signal(sent)
        deadline = time.monotonic() + GRACE_SECONDS
        while any(proc.poll() is None for proc in running) and time.monotonic() < deadline:
            time.sleep(0.05)


def _rank_of(proc: subprocess.Popen) -> int:
    """The local rank Lightning's launcher gave ``proc`` (ranks 1, 2, ... in the order started)."""
    return next(rank for procs in _STARTED for rank, started in enumerate(procs, start=1) if started is proc)


def _stopped(proc: subprocess.Popen) -> bool:
    """Whether ``proc`` is stopped (SIGSTOP, a debugger), where ``/proc`` says."""
    try:
        return Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def wait_for_started_ranks(failing: bool = False) -> None:
    """At exit, after the process groups are closed: wait for every rank this process started (ending them first if
    this process is ``failing``; ending them after :data:`EXIT_SECONDS` if they have not ended by then, since every
    rank has reached its exit already), and end the process with status 1 if one failed (even where this process
    itself is ending with 0)."""
    if failing:
        end_started_ranks()
    deadline = time.monotonic() + EXIT_SECONDS
    while any(proc.poll() is None for procs in _STARTED for proc in procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    if any(proc.poll() is None for procs in _STARTED for proc in procs):
        print(f"lightning_zero: ranks started by this process did not end within {EXIT_SECONDS:g} s of its exit.",
              file=sys.stderr, flush=True)  # fmt: skip
        end_started_ranks()
    failed = [
        (rank, code)
        for procs in _STARTED
        for rank, proc in enumerate(procs, start=1)
        if (code := proc.wait()) != 0
    ]
    _STARTED.clear()
    if not failed:
        return
    ranks = ", ".join(f"rank {rank} (exit code {code})" for rank, code in failed)
    print(
        f"lightning_zero: {ranks}, started by this process (rank 0), failed; the job fails with it. HINT: that"
        " rank's own error, printed above, says why.",
        file=sys.stderr,
    )
    logging.shutdown()  # what `os._exit` skips: the interpreter's remaining exit work
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)  # an exception or `sys.exit` in an exit hook leaves the status as it was

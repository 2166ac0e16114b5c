"""Faults in real rank processes (tests/workers/faults.py on 2 CPU ranks): a rank stopped (SIGSTOP) or killed
(SIGKILL) mid-training, the user's own exception in a step, a run killed while its optimizer state lies in disk files.
What each costs the surviving rank, what the user sees, and what is left behind.

Timing: a stalled rank is reported (the error reaches Lightning) once the strategy's ``timeout`` (``TIMEOUT``) has
passed since the survivor began to wait, at most a step after the SIGSTOP; ``REPORTED_WITHIN`` adds 3 s for that step
and a loaded 2-core machine.
A dead peer is seen within the channel's 1 s poll (gloo: at once, the connection resets). The survivor then tears down
and exits; ``EXITED_WITHIN`` bounds that generously, as the interpreter's exit on a loaded machine takes seconds.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop

from lightning_zero._stage3.seam import CUSTOM_COLLECTIVES
from tests.launch import start, write_payload
from tests.scenarios import Fault, FaultyRun

pytestmark = pytest.mark.slow  # every test here launches processes

TIMEOUT = 5
REPORTED_WITHIN = TIMEOUT + 3
STEP_SLACK = 1.0  # seconds rank 0 may have waited in a collective before the stop: a step of the test model is faster
EXITED_WITHIN = TIMEOUT + 20
# a rank out of memory: "ddp" ends both ranks within about 7 s on the loaded development machine; a save adds up to
# the 5 s a new thread may take to begin (lightning_zero._threads.START_SECONDS); never the 60 s timeout of these runs
OUT_OF_MEMORY_EXITED_WITHIN = 20
NO_SHM = {"LIGHTNING_ZERO_SHM_DISABLE": "1"}  # the point-to-point exchanges over gloo, as across hosts


def start_runs(
    runs: list[FaultyRun],
    tmp_path: Path,
    env: dict[str, str] | None = None,
    timeout: float = 60,
    offload_dir: Path | None = None,
) -> list[subprocess.Popen]:
    """Start the runs on 2 ranks, with the strategy's ``timeout`` (long, where the test does not measure it)."""
    write_payload(tmp_path, runs=runs, timeout=timeout, offload_dir=offload_dir)
    return start("tests.workers.faults", [str(tmp_path)], 2, env=env, logs=tmp_path)


def gloo_may_report(strategy: str) -> bool:
    """Whether a failed peer may reach rank 0 under ``strategy`` as gloo's own error, which names no rank: under stage
    3 on a torch whose ``fully_shard`` keeps its own collectives (torch 2.8, where ``CUSTOM_COLLECTIVES`` is false).
    Without shared memory rank 0 then waits in one of them; with it, the ranks meet in the channel just before each,
    and rank 0 waits in the channel or in gloo's collective, wherever the failure caught it."""
    return strategy == "zero3" and not CUSTOM_COLLECTIVES


def gloo_reported(strategy: str, env: dict[str, str] | None, error: dict[str, Any]) -> bool:
    """Whether rank 0's ``error`` is gloo's own (where it may be, see :func:`gloo_may_report`), not the package's."""
    return gloo_may_report(strategy) and (env is not None or error["type"] != "PeerError")


def out_of_memory(error: dict[str, Any]) -> str:
    """The start of what rank 1's ``error``, out of memory, says (as its peers name it): Python's ``MemoryError``, or
    torch's allocator's ``RuntimeError`` (Python 3.10 with torch 2.8 meets the limit there where 3.11 meets it in
    Python)."""
    if error["type"] != "MemoryError":
        assert error["type"] == "RuntimeError" and "can't allocate memory" in error["message"], error["traceback"]
    return f"{error['type']}: {error['message'][:40]}" if error["message"] else error["type"]


def notes(tmp_path: Path, rank: int, error: dict[str, Any]) -> str:
    """Where the package's notes on ``rank``'s ``error`` show: below its traceback, or in its log on Python 3.10,
    which has no notes (the package writes them to stderr there)."""
    return error["traceback"] if sys.version_info >= (3, 11) else log(tmp_path, rank)


def wait_until_trained(procs: list[subprocess.Popen], tmp_path: Path) -> None:
    """Until every rank has finished its second step (startup takes long on a loaded machine)."""
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"rank{rank}.reached").exists() for rank in range(len(procs))):
        running = all(proc.poll() is None for proc in procs)
        assert running and time.monotonic() < deadline, log(tmp_path, 0)
        time.sleep(0.05)


def wait_for_exit(proc: subprocess.Popen, seconds: float, tmp_path: Path, rank: int = 0) -> None:
    try:
        proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        pytest.fail(f"rank {rank} still runs {seconds} s after the fault; its log:\n{log(tmp_path, rank)[-3000:]}")


def ended(tmp_path: Path, rank: int) -> list[dict[str, Any]]:
    """How each run of ``rank`` ended: the exception that left ``fit``."""
    path = tmp_path / f"rank{rank}.json"
    assert path.exists(), f"rank {rank} recorded no exception; its log:\n{log(tmp_path, rank)[-3000:]}"
    return json.loads(path.read_text())


def log(tmp_path: Path, rank: int) -> str:
    return (tmp_path / f"rank{rank}.log").read_text()


def kill_all(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        proc.kill()  # SIGKILL ends a stopped process too
        proc.wait()


def wait_until_rank1_stopped(procs: list[subprocess.Popen], tmp_path: Path) -> float:
    """Until rank 1 has stopped itself (``rank1_stops_*`` faults); the wall-clock time it did."""
    deadline = time.monotonic() + 120
    marker = tmp_path / "rank1.stopped"
    while True:
        assert procs[1].poll() is None and time.monotonic() < deadline, log(tmp_path, 1)
        state = Path(f"/proc/{procs[1].pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        if marker.exists() and state == "T":
            return marker.stat().st_mtime
        time.sleep(0.05)


@pytest.mark.parametrize(
    ("strategy", "env", "when"),
    [
        ("zero2", None, "anywhere"),  # stage 1 waits in the same reducer as stage 2
        ("zero3", None, "anywhere"),
        ("zero3", NO_SHM, "anywhere"),
        ("zero2", None, "between_steps"),
    ],
    ids=["zero2", "zero3", "zero3-gloo", "zero2-between-steps"],
)
def test_a_stalled_rank_is_reported_after_the_timeout(
    strategy: str, env: dict | None, when: str, tmp_path: Path
) -> None:
    """SIGSTOP rank 1 mid-training, from the test at any moment, or by itself between two steps: rank 0 reports it, by
    rank and timeout (where gloo reports it, by timeout alone), once ``timeout`` has passed, and exits. Between steps
    rank 0 first waits in Lightning's broadcast of a SIGTERM flag, whose timeout Lightning swallows: rank 0 still
    reports after one ``timeout``, not two."""
    fault = Fault.NONE if when == "anywhere" else Fault.RANK1_STOPS_BETWEEN_STEPS
    procs = start_runs([FaultyRun(strategy, fault)], tmp_path, env, timeout=TIMEOUT)
    try:
        if when == "anywhere":
            wait_until_trained(procs, tmp_path)
            os.kill(procs[1].pid, signal.SIGSTOP)
            stopped = time.time()
        else:
            stopped = wait_until_rank1_stopped(procs, tmp_path)
        wait_for_exit(procs[0], EXITED_WITHIN, tmp_path)
        exited = time.time()
    finally:
        kill_all(procs)
    (error,) = ended(tmp_path, 0)
    reported = error["caught_at"] - stopped
    print(f"{strategy} {'gloo' if env else 'shared memory'}, stopped {when}: reported {reported:.1f} s, exited"
          f" {exited - stopped:.1f} s after the SIGSTOP, timeout {TIMEOUT} s")
    # rank 0 may already wait in the collective when the SIGSTOP lands (more so on a loaded machine): its timeout then
    # runs out a little before `stopped + TIMEOUT`, never a whole step's time before it
    assert TIMEOUT - STEP_SLACK <= reported < REPORTED_WITHIN
    if gloo_reported(strategy, env, error):  # gloo's timeout, the strategy's
        assert f"Timed out waiting {TIMEOUT * 1000}ms" in error["message"], error["traceback"]
    else:
        assert error["type"] == "PeerError", error["traceback"]
        shown = f"rank 1 (PID {procs[1].pid})" if env is None else "rank 1"  # gloo does not say which PID it waited for
        assert f"{shown} did not arrive within {TIMEOUT} s, the process group's timeout" in error["message"]
        assert "HINT: a rank that does not arrive is alive but elsewhere" in error["message"]
    if when == "between_steps" and hasattr(_TrainingEpochLoop, "_broadcast_sigterm_tensor"):
        assert "in an earlier collective that its caller went past (`broadcast`" in error["message"]


@pytest.mark.parametrize("env", [None, NO_SHM], ids=["shared-memory", "gloo"])
def test_a_killed_peer_is_reported_under_zero3(env: dict | None, tmp_path: Path) -> None:
    """SIGKILL rank 1 at the start of a stage-3 training step (it stopped itself there), while rank 0 waits in the
    step's forward with its units gathered: rank 0's error is the dead peer (gloo's lost connection, where gloo
    reports it), within about a second, and nothing fails in the teardown that follows."""
    procs = start_runs([FaultyRun("zero3", Fault.RANK1_STOPS_IN_STEP)], tmp_path, env)
    try:
        wait_until_rank1_stopped(procs, tmp_path)
        procs[1].kill()
        killed = time.time()
        wait_for_exit(procs[0], EXITED_WITHIN, tmp_path)
    finally:
        kill_all(procs)
    (error,) = ended(tmp_path, 0)
    assert "During handling of the above exception" not in error["traceback"], error["traceback"]
    if gloo_reported("zero3", env, error):
        assert re.search(r"Connection (reset|closed) by peer", error["message"]), error["traceback"]
    else:
        assert error["type"] == "PeerError", error["traceback"]
        if env is None:
            assert f"rank 1 (PID {procs[1].pid}) exited while this rank waited for it" in error["message"]
        else:
            assert "with rank 1 failed" in error["message"] and "HINT" in error["message"]
    print(f"zero3 {'gloo' if env else 'shared memory'}: the dead peer reported {error['caught_at'] - killed:.2f} s"
          " after the SIGKILL")
    assert error["caught_at"] - killed < 3


def test_the_users_exception_surfaces_under_every_stage(tmp_path: Path) -> None:
    """Every rank raises ``ValueError`` in ``training_step`` at step 3, under each stage in turn (one process per rank,
    a fresh Trainer and module per run), then in ``on_train_start`` (before any forward, where a failed resume raises)
    and in ``validation_step`` under stage 3: the ``ValueError`` is what leaves ``fit``, with nothing raised while
    handling it and no warning of the package's own cleanup, and the process ends with it."""
    runs = [FaultyRun(s, Fault.TRAINING_STEP) for s in ("zero1", "zero2", "zero3")]
    runs += [FaultyRun("zero3", fault) for fault in (Fault.ON_TRAIN_START, Fault.VALIDATION_STEP)]
    procs = start_runs(runs, tmp_path)
    try:
        for rank, proc in enumerate(procs):
            wait_for_exit(proc, 300, tmp_path, rank)
    finally:
        kill_all(procs)
    assert [proc.returncode for proc in procs] == [1, 1]  # the last run's ValueError ended each process
    for rank in range(2):
        errors = ended(tmp_path, rank)
        where = [f"{run.strategy} {run.fault.value}" for run in runs]
        assert [(w, e["type"]) for w, e in zip(where, errors, strict=True)] == [(w, "ValueError") for w in where]
        for run, error in zip(runs, errors, strict=True):
            step = 0 if run.fault is Fault.ON_TRAIN_START else 3
            assert error["message"] == f"deliberate failure in {run.fault.value} at step {step}"
            assert "During handling of the above exception" not in error["traceback"], error["traceback"]
        assert "could not reshard" not in log(tmp_path, rank)
        last_line = log(tmp_path, rank).strip().splitlines()[-1]
        assert last_line.endswith("ValueError: deliberate failure in validation_step at step 3"), last_line


def test_a_killed_disk_offload_run_leaves_nothing_in_offload_dir(tmp_path: Path) -> None:
    """SIGKILL both ranks of a run whose optimizer state lives in files under ``offload_dir``: nothing stays there."""
    offload_dir = tmp_path / "offload"
    offload_dir.mkdir()
    procs = start_runs([FaultyRun("zero2")], tmp_path, offload_dir=offload_dir)
    try:
        wait_until_trained(procs, tmp_path)
        for proc in procs:  # the state is in files there, mapped by the rank
            maps = Path(f"/proc/{proc.pid}/maps").read_text()
            assert f" {offload_dir}/" in maps, f"no state file under {offload_dir} mapped by PID {proc.pid}"
    finally:
        kill_all(procs)
    assert list(offload_dir.iterdir()) == []


@pytest.mark.parametrize(
    ("strategy", "fault"),
    [
        ("ddp", Fault.RANK1_OUT_OF_MEMORY_IN_STEP),
        ("zero1", Fault.RANK1_OUT_OF_MEMORY_IN_STEP),
        ("zero2", Fault.RANK1_OUT_OF_MEMORY_IN_BACKWARD),
        ("zero3", Fault.RANK1_OUT_OF_MEMORY_IN_BACKWARD),
        ("zero3", Fault.RANK1_OUT_OF_MEMORY_BEFORE_SAVE),
        ("zero2", Fault.RANK1_OUT_OF_MEMORY_BEFORE_LOAD),
    ],
    ids=["ddp-step", "zero1-step", "zero2-backward", "zero3-backward", "zero3-save", "zero2-load"],
)
def test_a_rank_out_of_memory_ends_every_rank_within_seconds(strategy: str, fault: Fault, tmp_path: Path) -> None:
    """Rank 1 reaches its address-space limit (``RLIMIT_AS``) in a step, in the backward, or as a checkpoint's save
    or a resume's load begins: both ranks end within seconds (as under ``"ddp"``, never after the strategy's timeout,
    here 60 s), rank 1 with the ``MemoryError``, rank 0 with an error that names rank 1 and its ``MemoryError`` (in a
    shared-memory collective rank 0 stops waiting once rank 1 announced it, not once rank 1 has exited); the save
    leaves no staging directory and nothing stays in ``/dev/shm``. Without a bound on a new thread's start, rank 1
    waited forever in ``Thread.start`` in the save and the load (their checksum threads)."""
    procs = start_runs([FaultyRun(strategy, fault)], tmp_path)
    try:
        limited = wait_until_rank1_limited(procs, tmp_path)
        exits = wait_for_exit_times(procs, OUT_OF_MEMORY_EXITED_WITHIN, tmp_path)
    finally:
        kill_all(procs)
    assert [proc.returncode for proc in procs] == [1, 1]
    (failed,) = ended(tmp_path, 1)
    (consequence,) = ended(tmp_path, 0)
    caught = [error["caught_at"] - limited for error in (consequence, failed)]
    print(f"{strategy} {fault.value}: after rank 1 reached its limit, ranks 0, 1 caught their errors"
          f" {caught[0]:.1f} s, {caught[1]:.1f} s and exited {exits[0] - limited:.1f} s, {exits[1] - limited:.1f} s")
    if fault is Fault.RANK1_OUT_OF_MEMORY_BEFORE_SAVE:  # DCP hands rank 1's error to every rank
        for error in (failed, consequence):
            assert error["type"] == "CheckpointException", error["traceback"]
            # where the limit meets it: starting the checksum thread (Python 3.11+), or in that thread (3.10)
            assert re.search(r"MemoryError: A new thread did not begin within|\nMemoryError\n", error["traceback"])
        assert [p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".")] == []
    else:
        said = out_of_memory(failed)
        # rank 0 waits in gloo (the load's, or stage 3's own collectives on torch 2.8), whose error names no rank: a
        # note does
        if fault is Fault.RANK1_OUT_OF_MEMORY_BEFORE_LOAD or gloo_reported(strategy, None, consequence):
            assert f"lightning_zero: rank 1 failed too, with {said}" in notes(tmp_path, 0, consequence)
        elif strategy != "ddp":  # DDP's error is gloo's `Connection closed by peer`, which names no rank
            assert consequence["type"] == "PeerError", consequence["traceback"]
            assert f"rank 1 (PID {procs[1].pid}) failed while this rank waited for it, with {said}" in (
                consequence["message"]
            )
    assert not [entry for entry in Path("/dev/shm").iterdir() if any(f"-{p.pid}-" in entry.name for p in procs)]


def wait_until_rank1_limited(procs: list[subprocess.Popen], tmp_path: Path) -> float:
    """Until rank 1 is about to lower its memory limit; the wall-clock time it did."""
    deadline = time.monotonic() + 120
    marker = tmp_path / "rank1.limited"
    while not marker.exists():
        assert procs[1].poll() is None and time.monotonic() < deadline, log(tmp_path, 1)
        time.sleep(0.05)
    return marker.stat().st_mtime


def wait_for_exit_times(procs: list[subprocess.Popen], seconds: float, tmp_path: Path) -> list[float]:
    """The wall-clock time each rank exited, all within ``seconds`` from now."""
    deadline = time.monotonic() + seconds
    exits: dict[int, float] = {}
    while len(exits) < len(procs):
        for rank, proc in enumerate(procs):
            if rank not in exits and proc.poll() is not None:
                exits[rank] = time.time()
        running = [rank for rank in range(len(procs)) if rank not in exits]
        if running and time.monotonic() > deadline:
            rank = running[0]
            pytest.fail(f"rank {rank} still runs {seconds} s after the fault; its log:\n{log(tmp_path, rank)[-3000:]}")
        time.sleep(0.05)
    return [exits[rank] for rank in range(len(procs))]

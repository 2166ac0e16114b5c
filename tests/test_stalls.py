"""The stall watchdog between real ranks, over torch's own collectives where a test says so
(``LIGHTNING_ZERO_SHM_DISABLE=1``: gloo's, the path of ranks on several hosts and the one NCCL takes).

- One pair of processes runs one run after another (:func:`test_runs_in_turn_are_each_watched_afresh`): a rank busy in
  Python, or computing in native code that holds its interpreter, is waited for; a rank holding its interpreter in
  native code, idle, is named once it gave no sign of life for ``stall_after``, never before; a verdict's release
  reaches a call in a ``cpu:gloo`` group (as offloading's mixed groups); a failure of the watchdog's own thread fails
  the run, loudly, on both ranks; ranks that run different code fail on both ranks with the error naming what each was
  doing, under Fabric in the middle of the sequence and at the end of the script under the Trainer. Each run after one
  that ended with a verdict is watched afresh.
- A peer killed once its last step is done ends the job within ``stall_after`` and seconds, with the watchdog's thread
  of the rank left waiting made to fail: the exit's wait ends by itself.
- A stopped peer is named within ``stall_after`` twice (its ask and its window), and the job's rank 0 ends the rank it
  started; a SIGTERM during a stall ends every rank.

Timing: the processes' start (importing Lightning, and transformers where GPT-2 runs) takes 15 to 30 s here and is not
measured.
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

import pytest

from tests.launch import REPO, start, without_rendezvous, write_payload

pytestmark = pytest.mark.slow  # every test here launches processes

NO_SHM = {"LIGHTNING_ZERO_SHM_DISABLE": "1"}
STALL_AFTER = 2.0
ASKED_WITHIN = STALL_AFTER + 2  # the wait a rank reports when it asked: the bound, and a tick on a loaded machine
STEP_ENDED = "the end of a forward of the whole module"
RUNS = ["busy_rank", "computing_rank", "held_interpreter", "mixed_group", "watchdog_fails", "fabric_branch"]
GATHERS_BLOCK = "the all-gather of unit `model.transformer.h.0` of Generating's parameters (waiting in it for"


def waited(message: str) -> list[int]:
    """The seconds each rank said it had waited in a collective, in the error's ``message``."""
    return [int(s) for s in re.findall(r"\(waiting (?:in it )?for (\d+) s\)", message)]


def run_to_the_end(procs: list[subprocess.Popen], timeout: float) -> list[int]:
    """Each rank's exit code, once all ended (killed, and the test failed, past ``timeout`` seconds)."""
    deadline = time.monotonic() + timeout
    try:
        for proc in procs:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    return [proc.returncode for proc in procs]


def verdict_line(rank: int, kind: str) -> str:
    """How the watchdog prints the verdict rank ``rank`` took (its error follows)."""
    return f"lightning_zero (rank {rank}): {kind}: "


def test_runs_in_turn_are_each_watched_afresh(tmp_path: Path) -> None:
    pytest.importorskip("transformers")  # the last run is GPT-2's
    write_payload(tmp_path, case="runs_in_turn", stall_after=STALL_AFTER)
    procs = start("tests.workers.stalls", [str(tmp_path)], 2, env=NO_SHM, logs=tmp_path)
    codes = run_to_the_end(procs, timeout=400)
    logs = [(tmp_path / f"rank{rank}.log").read_text() for rank in range(2)]
    assert codes == [1, 1], logs[0][-3000:] + logs[1][-3000:]
    seen = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    for rank in range(2):  # a rank whose run never ended by itself would have been ended, its later runs missing
        assert list(seen[rank]) == RUNS, logs[rank][-3000:]
    pids = [int((tmp_path / f"rank{rank}.pid").read_text()) for rank in range(2)]

    # rank 0 busy in Python for 1.5 `stall_after`: asked about, answers, and is waited for
    assert [s["busy_rank"]["error"] for s in seen] == [None, None]

    # rank 0 computing in native code that holds its interpreter for 2.5 `stall_after` at least: silent, but its main
    # thread uses the CPU, a sign of life: waited for
    assert [s["computing_rank"]["error"] for s in seen] == [None, None]
    assert float((tmp_path / "computed_for").read_text()) >= 2 * STALL_AFTER  # a round asked, and its window passed

    # rank 0 holding its interpreter in native code for 4 `stall_after`: rank 1 names it, not before `stall_after`
    # of silence after its ask (itself `stall_after` into its wait, which begins after rank 1's mark), and rank 0
    # takes the verdict once back
    held = [s["held_interpreter"] for s in seen]
    assert held[0]["error"] is not None and held[1]["error"] is not None, held
    waits_from = float((tmp_path / "waits_from").read_text())
    assert held[1]["at"] - waits_from >= 2 * STALL_AFTER, held[1]["at"] - waits_from
    named = (
        f"{verdict_line(1, 'PeerError')}lightning_zero's stall watchdog on rank 1 gave up on rank 0 (PID {pids[0]}):"
        " rank 1 has waited"
    )
    assert named in logs[1], logs[1][-4000:]
    assert "rank 0's process runs, but its interpreter ran no Python for those" in logs[1]
    silent = re.search(r"it gave no sign of life for the (\d+) s after rank 1 asked", logs[1])
    assert silent is not None and int(silent.group(1)) >= STALL_AFTER, logs[1][-3000:]
    assert f"{verdict_line(0, 'PeerError')}lightning_zero's stall watchdog on rank 1 gave up on this rank" in logs[0]

    # the ranks in different calls of torch's, rank 0 in a `cpu:gloo` group: both released, both fail at once
    mixed = [s["mixed_group"] for s in seen]
    assert mixed[0]["error"] is not None and mixed[1]["error"] is not None, mixed
    assert abs(mixed[0]["at"] - mixed[1]["at"]) < 5, mixed  # not after the released thread's 10 s of grace
    for rank, log in enumerate(logs):
        both = rf"{re.escape(verdict_line(rank, 'DivergedError'))}.*rank 0: .*torch's `all_reduce`.*rank 1: .*`recv`"
        assert re.search(both, log), log[-3000:]

    # rank 0's watchdog thread fails: named on its stderr, its next collective raises, rank 1 names the failure
    failed = [s["watchdog_fails"] for s in seen]
    assert failed[0]["error"] == "WatchdogError", failed
    assert "injected: the watchdog's look failed" in failed[0]["message"]
    assert "lightning_zero (rank 0): the stall watchdog stopped with RuntimeError: injected" in logs[0]
    assert "rank 0 failed while this rank waited for it, with WatchdogError: " in failed[1]["message"], failed

    # Fabric, a unit run on rank 0 only, then a barrier: both ranks fail naming what each was doing (rank 1's gathers
    # pair with rank 0's other ones until rank 0 waits for a gather rank 1 never starts, asked about within
    # `stall_after`; torch 2.8's own gloo collectives meet, labelled, before each gather, and fail at once)
    rank1 = re.compile(r"; rank 1: the (all-gather|reduce-scatter) of unit `blocks.\d` of Branching's")
    for rank, branch in enumerate(s["fabric_branch"] for s in seen):
        assert branch["error"] == "DivergedError", branch
        assert f"(seen on rank {rank}): rank 0: the all-gather of unit `blocks." in branch["message"]
        assert rank1.search(branch["message"]), branch["message"]
        assert all(seconds <= ASKED_WITHIN for seconds in waited(branch["message"])), branch["message"]

    # GPT-2's `generate(synced_gpus=False)` in validation, rank 0 generating fewer tokens: it finishes and waits at its
    # exit while rank 1 gathers the first block for its next token; both end by themselves, exit 1, with the error
    rank0 = f"rank 0: {STEP_ENDED} (the end of a step's forward, under the Trainer), then the end of its script"
    for rank, log in enumerate(logs):
        assert f"(seen on rank {rank}): {rank0}" in log, log[-3000:]
        assert f"rank 1: {GATHERS_BLOCK}" in log
        assert "HINT: a Hugging Face `generate()` that stops earlier on some ranks needs `synced_gpus=True`" in log


def test_a_peer_killed_after_its_last_step_ends_the_job_without_the_watchdogs_thread(tmp_path: Path) -> None:
    """Rank 1 kills itself (SIGKILL) once ``fit`` returned; rank 0's watchdog thread fails first (injected). Rank 0,
    waiting at its exit, names rank 1 gone within ``stall_after`` and a few seconds, and exits 1."""
    write_payload(tmp_path, case="killed_after_last_step", stall_after=STALL_AFTER)
    procs = start("tests.workers.stalls", [str(tmp_path)], 2, logs=tmp_path)
    codes = run_to_the_end(procs, timeout=120)
    ended = time.time()
    log = (tmp_path / "rank0.log").read_text()
    assert codes == [1, -signal.SIGKILL], log[-3000:]
    rank1 = int((tmp_path / "rank1.pid").read_text())
    assert "lightning_zero (rank 0): the stall watchdog stopped with RuntimeError: injected" in log
    waited_at_exit = re.search(rf"gave up on rank 1 \(PID {rank1}\): rank 0 has waited (\d+) s at its exit", log)
    assert waited_at_exit is not None and int(waited_at_exit.group(1)) >= STALL_AFTER, log[-3000:]
    assert "rank 1's process is gone: it ended without reaching its exit hook" in log
    took = ended - float((tmp_path / "killed_at").read_text())
    print(f"rank 0 ended {took:.1f} s after rank 1 was killed")
    assert took <= STALL_AFTER + 15


def test_a_stopped_rank_is_named_and_the_job_ends(tmp_path: Path) -> None:
    """Lightning's own launcher (``devices=2`` in a plain ``python``): rank 1 stops itself (SIGSTOP) mid-training, with
    the strategy's ``timeout`` at 20 s. Rank 0 names it stopped, then ends the rank it started (SIGKILL at once: it is
    stopped) rather than wait for it, and the job fails within a minute of the stop. (Once the ended rank is seen
    failed, Lightning's own observer of the ranks it started may kill the launching process before its last line:
    exit 1 or SIGKILL; either way rank 1 was ended by rank 0, and is gone.)"""
    write_payload(tmp_path, case="rank1_stops", stall_after=STALL_AFTER)
    job = subprocess.Popen(
        [sys.executable, "-m", "tests.workers.stalls", str(tmp_path)],
        cwd=REPO,
        env=without_rendezvous(WORLD_SIZE="2", PYTHONPATH=str(REPO)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _, stderr = job.communicate(timeout=150)
    finally:
        job.kill()
    assert job.returncode in (1, -signal.SIGKILL), stderr[-3000:]
    rank1 = int((tmp_path / "rank1.pid").read_text())
    assert f"stall watchdog on rank 0 gave up on rank 1 (PID {rank1}): rank 0 has waited" in stderr, stderr[-3000:]
    assert "rank 1's process is stopped (SIGSTOP, a debugger)" in stderr
    assert "rank 0: a reduce-scatter (waiting in it for" in stderr or "rank 0: an all-reduce" in stderr, stderr[-3000:]
    assert f"lightning_zero: rank 1 (PID {rank1}), started by this process, is stopped: sending it SIGKILL." in stderr
    deadline = time.monotonic() + 10  # rank 1's process, killed, is reaped by whoever adopted it
    while Path(f"/proc/{rank1}").exists() and _state(rank1) not in ("Z", "X") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not Path(f"/proc/{rank1}").exists() or _state(rank1) in ("Z", "X"), "rank 1 is still there"
    assert max(waited(stderr)) <= ASKED_WITHIN


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "X"


def test_sigterm_during_a_stall_ends_every_rank(tmp_path: Path) -> None:
    """Under stage 2 over shared memory, rank 0 waits for a message rank 1 never sends (torch's ``recv``) while rank 1
    went on to its next step: both blocked in collectives, with ``stall_after`` at 60 s. SIGTERM to
    rank 0, as ``timeout`` or a scheduler sends it: every rank ends within seconds, exit 1, each naming the signal, and
    nothing is left in ``/dev/shm``."""
    write_payload(tmp_path, case="rank0_waits_alone", stall_after=60.0)
    before = set(os.listdir("/dev/shm"))
    procs = start("tests.workers.stalls", [str(tmp_path)], 2, logs=tmp_path)
    try:
        wait_until_idle(procs)
        os.kill(procs[0].pid, signal.SIGTERM)
        sent = time.monotonic()
        for proc in procs:
            proc.wait(timeout=30)
        ended = time.monotonic() - sent
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    print(f"every rank ended {ended:.1f} s after the SIGTERM")
    logs = [(tmp_path / f"rank{rank}.log").read_text() for rank in range(2)]
    assert [proc.returncode for proc in procs] == [1, 1], logs[0][-3000:]
    for rank, log in enumerate(logs):
        assert f"lightning_zero on rank {rank} stopped: rank 0 received SIGTERM while blocked in a collective" in log
        assert "(rank 0: an all-gather, then torch's `recv` called at " in log
        # rank 1 at its next step: in Lightning's broadcast of the SIGTERM flag (Lightning 2.6), or past it
        assert re.search(r"; rank 1: (an all-gather, then torch's `broadcast`|a reduce-scatter \(waiting in it)", log)
    assert set(os.listdir("/dev/shm")) <= before


def wait_until_idle(procs: list[subprocess.Popen], quiet_for: int = 3) -> None:
    """Until every rank has used almost no CPU for ``quiet_for`` seconds in a row: all are blocked (the start, which
    imports Lightning and transformers, keeps them busy until then)."""
    deadline = time.monotonic() + 180
    last, quiet = [_cpu_ticks(p) for p in procs], 0
    while quiet < quiet_for:
        assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, "a rank ended or never stalled"
        time.sleep(1)
        now = [_cpu_ticks(p) for p in procs]
        quiet = quiet + 1 if all(n - b < 10 for n, b in zip(now, last, strict=True)) else 0
        last = now


def _cpu_ticks(proc: subprocess.Popen) -> int:
    fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime, stime

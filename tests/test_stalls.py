"""The stall watchdog over torch's own collectives (``LIGHTNING_ZERO_SHM_DISABLE=1``: gloo's, the path of ranks on
several hosts and the one NCCL takes): ranks that run different code fail on every rank with the error naming what
each was doing, within the strategy's ``stall_after``, under the Trainer and Fabric; a stopped peer is named within it
and the job's rank 0 ends the rank it started; a SIGTERM during a stall ends every rank.

Timing: a rank asks its peers once it has waited ``STALL_AFTER`` (3 s); the answers come within a tick (under a
second); every rank then leaves through its own teardown, which takes seconds on a loaded machine. The processes'
start (importing Lightning and transformers) takes 15 to 30 s here and is not measured.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import tests.launch
from tests.launch import REPO, LaunchError, launch, start, without_rendezvous, write_payload
from tests.scenarios import Divergence

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # every test here launches processes

NO_SHM = {"LIGHTNING_ZERO_SHM_DISABLE": "1"}
STALL_AFTER = 3.0
ASKED_WITHIN = STALL_AFTER + 2  # the wait a rank reports when it asked: the bound, and a tick on a loaded machine
STEP_ENDED = "the end of a forward of the whole module"
GATHERS_BLOCK = "the all-gather of unit `model.transformer.h.0` of Generating's parameters (waiting in it for"
HINT = "HINT: a Hugging Face `generate()` that stops earlier on some ranks needs `synced_gpus=True`"


def waited(message: str) -> list[int]:
    """The seconds each rank said it had waited in a collective, in the error's ``message``."""
    return [int(s) for s in re.findall(r"\(waiting (?:in it )?for (\d+) s\)", message)]


@pytest.fixture
def over_gloo(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks launched without shared memory; the launcher waits long enough for a rank leaving through Lightning's
    teardown after its peer's exit (its default grace kills it after 3 s)."""
    monkeypatch.setenv("LIGHTNING_ZERO_SHM_DISABLE", "1")
    monkeypatch.setattr(tests.launch, "GRACE", 20.0)


def failed_on_both_ranks(worker: str, out: Path, rank0: str) -> str:
    """Launch ``worker`` on 2 ranks; both must exit 1, each naming what rank 0 did (``rank0``) as seen on it: the
    launch's error message."""
    with pytest.raises(LaunchError) as failure:
        launch(worker, [str(out)], 2, timeout=300)
    message = str(failure.value)
    assert message.startswith("processes failed [(0, 1), (1, 1)]:"), message[-3000:]
    for rank in range(2):
        assert f"(seen on rank {rank}): {rank0}" in message, message[-3000:]
    return message


@pytest.mark.parametrize(
    ("phase", "rank0"),
    [
        (Divergence.VALIDATE, f"{STEP_ENDED} (the end of a step's forward, under the Trainer), then the end of its"),
    ],
    ids=lambda value: value.value if isinstance(value, Divergence) else "",
)
@pytest.mark.usefixtures("over_gloo")
def test_divergent_ranks_fail_within_stall_after_over_gloo(phase: Divergence, rank0: str, tmp_path: Path) -> None:
    """GPT-2's ``generate(synced_gpus=False)``, rank 0 generating fewer tokens: in validation rank 0 finishes and waits
    at its exit while rank 1 gathers the first block for its next token. Both ranks end by themselves, exit 1, with the
    same error naming both and the fix. (Between two training epochs, rank 0 waits in Lightning's broadcast instead:
    :func:`test_sigterm_during_a_stall_ends_every_rank` stops that stall, which ``stall_after`` would end alike.)"""
    write_payload(tmp_path, runs=[(phase, "zero3", False)], stall_after=STALL_AFTER)
    message = failed_on_both_ranks("tests.workers.divergent", tmp_path, f"rank 0: {rank0}")
    assert f"rank 1: {GATHERS_BLOCK}" in message
    assert HINT in message
    assert waited(message) and max(waited(message)) <= ASKED_WITHIN, waited(message)


@pytest.mark.usefixtures("over_gloo")
def test_a_unit_run_on_one_rank_fails_every_rank_under_fabric(tmp_path: Path) -> None:
    """A Fabric loop whose forward runs ``blocks.1`` on rank 0 only: over gloo, rank 1's gathers pair with rank 0's
    other ones (they are the same size) until rank 0 waits for a gather rank 1 never starts; both ranks name it."""
    write_payload(tmp_path, case="fabric_branch", stall_after=STALL_AFTER)
    message = failed_on_both_ranks("tests.workers.stalls", tmp_path, "rank 0: the all-gather of unit `blocks.")
    rank1 = "rank 1: the reduce-scatter of unit `blocks.0` of Branching's gradients, then the end of its script"
    assert rank1 in message
    assert max(waited(message)) <= ASKED_WITHIN


def test_a_stopped_rank_is_named_and_the_job_ends(tmp_path: Path) -> None:
    """Lightning's own launcher (``devices=2`` in a plain ``python``): rank 1 stops itself (SIGSTOP) mid-training,
    with the strategy's ``timeout`` at 20 s. Rank 0 names it within ``stall_after``, then ends the rank it started
    (SIGKILL at once: it is stopped) rather than wait for it, and the job fails within a minute of the stop."""
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
        _, stderr = job.communicate(timeout=240)
    finally:
        job.kill()
    # 1, or SIGKILL: once the ended rank is seen failed, Lightning's own observer of the ranks it started kills the
    # launching process, which may happen before the exit hook's last line
    assert job.returncode in (1, -signal.SIGKILL), stderr[-3000:]
    assert "stall watchdog on rank 0 gave up: rank 1 did not answer within 5 s" in stderr, stderr[-3000:]
    assert "rank 0: a reduce-scatter (waiting in it for" in stderr or "rank 0: an all-reduce" in stderr, stderr[-3000:]
    if job.returncode == 1:
        assert "lightning_zero: rank 1 (exit code -9), started by this process (rank 0), failed" in stderr
    assert max(waited(stderr)) <= ASKED_WITHIN


def test_sigterm_during_a_stall_ends_every_rank(tmp_path: Path) -> None:
    """Divergent ranks with the default ``stall_after`` (60 s) stay blocked (rank 0 in Lightning's broadcast, rank 1
    in a gather); SIGTERM to rank 0, as ``timeout`` or a scheduler sends it: every rank ends within seconds, exit 1,
    each naming the signal, and nothing is left in ``/dev/shm``."""
    write_payload(tmp_path, runs=[(Divergence.FIT, "zero3", False)])
    before = set(os.listdir("/dev/shm"))
    procs = start("tests.workers.divergent", [str(tmp_path)], 2, env=NO_SHM, logs=tmp_path)
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
        assert f"(rank 0: {STEP_ENDED} (the end of a step's forward, under the Trainer), then torch's `broadcast`" in (
            log
        )
        assert f"; rank 1: {GATHERS_BLOCK}" in log
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

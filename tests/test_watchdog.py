"""The stall watchdog's parts without processes: the ``stall_after`` option in both front ends, the verdict a round of
answers gives and the words of its errors, the rounds' keys on a real store (each run's verdicts its own), the signal
pipe restored, and a run's scope ending once. tests/test_stalls.py runs it between real ranks."""

from __future__ import annotations

import gc
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from lightning_zero import ZeroStrategy
from lightning_zero._config import ZeroConfig
from lightning_zero._core.run_scope import RunScope, RunState
from lightning_zero._creator import Creator
from lightning_zero._transport.activity import Place
from lightning_zero._transport.labels import DivergedError
from lightning_zero._transport.peers import PeerError
from lightning_zero._watchdog.rounds import EXIT, Rounds, run_scope
from lightning_zero._watchdog.signals import SignalPipe
from lightning_zero._watchdog.verdicts import Silence, error_of, silence_of, verdict_of
from lightning_zero.fabric import ZeroStrategy as FabricZeroStrategy

TICK = 1.0
GATHER = "the all-gather of unit `h.0` of Net's parameters"
STEP_ENDED = "the end of a forward of the whole module"
ASKED = {"rank": 1, "window": 10.0, "waited": 10.2, "still": 10.4}


def answer(place: Place, doing: str = GATHER, seconds: float = 60.0, call: str = "", signal: str = "") -> dict:
    return {"doing": doing, "place": place.value, "where": "train.py:12 (step)", "call": call, "seconds": seconds,
            "pid": 1, "host": "h", "signal": signal}  # fmt: skip


def verdict(
    answers: dict[int, dict], places: dict[int, Any] | None = None, failed: dict[int, str] | None = None
) -> Any:
    """The verdict rank 1 (the asker) reaches on 2 ranks."""
    return verdict_of(answers, 2, TICK, places or {}, failed or {}, ASKED)


def test_stall_after_is_an_option_of_both_front_ends() -> None:
    assert ZeroStrategy(stage=3, stall_after=5).config.stall_after == 5.0
    assert FabricZeroStrategy(stage=3, stall_after=7.5).config.stall_after == 7.5
    assert ZeroStrategy(stage=3).config.stall_after == 60.0


@pytest.mark.parametrize("value", [0, -1, float("inf"), float("nan"), True, "60"])
def test_a_bad_stall_after_is_refused(value: object) -> None:
    with pytest.raises(ValueError, match=r"`stall_after=.*` must be a finite, positive number of seconds\. HINT:"):
        ZeroConfig.from_options(stage=3, stall_after=value)


def test_ranks_waiting_in_different_collectives_diverged() -> None:
    found = verdict({0: answer(Place.LEFT, STEP_ENDED), 1: answer(Place.WAITING)})
    assert found is not None and found["kind"] == "diverged"
    error = error_of(found, 1)
    assert isinstance(error, DivergedError)
    assert f"(seen on rank 1): rank 0: {STEP_ENDED}, then the end of its script" in str(error)
    assert f"rank 1: {GATHER} (waiting in it for 60 s)" in str(error)
    assert "needs `synced_gpus=True`" in str(error)


def test_a_rank_in_torchs_collective_and_one_in_a_gather_diverged() -> None:
    found = verdict({0: answer(Place.TORCH, STEP_ENDED, call="broadcast"), 1: answer(Place.WAITING)})
    assert found is not None and found["kind"] == "diverged"
    assert "then torch's `broadcast` called at train.py:12 (step)" in str(error_of(found, 0))


@pytest.mark.parametrize(
    "other",
    [answer(Place.BUSY, seconds=60.0), answer(Place.WAITING, "the all-gather of unit `h.1`", seconds=0.2)],
    ids=["busy", "just-arrived"],
)
def test_a_busy_or_just_arrived_rank_is_waited_for(other: dict) -> None:
    """A peer computing (slower, not stuck), or one that entered its collective less than a tick ago (still moving
    through its collectives), gives no verdict: the round is asked again later."""
    assert verdict({0: answer(Place.WAITING), 1: other}) is None


def test_ranks_waiting_in_the_same_collective_give_no_verdict() -> None:
    assert verdict({0: answer(Place.WAITING), 1: answer(Place.WAITING)}) is None


def this_process() -> dict[str, Any]:
    me = Creator.this_process()
    assert me is not None
    return {"host": socket.gethostname(), "pid": os.getpid(), "creator": me.tag}


@pytest.mark.parametrize(
    ("where", "silence", "words"),
    [
        ({"host": socket.gethostname(), "pid": 1, "creator": None}, Silence.UNKNOWN, "nothing tells whether rank 0"),
        ({"host": "elsewhere", "pid": 7, "creator": "1-7-1"}, Silence.UNKNOWN, "nothing tells whether rank 0"),
        (None, Silence.UNKNOWN, "nothing tells whether rank 0"),
    ],
    ids=["no-creator", "other-host", "no-place"],
)
def test_what_cannot_be_told_of_a_silent_rank_is_said(where: Any, silence: Silence, words: str) -> None:
    assert silence_of(where) is silence
    found = verdict({1: answer(Place.WAITING, seconds=10.0)}, places={0: where})
    assert found is not None and found["kind"] == "peer"
    assert words in str(error_of(found, 1))


def place_of(child: subprocess.Popen) -> dict[str, Any]:
    namespace = this_process()["creator"].split("-")[0]
    start = Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    return {"host": socket.gethostname(), "pid": child.pid, "creator": f"{namespace}-{child.pid}-{start}"}


def test_a_running_rank_that_does_not_answer_held_its_interpreter_for_the_window() -> None:
    """Its process runs (a child of this one stands in for it, its main thread asleep, as one blocked in native code
    while it holds the GIL), but no answer came for the whole window: the words say that its interpreter ran no Python
    that long, how long rank 1 waited and where, and what to do."""
    child = subprocess.Popen(["sleep", "60"])
    try:
        time.sleep(0.2)  # it sleeps
        assert silence_of(place_of(child)) is Silence.HELD
        found = verdict({1: answer(Place.WAITING, seconds=10.0)}, places={0: place_of(child)})
    finally:
        child.kill()
        child.wait()
    assert found is not None and found["missing"] == {"0": {"silence": "held", "pid": child.pid}}
    error = error_of(found, 1, answer(Place.WAITING, seconds=21.0))
    assert isinstance(error, PeerError)
    message = str(error)
    assert f"gave up on rank 0 (PID {child.pid}): rank 1 has waited 21 s in {GATHER}, and it gave no sign" in message
    assert "gave no sign of life for the 10 s after rank 1 asked where every rank was" in message
    assert "its interpreter ran no Python for those 10 s: native code holds it" in message
    assert f"HINT: `py-spy dump --native --pid {child.pid}` shows where" in message
    assert "`stall_after` above it (now 10 s)" in message
    assert "did not arrive within" not in message and "process group's timeout" not in message


def test_a_stopped_or_gone_rank_is_named_as_such() -> None:
    namespace, pid, _ = this_process()["creator"].split("-")
    gone = {**this_process(), "creator": f"{namespace}-{pid}-1"}  # another start time: the PID was reused
    assert silence_of(gone) is Silence.EXITED
    found = verdict({1: answer(Place.LEFT, STEP_ENDED, seconds=10.0)}, places={0: gone})
    assert found is not None
    message = str(error_of(found, 1))
    assert "rank 1 has waited 10 s at its exit" in message
    assert "rank 0's process is gone: it ended without reaching its exit hook (killed: SIGKILL" in message


def test_a_silent_rank_computing_is_waited_for_and_one_idle_is_not() -> None:
    """Two silent ranks' processes: one whose main thread computes (as native code that holds the GIL while it
    computes), one whose main thread sleeps (as one blocked, or deadlocked, holding it)."""
    computing = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    idle = subprocess.Popen(["sleep", "60"])
    try:
        time.sleep(0.5)  # both started
        assert silence_of(place_of(computing)) is Silence.COMPUTING
        assert silence_of(place_of(idle)) is Silence.HELD
        assert verdict({1: answer(Place.WAITING)}, places={0: place_of(computing)}) is None
        assert verdict({1: answer(Place.WAITING)}, places={0: place_of(idle)}) is not None
    finally:
        for child in (computing, idle):
            child.kill()
            child.wait()


def test_a_stopped_rank_is_named_stopped() -> None:
    child = subprocess.Popen(["sleep", "60"])
    try:
        child.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
            assert time.monotonic() < deadline, "the child never stopped"
            time.sleep(0.01)
        where = place_of(child)
        assert silence_of(where) is Silence.STOPPED
        found = verdict({1: answer(Place.WAITING, seconds=10.0)}, places={0: where})
        assert found is not None
        assert "rank 0's process is stopped (SIGSTOP, a debugger). " in str(error_of(found, 1))
        assert f"HINT: continue it (`kill -CONT {child.pid}`)" in str(error_of(found, 1))
    finally:
        child.kill()
        child.wait()


def test_a_failed_rank_is_named_with_its_error() -> None:
    found = verdict({1: answer(Place.WAITING)}, failed={0: "MemoryError: out of memory"})
    assert found is not None
    assert "rank 0 failed while this rank waited for it, with MemoryError: out of memory" in str(error_of(found, 1))


def test_a_signalled_rank_stops_every_rank() -> None:
    found = verdict({0: answer(Place.TORCH, STEP_ENDED, call="broadcast", signal="SIGTERM"), 1: answer(Place.WAITING)})
    assert found is not None
    assert "rank 0 received SIGTERM while blocked in a collective" in str(error_of(found, 1))


@pytest.mark.usefixtures("one_rank")
def test_each_scope_has_its_own_verdict_and_rounds_count_on() -> None:
    """On one store (a second ``fit`` in the same process group): run 2 does not see run 1's verdict, nor its
    rounds' answers; the exit's verdict is its own too; rounds are numbered for the whole job."""
    store = dist.distributed_c10d._get_default_store()
    me, peer = Rounds(store, 0, 2), Rounds(store, 1, 2)
    first = me.ask()
    me.answer(first, answer(Place.WAITING))
    peer.answer(first, answer(Place.WAITING))
    assert me.answered(first) == 2 and set(me.answers(first)) == {0, 1}
    written = me.decide(run_scope(1), {"kind": "diverged", "answers": {}, "asked": ASKED})
    assert peer.verdict(run_scope(1)) == written
    assert peer.verdict(run_scope(2)) is None and peer.verdict(EXIT) is None
    assert me.latest() == first + 1  # the verdict's writer counts on, so that every rank looks
    second = peer.ask()
    assert second == first + 2 and me.answers(second) == {} and me.answered(second) == 0
    # the first verdict written in a scope is its verdict
    assert me.decide(run_scope(1), {"kind": "peer"}) == written


def test_the_signal_pipe_hears_sigterm_and_is_restored() -> None:
    received: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    try:
        pipe = SignalPipe.install()
        assert pipe is not None
        signal.raise_signal(signal.SIGTERM)
        assert pipe.received(1.0) == signal.SIGTERM
        assert received == [signal.SIGTERM]  # its own handler ran too
        read, write = pipe._read, pipe._write
        assert pipe.close()
        assert signal.set_wakeup_fd(-1) == -1  # nothing left installed
        for fd in (read, write):
            with pytest.raises(OSError):
                os.fstat(fd)
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_the_signal_pipe_works_above_descriptor_1023() -> None:
    """A process with many files open (data loaders, checkpoints) gets a pipe above ``select``'s limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1100:
        if hard != resource.RLIM_INFINITY and hard < 1100:
            pytest.skip(f"this process may open {hard} files at most, not enough to reach descriptor 1024")
        resource.setrlimit(resource.RLIMIT_NOFILE, (1100, hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1030)]
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        pipe = SignalPipe.install()
        assert pipe is not None and pipe._read > 1023
        signal.raise_signal(signal.SIGTERM)
        assert pipe.received(1.0) == signal.SIGTERM
        assert pipe.close()
    finally:
        signal.signal(signal.SIGTERM, previous)
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_run_ends_once_undoing_the_last_first_and_skipping_what_is_gone() -> None:
    done: list[str] = []

    class Mode:
        def teardown(self) -> None:
            done.append("teardown")

    kept, dropped = Mode(), Mode()
    run = RunScope(3)
    run.on_end(lambda: done.append("first"))
    run.on_end(kept.teardown, weakly=True)
    run.on_end(dropped.teardown, weakly=True)
    del dropped
    gc.collect()
    run.end()
    run.end()
    assert run.state is RunState.ENDED and done == ["teardown", "first"]


def test_a_run_ends_once_the_last_module_set_up_in_it_is_gone() -> None:
    """Fabric's end of a run when its user drops the modules (and the Fabric)."""
    class Module:
        pass

    done: list[str] = []
    run = RunScope(4)
    run.on_end(lambda: done.append("ended"))
    first, second = Module(), Module()
    run.anchor(first)
    run.anchor(second)
    del first
    gc.collect()
    assert run.state is RunState.OPEN
    del second
    gc.collect()
    assert run.state is RunState.ENDED and done == ["ended"]


@pytest.mark.usefixtures("one_rank")
@pytest.mark.parametrize("stall_after", [0.5, 1.5])
def test_a_round_waits_for_answers_as_long_as_stall_after(stall_after: float) -> None:
    """The asker of a round (rank 0 of 2, on a real store) whose peer never answers waits ``stall_after`` for it, no
    less (a rank busy that long is not stuck) and not a fixed window whatever ``stall_after`` says."""
    from lightning_zero._watchdog.watchdog import Watch, Watcher

    watcher = Watcher(dist.group.WORLD, dist.distributed_c10d._get_default_store(), stall_after)
    watcher.size, watcher.rounds = 2, Rounds(watcher.rounds.store, 0, 2)  # rank 1 never answers
    watch = Watch(run_scope(1), stall_after, (run_scope(1),))
    started = time.monotonic()
    watcher.ask(watch, still=stall_after)
    assert stall_after <= time.monotonic() - started < stall_after + 1.0

"""Starts N CPU processes the way torchrun would, so that every ``Trainer(devices=N)`` or ``Fabric(devices=N)`` in them
joins one gloo group, and stops all of them as soon as one fails.

A rank that dies leaves its peers blocked in the next collective until gloo's own timeout (30 minutes), so the
launcher never waits on one rank at a time: it polls all of them, and once one has failed the others get
:data:`GRACE` seconds to end by themselves (ranks that hit the same error together are then all reported with their
own exit codes) before they are killed, and the error shows every rank's output. Output goes to files, not pipes,
so a rank that writes a lot never blocks on a full pipe.

What a launch runs travels as a pickled payload in its output directory (:func:`write_payload`,
:func:`read_payload`), never as strings in ``sys.argv``. They live here, with nothing beyond the standard library, so
that a worker which must start at once (``tests/workers/launch_probe.py``) can read its payload without importing
torch or Lightning.
"""

from __future__ import annotations

import enum
import os
import pickle
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from tests import forkserver

Rank = subprocess.Popen[bytes] | forkserver.ForkedRank  # a rank's process, started or forked

REPO = Path(__file__).resolve().parents[1]
GRACE = 3.0  # seconds the other ranks get to end by themselves after the first failure
POLL = 0.05  # seconds between looks at the ranks
TAIL = 6000  # characters of each rank's output an error shows
PAYLOAD = "payload.pkl"  # in the output directory: what the workers run
# Lightning's rendezvous variables: a run inside the pytest process sets them, and a process started later would take
# them for an external launcher's (and its port, perhaps still listening, for its own)
RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK")


def without_rendezvous(**extra: str) -> dict[str, str]:
    """This process's environment without :data:`RENDEZVOUS`, plus ``extra``: for a process that must set up its own,
    as on a fresh machine."""
    return {**{k: v for k, v in os.environ.items() if k not in RENDEZVOUS}, **extra}


# the line gloo prints as a process group connects (torch 2.8: "[Gloo] Rank 0 is connected to 1 peer ranks. Expected
# number of connected peer ranks is : 1"); later releases print none
_GLOO_CONNECTED = re.compile(r"^\[Gloo\] Rank \d+ is connected to \d+ peer ranks\..*\n?", re.MULTILINE)


def without_gloo_connections(output: str) -> str:
    """A process's ``output`` without the lines gloo prints as its process groups connect."""
    return _GLOO_CONNECTED.sub("", output)


class LaunchError(RuntimeError):
    """A rank exited with a non-zero code; the message names each rank's ending and shows its output's tail."""


class Ending(enum.Enum):
    """How one rank's process ended."""

    EXITED = "exited"  # by itself, with its own exit code (0 or not)
    KILLED = "killed"  # by the launcher: after another rank failed, or at the timeout


@dataclass(frozen=True)
class RankResult:
    rank: int
    ending: Ending
    returncode: int
    output: str

    @property
    def failed(self) -> bool:
        return self.ending is Ending.EXITED and self.returncode != 0

    def describe(self) -> str:
        how = f"exit code {self.returncode}" if self.ending is Ending.EXITED else "killed by the launcher"
        return f"--- rank {self.rank} ({how}) ---\n{self.output[-TAIL:]}"


class Probe(enum.Enum):
    """What ``tests/workers/launch_probe.py`` does, for tests/test_launch.py."""

    RANK1_FAILS = "rank1_fails"  # rank 0 waits in the rendezvous, which rank 1 never reaches: it raises
    ALL_BLOCK = "all_block"  # every rank sleeps far past any test's timeout
    SUCCEED = "succeed"  # every rank prints a line and exits 0


def write_payload(out_dir: Path, **entries: Any) -> None:
    """What the workers started on ``out_dir`` read with :func:`read_payload`, pickled."""
    (out_dir / PAYLOAD).write_bytes(pickle.dumps(entries))


def read_payload(out_dir: Path) -> dict[str, Any]:
    return pickle.loads((out_dir / PAYLOAD).read_bytes())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(module: str, args: list[str], world_size: int, timeout: float = 600, nodes: int = 1) -> list[str]:
    """Run ``python -m module *args`` in ``world_size`` processes and return each rank's output. With ``nodes``, the
    processes are told they form that many nodes of equal size (simulated on this host).

    Raises :class:`LaunchError` (a ``RuntimeError``) as soon as a rank fails, the others killed after :data:`GRACE`
    seconds, and ``TimeoutError`` when the ranks run past ``timeout`` seconds in all; both show every rank's output.
    """
    port = free_port()
    with tempfile.TemporaryDirectory() as logs:
        paths = [Path(logs) / f"rank{rank}.log" for rank in range(world_size)]
        procs: list[Rank] = []
        try:
            for rank, path in enumerate(paths):
                procs.append(_fork_or_start(module, args, rank, world_size, nodes, port, path))
            timed_out = _wait_for_first_failure(procs, timeout)
        finally:
            killed = {rank for rank, proc in enumerate(procs) if _kill(proc)}
        results = [
            RankResult(rank, Ending.KILLED if rank in killed else Ending.EXITED, proc.wait(), _read(path))
            for rank, (proc, path) in enumerate(zip(procs, paths, strict=True))
        ]
    outputs = "\n".join(r.describe() for r in results)
    if timed_out:
        raise TimeoutError(f"ranks {sorted(killed)} were still running after {timeout} s, and were killed:\n{outputs}")
    failed = [(r.rank, r.returncode) for r in results if r.failed]
    if failed:
        stopped = f"; ranks {sorted(killed)} were killed after it" if killed else ""
        raise LaunchError(f"processes failed {failed}{stopped}:\n{outputs}")
    return [r.output for r in results]


def start(
    module: str, args: list[str], world_size: int, env: dict[str, str] | None = None, *, logs: Path, nodes: int = 1
) -> list[subprocess.Popen[bytes]]:
    """Start ``python -m module *args`` in ``world_size`` processes joined as one group and leave them to the caller
    (to stop, kill or wait for), each one's output in ``logs/rank<r>.log``; ``env`` adds to their environment."""
    port = free_port()
    procs = []
    for rank in range(world_size):
        with (logs / f"rank{rank}.log").open("wb") as log:  # the child holds its own copy
            procs.append(_start(module, args, _rank_env(rank, world_size, nodes, port, env), log))
    return procs


def _rank_env(
    rank: int, world_size: int, nodes: int, port: int, extra_env: dict[str, str] | None = None
) -> dict[str, str]:
    per_node = world_size // nodes
    env = dict(
        os.environ,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(world_size),
        RANK=str(rank),
        LOCAL_RANK=str(rank % per_node),
        NODE_RANK=str(rank // per_node),
        OMP_NUM_THREADS="1",
        PYTHONPATH=str(REPO),
        PYTHONUNBUFFERED="1",  # what a killed rank printed is in its file, not lost in its buffer
    )
    env.update(extra_env or {})
    return env


def _start(module: str, args: list[str], env: dict[str, str], log: IO[bytes]) -> subprocess.Popen[bytes]:
    # A session of its own: killing the rank's process group also ends what it started (data loader workers).
    return subprocess.Popen(
        [sys.executable, "-m", module, *args], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip


def _fork_or_start(module: str, args: list[str], rank: int, world_size: int, nodes: int, port: int, log: Path) -> Rank:
    """The rank forked by a fork server (:mod:`tests.forkserver`) where one can give what a fresh process would be;
    started afresh otherwise."""
    env = _rank_env(rank, world_size, nodes, port)
    server = forkserver.server_for(env, REPO)
    if server is not None:
        return server.fork(module, args, env, REPO, log)
    with log.open("wb") as file:  # the child holds its own copy
        return _start(module, args, env, file)


def _wait_for_first_failure(procs: list[Rank], timeout: float) -> bool:
    """Wait until every rank has ended, or a rank failed :data:`GRACE` seconds ago; return whether ``timeout`` ran
    out first."""
    deadline = time.monotonic() + timeout
    failed_at: float | None = None
    while True:
        codes = [proc.poll() for proc in procs]
        if all(code is not None for code in codes):
            return False
        now = time.monotonic()
        if failed_at is None and any(code not in (None, 0) for code in codes):
            failed_at = now
        if failed_at is not None and now - failed_at >= GRACE:
            return False
        if now >= deadline:
            return True
        time.sleep(POLL)


def _kill(proc: Rank) -> bool:
    """Kill ``proc``'s process group if it is still running; return whether it was."""
    if proc.poll() is not None:
        return False
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # it ended between the two looks
        proc.wait()
        return False
    proc.wait()
    return True


def _read(log: Path) -> str:
    return log.read_bytes().decode(errors="replace") if log.exists() else ""

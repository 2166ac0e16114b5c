"""Ranks forked from a process that has imported torch and Lightning once, so that a launch does not pay for their
import in every rank (about 8 s of CPU a process here, most of a small test's launch on a 2-core machine).

A :class:`ForkServer` is a process of its own (``python -m tests.forkserver``) started with the ranks' environment
less their rendezvous variables. It imports :data:`PRELOAD`, then reads requests on its standard input, a JSON line
each: it forks, and the child becomes the rank as ``python -m module *args`` would make it: a session of its own,
the request's environment and working directory, its output in the request's log file, the module run as
``__main__``, and the interpreter's own exit at the end (``atexit`` handlers included). The server reaps its children
and writes each one's exit code beside its log (:class:`ForkedRank` reads it; negative: killed by that signal, as
``subprocess`` says).

Only what a fresh process would import the same way is preloaded: torch and Lightning read no variable a test sets
for its ranks at import, and this package (which does: ``LIGHTNING_ZERO_SHM_DISABLE``) is imported by each rank.
:func:`server_for` gives a launch a server only where a forked rank is the process a fresh one would be: the same
environment (less the rendezvous and pytest's per-test variable) and the same memory group and namespaces as the
launching process (a test that joins a memory group, say, gets fresh processes). ``LIGHTNING_ZERO_TESTS_FORK=0``
turns forking off. Standard library only, like :mod:`tests.launch`.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

PRELOAD = ("torch", "lightning.pytorch")
SWITCH = "LIGHTNING_ZERO_TESTS_FORK"
# what differs between a launch's ranks and between launches, read at run time, not at import
_PER_LAUNCH = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK",
               "PYTEST_CURRENT_TEST")  # fmt: skip
_KEPT = 2  # servers alive at once (each holds torch and Lightning: about 0.4 GiB)
_POLL = 0.05  # seconds between the server's looks for requests and ended children


def _context() -> tuple[str, ...]:
    """What a forked child inherits that the request cannot set: its groups and namespaces."""
    namespaces = tuple(os.readlink(f"/proc/self/ns/{kind}") for kind in ("mnt", "net", "pid", "ipc"))
    return (Path("/proc/self/cgroup").read_text(), *namespaces)


class ForkedRank:
    """A rank forked by a :class:`ForkServer`: what ``launch`` asks of a ``subprocess.Popen``."""

    def __init__(self, pid: int, status: Path, server: subprocess.Popen[bytes]) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._status = status
        self._server = server

    def poll(self) -> int | None:
        if self.returncode is None and self._status.exists():
            self.returncode = int(self._status.read_text())
        elif self.returncode is None and self._server.poll() is not None and not _exists(self.pid):
            self.returncode = -signal.SIGKILL  # its server died first (killed with it?): nobody wrote its code
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0.0)
            time.sleep(_POLL / 5)
        assert self.returncode is not None
        return self.returncode


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


class ForkServer:
    """One server process (see the module's docstring) and the pipe to it."""

    def __init__(self, env: dict[str, str], cwd: Path) -> None:
        self.context = _context()
        self._process = subprocess.Popen(
            [sys.executable, "-m", "tests.forkserver"], cwd=cwd, env=env, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip

    def fork(self, module: str, args: list[str], env: dict[str, str], cwd: Path, log: Path) -> ForkedRank:
        status = log.with_name(log.name + ".exit")
        request = {"module": module, "args": args, "env": env, "cwd": str(cwd), "log": str(log), "status": str(status)}
        assert self._process.stdin is not None and self._process.stdout is not None
        self._process.stdin.write(json.dumps(request).encode() + b"\n")
        self._process.stdin.flush()
        reply = self._process.stdout.readline()
        if not reply:
            raise RuntimeError(f"the fork server {self._process.pid} ended (exit code {self._process.poll()})")
        return ForkedRank(int(reply), status, self._process)

    def close(self) -> None:
        if self._process.poll() is None:
            assert self._process.stdin is not None
            self._process.stdin.close()  # the server ends at the end of its input, its running children left alone
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()


_servers: dict[tuple[tuple[str, str], ...], ForkServer] = {}
_off = 0  # how many `off()` blocks are open


@contextmanager
def off() -> Iterator[None]:
    """Fresh processes while open: in a memory group, say, which would count a server started there and could not
    be removed while it lives."""
    global _off
    _off += 1
    try:
        yield
    finally:
        _off -= 1


def server_for(env: dict[str, str], cwd: Path) -> ForkServer | None:
    """A server whose forked children would be what fresh processes with ``env`` (less :data:`_PER_LAUNCH`) are, or
    ``None`` where forking is off or cannot give that (another memory group or namespace than its own)."""
    if _off or os.environ.get(SWITCH, "1") == "0":
        return None
    key = tuple(sorted((k, v) for k, v in env.items() if k not in _PER_LAUNCH))
    server = _servers.get(key)
    if server is not None and server.context != _context():
        return None  # this process has joined a memory group (say) since the server started
    if server is None:
        if len(_servers) >= _KEPT:
            _servers.pop(next(iter(_servers))).close()
        server = _servers[key] = ForkServer(dict(key), cwd)
    return server


@atexit.register
def _close_all() -> None:
    while _servers:
        _servers.popitem()[1].close()


# --- the server process ---


def _become_rank(request: dict[str, Any], reply: int) -> None:
    """In the forked child: make this process the rank the request describes, then run its module as ``__main__``."""
    import runpy
    import types

    os.setsid()
    os.close(reply)
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(null)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    sys.argv = [request["module"], *request["args"]]
    sys.modules["__main__"] = types.ModuleType("__main__")  # the server's own globals are not the rank's
    runpy._run_module_as_main(request["module"], alter_argv=True)  # what `python -m` runs


def _serve() -> None:
    reply = os.dup(1)  # the pids go there; what the imports or a child might print, nowhere
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.close(null)
    for name in PRELOAD:
        __import__(name)
    statuses: dict[int, str] = {}
    pending = b""
    while True:
        ready, _, _ = select.select([0], [], [], _POLL)
        if ready:
            read = os.read(0, 1 << 16)
            if not read:
                return
            pending += read
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            pid = os.fork()
            if pid == 0:
                _become_rank(request, reply)
                sys.exit(0)  # through the interpreter's own exit, as the end of `python -m module` does
            statuses[pid] = request["status"]
            os.write(reply, f"{pid}\n".encode())
        _reap(statuses)


def _reap(statuses: dict[int, str]) -> None:
    while statuses:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        path = statuses.pop(pid, None)
        if path is not None:
            written = f"{path}.tmp"
            Path(written).write_text(str(os.waitstatus_to_exitcode(status)))
            os.replace(written, path)


if __name__ == "__main__":
    _serve()

"""What the benchmark scripts share to start their workers the way torchrun would."""

from __future__ import annotations

import socket
import subprocess
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_all(procs: list[subprocess.Popen]) -> list[int]:
    """Wait for every process; once one fails, kill the rest, which would otherwise hang in a collective."""
    while any(p.poll() is None for p in procs):
        if any(p.returncode for p in procs):
            for p in procs:
                if p.poll() is None:
                    p.kill()
        time.sleep(0.2)
    return [p.returncode for p in procs]

"""Starts N CPU processes the way torchrun would, so that every `Trainer(devices=N)` in them joins one gloo group."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(
    module: str, args: list[str], world_size: int, env: dict[str, str] | None = None, logs: Path | None = None
) -> list[subprocess.Popen]:
    """Start ``python -m module *args`` in ``world_size`` processes joined as one group. Each one's stdout and stderr
    go, merged, to a pipe, or to ``logs/rank<r>.log`` (a process the test stops or leaves running then never blocks
    on a full pipe)."""
    port = free_port()
    procs = []
    for rank in range(world_size):
        environment = dict(
            os.environ,
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            WORLD_SIZE=str(world_size),
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            NODE_RANK="0",
            OMP_NUM_THREADS="1",
            PYTHONPATH=str(REPO),
        )
        environment.update(env or {})
        output = subprocess.PIPE if logs is None else (logs / f"rank{rank}.log").open("w")
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", module, *args], cwd=REPO, env=environment,
                stdout=output, stderr=subprocess.STDOUT, text=True,
            )
        )
        if logs is not None:
            output.close()  # the child holds its own copy
    return procs


def launch(module: str, args: list[str], world_size: int, timeout: float = 600) -> None:
    """Run ``python -m module *args`` in ``world_size`` processes; raise with their output if any fails."""
    procs = start(module, args, world_size)
    outputs = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        outputs.append(out)
    failed = [(rank, p.returncode) for rank, p in enumerate(procs) if p.returncode != 0]
    if failed:
        log = "\n".join(f"--- rank {r} ---\n{o[-6000:]}" for r, o in enumerate(outputs))
        raise RuntimeError(f"processes failed {failed}:\n{log}")


def run_scenarios(scenarios: list[dict[str, Any]], world_size: int, tmp_path: Path) -> list[dict[Any, Any]]:
    """Train ``scenarios`` in ``world_size`` processes; return each rank's results."""
    for scenario in scenarios:
        scenario["world_size"] = world_size
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(scenarios))
    launch("tests.workers.parity", [str(spec), str(tmp_path)], world_size)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world_size)]

"""Runs inside each of 2 processes (started by tests/launch.py) for tests/test_checkpoints.py's exit after a failed
``fabric.load``; ``argv``: the directory, whose payload names the :class:`~tests.scenarios.FailedLoadPhase` to run.

At exit, after lightning_zero's exit hook, it prints whether the module of the failed load is still alive (the
traceback of an uncaught exception keeps its frames to the end of interpreter finalization unless that hook lets go),
and which of gloo's threads are still running (a process group's threads, joined only when the group is destroyed,
abort the process if they outlive the hook into interpreter finalization).
"""

from __future__ import annotations

import atexit
import gc
import os
import weakref

FAILED: list[weakref.ref] = []


def gloo_threads() -> list[str]:
    """The names of this process's threads that gloo started (Linux names them in ``/proc``)."""
    names = [_thread_name(task) for task in os.listdir("/proc/self/task")]
    return sorted(name for name in names if "gloo" in name)


def _thread_name(task: str) -> str:
    try:
        with open(f"/proc/self/task/{task}/comm") as comm:
            return comm.read().strip()
    except FileNotFoundError:  # the thread ended since the listing
        return ""


@atexit.register  # registered before lightning_zero's hook is, so it runs after it
def _report() -> None:
    gc.collect()
    print(f"the failed load's module is alive after the exit hook: {[ref() is not None for ref in FAILED]}", flush=True)
    print(f"gloo threads after the exit hook: {gloo_threads()}", flush=True)


import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from lightning.fabric import Fabric  # noqa: E402
from torch import nn  # noqa: E402

import lightning_zero  # noqa: E402, F401
from tests.scenarios import FailedLoadPhase, read_payload  # noqa: E402


def set_up(layers: int) -> tuple[Fabric, nn.Module, torch.optim.Optimizer]:
    fabric = Fabric(accelerator="cpu", devices=2, strategy="zero2")
    fabric.launch()  # the processes exist already: this joins the process group
    torch.manual_seed(0)
    module = nn.Sequential(*[nn.Linear(8, 8) for _ in range(layers)])
    model, optimizer = fabric.setup(module, torch.optim.Adam(module.parameters()))
    return fabric, model, optimizer


def load_into_a_larger_module(path: Path) -> None:
    fabric, model, optimizer = set_up(3)
    FAILED.append(weakref.ref(model))
    fabric.load(path, {"model": model, "optimizer": optimizer})  # raises: the checkpoint lacks layer 2


def main() -> None:
    out = Path(sys.argv[1])
    match read_payload(out)["phase"]:
        case FailedLoadPhase.SAVE:
            fabric, model, optimizer = set_up(2)
            fabric.save(out / "checkpoint", {"model": model, "optimizer": optimizer})
        case FailedLoadPhase.LOAD:
            load_into_a_larger_module(out / "checkpoint")


if __name__ == "__main__":
    main()

"""Runs inside each of 2 processes (started by tests/test_stalls.py): stalls under the ZeRO strategies, which the stall
watchdog must end on every rank within the strategy's ``stall_after``, or wait for.

``python -m tests.workers.stalls OUT``, the payload in ``OUT`` holding ``case`` and ``stall_after``:

- ``"runs_in_turn"``: one run after another in the same processes, each recording what it saw in ``OUT/rank<r>.json``
  (:data:`PHASES`; a process group of its own after each one that ends with a verdict, whose release closed the
  connections, as a user who caught the error would make one), then GPT-2 generating fewer tokens on rank 0 in
  validation, which rank 0 finishes to wait at its exit while rank 1 gathers for its next token: both end with the
  verdict;
- ``"killed_after_last_step"``: a Trainer under stage 2 whose rank 1 kills itself (SIGKILL) once ``fit`` returned;
  rank 0's watchdog thread is made to fail first, so that its exit's wait has to end by itself;
- ``"rank0_waits_alone"``: a Trainer under stage 2 whose rank 0 waits, at its second step, for a message rank 1 never
  sends, while rank 1 goes on: both blocked;
- ``"rank1_stops"``: a Trainer under stage 2 whose rank 1 stops itself (SIGSTOP) at its third step;
- ``"nccl_rank1_stops"``: the same under stage 3 on 2 GPUs (NCCL), rank 0 meeting the others in a barrier after each
  step (NCCL's collectives do not block the host; its barrier does).

Started without a rank in its environment, it is the job Lightning's launcher makes of ``devices=2``: rank 0 starts
rank 1. Each rank writes its PID to ``OUT/rank<r>.pid`` first.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import re
import signal
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric import Fabric
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero import ZeroStrategy
from lightning_zero._transport.activity import WatchdogError
from lightning_zero._transport.labels import DivergedError
from lightning_zero._transport.peers import PeerError
from lightning_zero._watchdog import watchdog
from lightning_zero.fabric import ZeroStrategy as FabricZeroStrategy
from tests.launch import read_payload
from tests.scenarios import Divergence, cpu_trainer, new_process_group

STOPS_AT = 2  # the step at which rank 1 stops itself
TIMEOUT = timedelta(seconds=120)  # the process group's: a stall the watchdog misses ends the test in minutes, not 30


def rank() -> int:
    """This process's rank (Lightning's launcher gives the ranks it starts their local rank alone)."""
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))


class Steps(LightningModule):
    """A small regression; at the end of its second step rank 0 runs ``on_rank0`` and rank 1 ``on_rank1``."""

    def __init__(
        self, on_rank0: Callable[[], None] = lambda: None, on_rank1: Callable[[], None] = lambda: None
    ) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 8)
        self.on_rank0 = on_rank0
        self.on_rank1 = on_rank1

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.global_rank == 1 and self.global_step == STOPS_AT and os.environ.get("STOP_RANK1"):
            os.kill(os.getpid(), signal.SIGSTOP)
        return self.layer(batch[0]).pow(2).mean()

    def on_train_batch_end(self, *args: Any) -> None:
        if self.global_step == 2:
            (self.on_rank0 if self.global_rank == 0 else self.on_rank1)()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(stage: int, stall_after: float, module: Steps, steps: int = 4) -> None:
    strategy = ZeroStrategy(stage=stage, stall_after=stall_after, timeout=TIMEOUT)
    data = DataLoader(TensorDataset(torch.randn(32, 8, generator=torch.Generator().manual_seed(0))), batch_size=2)
    cpu_trainer(strategy, max_steps=steps).fit(module, data)


def outcome(run: Callable[[], None]) -> dict[str, Any]:
    """What ``run()`` ended with on this rank (the verdict, or the error of torch's collective it released), and when
    (``time.time()``)."""
    try:
        run()
    except (DivergedError, PeerError, WatchdogError, RuntimeError) as error:
        return {"error": type(error).__name__, "message": str(error), "at": time.time()}
    return {"error": None, "at": time.time()}


def fail_the_watchdog() -> None:
    """The watchdog's thread raises at its next look (a fault of its own, injected) and ends; later watchers look as
    they should."""
    looks = watchdog.Watcher._look

    def broken(self: watchdog.Watcher, signum: int | None) -> None:
        raise RuntimeError("injected: the watchdog's look failed")

    watchdog.Watcher._look = broken  # type: ignore[method-assign]
    deadline = time.monotonic() + 10
    while watchdog._WATCHER is not None and watchdog._WATCHER.alive and time.monotonic() < deadline:
        time.sleep(0.05)
    watchdog.Watcher._look = looks  # type: ignore[method-assign]


# --- the runs of "runs_in_turn", in order -----------------------------------------------------------------------------


def busy_rank(out: Path, stall_after: float) -> dict[str, Any]:
    """Rank 0 busy in Python (sleeping) for 1.5 ``stall_after`` at its second step, rank 1 waiting for it: asked
    about, waited for, the run finishes."""
    return outcome(lambda: fit(2, stall_after, Steps(lambda: time.sleep(1.5 * stall_after))))


def compute_holding_the_interpreter(seconds: float) -> float:
    """Match a regular expression that backtracks for ``seconds`` at least, in one call (the engine holds the GIL
    throughout, and computes), each ``a`` doubling it: how long that call took."""
    pattern = re.compile(r"(a+)+$")
    began = time.perf_counter()
    pattern.match("a" * 20 + "b")
    length = 20 + round(math.log2(max(1.2 * seconds / max(time.perf_counter() - began, 1e-3), 1)))
    while True:
        began = time.perf_counter()
        pattern.match("a" * length + "b")
        took = time.perf_counter() - began
        if took >= seconds:
            return took
        length += 1


def computing_rank(out: Path, stall_after: float) -> dict[str, Any]:
    """Rank 0 computes for 2.5 ``stall_after`` at least, at its second step, in native code that holds the GIL (its
    interpreter silent, its main thread using the CPU): waited for, the run finishes."""

    def compute() -> None:
        (out / "computed_for").write_text(str(compute_holding_the_interpreter(2.5 * stall_after)))

    return outcome(lambda: fit(2, stall_after, Steps(compute)))


def held_interpreter(out: Path, stall_after: float) -> dict[str, Any]:
    """Rank 0 in a C call that keeps the GIL for 4 ``stall_after`` at its second step (the same process group as the
    run before): rank 1 names it once it gave no sign of life for ``stall_after`` after being asked. Rank 1 marks when
    it leaves that step for its next collective (its wait begins after the mark, however loaded the machine)."""

    def hold() -> None:
        ctypes.PyDLL(None).sleep(int(4 * stall_after))

    def mark() -> None:
        (out / "waits_from").write_text(str(time.time()))

    return outcome(lambda: fit(2, stall_after, Steps(hold, mark)))


class InMixedGroup(Steps):
    """At its second step, rank 0 all-reduces in a group made as ``cpu:gloo`` (a backend string other than "gloo", as
    offloading's ``cpu:gloo,cuda:nccl``), which rank 1 never joins: it waits for a message from rank 0 instead."""

    def on_train_batch_end(self, *args: Any) -> None:
        if self.global_step != 2:
            return
        mixed = dist.new_group(backend="cpu:gloo")
        if self.global_rank == 0:
            dist.all_reduce(torch.ones(1), group=mixed)
        else:
            dist.recv(torch.empty(1), src=0)


def mixed_group(out: Path, stall_after: float) -> dict[str, Any]:
    """The ranks wait in different calls of torch's, rank 0 in a ``cpu:gloo`` group: the verdict's release reaches
    rank 0's call too (gloo's side of the group closed), which then fails rather than keep the process to its end."""
    return outcome(lambda: fit(2, stall_after, InMixedGroup()))


def watchdog_fails(out: Path, stall_after: float) -> dict[str, Any]:
    """Rank 0's watchdog thread fails at its second step: its next collective raises, and rank 1 names rank 0's
    failure."""
    return outcome(lambda: fit(3, stall_after, Steps(fail_the_watchdog)))


class Branching(nn.Module):
    """Three blocks, each a unit under stage 3; the middle one runs on rank 0 only."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for index, block in enumerate(self.blocks):
            if index != 1 or self.rank == 0:
                x = torch.tanh(block(x))
        return x


def fabric_branch(out: Path, stall_after: float) -> dict[str, Any]:
    """A Fabric loop under stage 3 whose forward runs one unit on rank 0 only, then a barrier."""

    def loop() -> None:
        strategy = FabricZeroStrategy(stage=3, stall_after=stall_after, timeout=TIMEOUT)
        fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
        fabric.launch()
        torch.manual_seed(0)
        module = Branching(fabric.global_rank)
        model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))
        for _ in range(2):
            fabric.backward(model(torch.randn(2, 8)).pow(2).mean())
            optimizer.step()
            optimizer.zero_grad()
        fabric.barrier()  # the loop's end: rank 1 waits here for rank 0, which waits in a gather

    return outcome(loop)


PHASES = [busy_rank, computing_rank, held_interpreter, mixed_group, watchdog_fails, fabric_branch]


def runs_in_turn(out: Path, stall_after: float) -> None:
    seen: dict[str, Any] = {}
    for phase in PHASES:
        seen[phase.__name__] = phase(out, stall_after)
        (out / f"rank{rank()}.json").write_text(json.dumps(seen))
        if seen[phase.__name__]["error"] is not None:
            new_process_group()
    from tests.workers.divergent import run as diverge  # GPT-2 (transformers), imported for this run alone

    diverge(Divergence.VALIDATE, "zero3", False, stall_after)


# --- the other cases --------------------------------------------------------------------------------------------------


def killed_after_last_step(out: Path, stall_after: float) -> None:
    fit(2, stall_after, Steps(), steps=3)
    if rank() == 0:
        fail_the_watchdog()
    else:
        (out / "killed_at").write_text(str(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)


class StoppingOnGPU(Steps):
    def on_train_batch_end(self, *args: Any) -> None:
        self.trainer.strategy.barrier()


def rank0_waits_alone(out: Path, stall_after: float) -> None:
    """Rank 0 waits, at its second step, for a message rank 1 never sends; rank 1 goes on to its next step."""
    fit(2, stall_after, Steps(lambda: dist.recv(torch.empty(1), src=1)))


def rank1_stops(out: Path, stall_after: float) -> None:
    os.environ["STOP_RANK1"] = "1"
    strategy = ZeroStrategy(stage=2, stall_after=stall_after, timeout=timedelta(seconds=20))
    data = DataLoader(TensorDataset(torch.randn(32, 8)), batch_size=2)
    cpu_trainer(strategy, max_steps=6).fit(Steps(), data)


def nccl_rank1_stops(out: Path, stall_after: float) -> None:
    os.environ["STOP_RANK1"] = "1"
    strategy = ZeroStrategy(stage=3, stall_after=stall_after, timeout=timedelta(seconds=120))
    data = DataLoader(TensorDataset(torch.randn(32, 8)), batch_size=2)
    trainer = Trainer(accelerator="gpu", devices=2, strategy=strategy, max_steps=6, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(StoppingOnGPU(), data)


def main(out: Path) -> None:
    payload = read_payload(out)
    cases = {"runs_in_turn": runs_in_turn, "killed_after_last_step": killed_after_last_step,
             "rank0_waits_alone": rank0_waits_alone, "rank1_stops": rank1_stops,
             "nccl_rank1_stops": nccl_rank1_stops}  # fmt: skip
    (out / f"rank{rank()}.pid").write_text(str(os.getpid()))
    cases[payload["case"]](out, payload["stall_after"])


if __name__ == "__main__":
    main(Path(sys.argv[1]))

"""A step reads no value back from a tensor: on a GPU every such read (``.item()``, ``.tolist()``, ``bool(t)``, a copy
to the host that is not asynchronous) makes the host wait until the device has run everything queued before it, so
the host stops queueing kernels and the device then waits for the host.

Reads cost nothing on the CPU, so they are counted, not timed: every tensor method and torch function that reads is
wrapped during the steps after warm-up, and a read counts as the package's when the package's code made it, or
torch's distributed code (DTensor, ``fully_shard``) that the package called; the model's own ``.item()``, Lightning's
logging and the ``torch.optim`` optimizer's reads of its host-side step counters are theirs, the same under ``"ddp"``.
Every stage on one device (``sharded_on_one_device``: the code that runs per rank, on a group of one) in fp32, bf16
autocast and ZeRO mixed precision: none. Two reads are by design, and counted exactly: fp16 loss scaling reads
whether any rank overflowed, once per step (torch's ``GradScaler`` does too), and a parameter that got no gradient on
this rank makes the reducer read the presence flags, once per step whatever the number of buckets (DDP's
``find_unused_parameters=True`` reads its map too).
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist

from lightning_zero import ZeroStrategy
from tests.workers.modules import Classifier

pytestmark = pytest.mark.slow  # Trainers in this process, a few seconds each

# What makes the host wait for the device when called on a device tensor.
READS = frozenset({
    "item", "tolist", "__bool__", "__int__", "__float__", "__index__", "__format__", "numpy", "nonzero", "cpu",
    "equal", "allclose", "is_nonzero", "any_", "argwhere", "unique", "masked_select", "repeat_interleave",
})  # fmt: skip
WARMUP = 2


def _is_read(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    if name in READS:
        return True
    if name == "to":  # a copy to the host that the caller waits for
        target = args[1] if len(args) > 1 else kwargs.get("device")
        return str(target).startswith("cpu") and not kwargs.get("non_blocking", False)
    return False


def _caller() -> str:
    """``file:line`` of the innermost frame outside torch that led to this call, and ``(via torch.distributed)`` where
    the read itself was made there."""
    frame = sys._getframe(2)  # the caller of ``counted``
    via = "" if frame is None or "/torch/distributed/" not in frame.f_code.co_filename else " (via torch.distributed)"
    made_by_torch = frame is not None and "/torch/" in frame.f_code.co_filename
    while frame is not None and "/torch/" in frame.f_code.co_filename:
        frame = frame.f_back
    if frame is None:
        return "?"
    where = f"{frame.f_code.co_filename}:{frame.f_lineno}"
    return where + via if via or not made_by_torch else f"{where} (via torch)"


class DeviceReads:
    """Counts the reads of tensor values, by where they were made, while entered. Tensor methods and torch functions
    are wrapped rather than watched by a ``TorchFunctionMode``: a mode does not reach the hooks autograd runs in
    backward, where the gradient reductions are."""

    def __init__(self) -> None:
        self.by_caller: Counter[str] = Counter()
        self._originals: list[tuple[Any, str, Any]] = []

    def __enter__(self) -> DeviceReads:
        for owner in (torch.Tensor, torch):
            for name in sorted(READS | {"to"}):
                original = owner.__dict__.get(name, getattr(owner, name, None))
                if not callable(original) or isinstance(original, type(torch)) or (owner is torch and name == "to"):
                    continue  # `torch.cpu` is a module
                self._originals.append((owner, name, original))
                setattr(owner, name, self._counting(name, original))
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, original in reversed(self._originals):
            setattr(owner, name, original)
        self._originals.clear()

    def _counting(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            if _is_read(name, args, kwargs):
                self.by_caller[f"{name} at {_caller()}"] += 1
            return original(*args, **kwargs)

        return counted

    def package(self) -> dict[str, int]:
        """The package's reads: made by its code, or by torch's distributed code it called."""
        return {w: n for w, n in self.by_caller.items() if "/lightning_zero/" in w and not w.endswith("(via torch)")}


class CountSteadySteps(pl.Callback):
    """Counts reads during the training steps after ``WARMUP``, each step from batch start to batch end."""

    def __init__(self) -> None:
        self.reads = DeviceReads()
        self.steps = 0

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step >= WARMUP:
            self.reads.__enter__()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step > WARMUP:
            self.reads.__exit__(None, None, None)
            self.steps += 1


def count_reads(strategy: ZeroStrategy, precision: str, **module_options: Any) -> CountSteadySteps:
    if dist.is_initialized():
        dist.destroy_process_group()
    pl.seed_everything(0)
    counter = CountSteadySteps()
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, precision=precision, max_steps=WARMUP + 4, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[counter],
    )  # fmt: skip
    trainer.fit(Classifier(**module_options))
    assert counter.steps == 4
    return counter


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_no_reads_in_a_steady_step(stage: int, precision: str) -> None:
    counter = count_reads(ZeroStrategy(stage=stage, sharded_on_one_device=True), precision)
    assert counter.reads.package() == {}
    assert counter.reads.by_caller, "the counter saw none of the model's own reads (its `.item()` of each loss)"


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_no_reads_with_fp32_masters(stage: int) -> None:
    counter = count_reads(ZeroStrategy(stage=stage, sharded_on_one_device=True, master_weights=True), "bf16-true")
    assert counter.reads.package() == {}


@pytest.mark.parametrize("stage", [1, 2])
def test_fp16_loss_scaling_reads_once_a_step(stage: int) -> None:
    counter = count_reads(ZeroStrategy(stage=stage, sharded_on_one_device=True, master_weights=True), "16-true")
    reads = counter.reads.package()
    assert sum(reads.values()) == counter.steps, reads
    assert all("loss_scaler.py" in where for where in reads), reads


@pytest.mark.parametrize("stage", [1, 2])
def test_a_parameter_without_a_gradient_costs_one_read_a_step(stage: int) -> None:
    """``side`` gets no gradient on every other step: those steps read the flags once, the others not at all."""
    counter = count_reads(
        ZeroStrategy(stage=stage, sharded_on_one_device=True, bucket_cap_mb=1e-4), "32-true", unused_branch=True
    )  # buckets of one parameter each: still one read a step
    reads = counter.reads.package()
    assert sum(reads.values()) == counter.steps // 2, reads
    assert all("reducers.py" in where for where in reads), reads

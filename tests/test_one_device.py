"""Every stage's sharded path on one device (``sharded_on_one_device=True``: a group of one rank), against ``"ddp"``
on the same device: on the CPU always (gloo), and on a CUDA GPU where there is one (NCCL with one rank, the engine's
buckets, streams and collectives on CUDA tensors, ``fully_shard`` on a CUDA mesh).

What this proves about several GPUs: the code that runs per rank (bucketing, staging, the reduce-scatter/all-gather
calls and their outputs, optimizer shards, DTensor placements, checkpoints) runs on the device and its backend and
gives DDP's numbers. What it cannot prove: communication between ranks (a one-rank collective moves nothing), which
tests/test_parity.py and tests/test_zero3.py prove on several CPU processes.

Tolerances: with one rank nothing is reduced in another order, so fp32 runs differ from DDP only by kernel choices
(the sharded optimizer runs multi-tensor kernels on shards), the parity tolerance of tests/test_parity.py; the
ZeRO mixed-precision runs (bf16 module, fp32 masters) are held to fp32 DDP within bf16 rounding
(``tests.oracle.MASTER_WEIGHTS``), as in tests/test_gpu.py.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_zero import ZeroStrategy
from lightning_zero._core import EngineMode, Stage3Mode
from lightning_zero._stage3.units import Unit, UnitState
from tests.oracle import MASTER_WEIGHTS, Tolerance, close
from tests.workers.modules import Classifier

pytestmark = pytest.mark.slow  # every test here trains Trainers in this process, seconds each

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]
STAGES = [1, 2, 3]


def train(
    device: str,
    strategy: Any,
    steps: int = 6,
    ckpt_path: Path | None = None,
    module: type[Classifier] = Classifier,
    **kwargs: Any,
) -> pl.Trainer:
    if dist.is_initialized():  # each run starts its own process group
        dist.destroy_process_group()
    pl.seed_everything(0)
    trainer = pl.Trainer(
        accelerator="gpu" if device == "cuda" else "cpu", devices=1, strategy=strategy, max_steps=steps,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **kwargs,
    )  # fmt: skip
    trainer.fit(module(), ckpt_path=ckpt_path)
    return trainer


def sharded(stage: int, **options: Any) -> ZeroStrategy:
    return ZeroStrategy(stage=stage, sharded_on_one_device=True, **options)


def weights(trainer: pl.Trainer) -> dict[str, torch.Tensor]:
    state = trainer.lightning_module.state_dict()
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().float().cpu() for k, v in state.items()}


def assert_same(actual: pl.Trainer, expected: pl.Trainer, what: str, tolerance: Tolerance | None = None) -> None:
    """Weights as DDP's, within ``tolerance`` (the fp32 one by default, which the losses are held to as well)."""
    if tolerance is None:
        close(torch.tensor(actual.lightning_module.losses), torch.tensor(expected.lightning_module.losses), what)
    want, got = weights(expected), weights(actual)
    assert got.keys() == want.keys(), what
    for key, value in got.items():
        close(value, want[key], f"{what} {key}", *(() if tolerance is None else (tolerance,)))


def assert_sharded_path(trainer: pl.Trainer, stage: int, device: str) -> None:
    """The run went through the ZeRO machinery on the device, not plain training."""
    mode = trainer.strategy.mode
    if stage == 3:
        assert isinstance(mode, Stage3Mode) and mode.engine is not None and mode.engine.reducer is not None
        assert all(isinstance(p, DTensor) for p in trainer.lightning_module.parameters() if p.dim() > 0)
        assert all(part.rows.device.type == device for unit in mode.engine.units for part in unit.parts)
    else:
        assert isinstance(mode, EngineMode) and mode.engine is not None and mode.engine.reducer.buckets
        assert all(b.device.type == device for b in mode.engine.reducer.buckets)
    assert dist.get_backend() == ("nccl" if device == "cuda" else "gloo")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("stage", STAGES)
def test_matches_ddp(device: str, precision: str, stage: int) -> None:
    reference = train(device, "ddp", precision=precision)
    trainer = train(device, sharded(stage), precision=precision)
    assert_sharded_path(trainer, stage, device)
    assert_same(trainer, reference, f"zero{stage} {precision} on {device}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("stage", STAGES)
def test_fp32_masters_of_a_bf16_module(device: str, stage: int) -> None:
    """ZeRO mixed precision: bf16 parameters on the wire, fp32 master shards stepped by the optimizer; follows fp32
    DDP within bf16 rounding (Adam moves a noise-gradient element by up to ``lr`` = 1e-2 a step)."""
    reference = train(device, "ddp", steps=3)
    trainer = train(device, sharded(stage, master_weights=True), steps=3, precision="bf16-true")
    assert_sharded_path(trainer, stage, device)
    assert_same(trainer, reference, f"zero{stage} masters on {device}", MASTER_WEIGHTS)


class _SometimesSkips(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.always, self.even = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, skip: bool) -> torch.Tensor:
        return self.always(x) if skip else self.always(x) + self.even(x)


class _SkipsInsideUnits(Classifier):
    """Two repeated blocks (stage 3's units) whose second layer runs on even steps only, under AdamW with weight decay:
    a parameter of a unit that ran, without a gradient on this step, must keep none (as under DDP), or the decay
    moves it."""

    def __init__(self) -> None:
        super().__init__(optimizer="adamw_groups")
        self.blocks = nn.ModuleList(_SometimesSkips() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = super().forward(x)
        for block in self.blocks:
            logits = block(logits, skip=self.global_step % 2 == 1)
        return logits


@pytest.mark.parametrize(
    ("stage", "bucket_cap_mb"),
    [(1, 25.0), (2, 25.0), pytest.param(3, 25.0, id="3-units-share-a-bucket"), pytest.param(3, 1e-6, id="3-apart")],
)
def test_a_parameter_without_a_gradient_inside_a_unit(stage: int, bucket_cap_mb: float) -> None:
    """Also with stage 3's two units reduced together (their gradients fit in one bucket) and apart."""
    reference = train("cpu", "ddp_find_unused_parameters_true", module=_SkipsInsideUnits)
    trainer = train("cpu", sharded(stage, bucket_cap_mb=bucket_cap_mb), module=_SkipsInsideUnits)
    assert_same(trainer, reference, f"zero{stage}, a layer skipped on odd steps, {bucket_cap_mb} MiB buckets")
    if stage == 3:  # the units' buckets, in the order backward reaches them
        units = trainer.strategy.mode.engine.units[:-1]
        assert [unit.bucket for unit in units] == ([1, 0] if bucket_cap_mb < 1 else [0, 0])


@pytest.mark.parametrize("keep_mb", [0.0, 25.0])
def test_units_kept_from_forward_to_backward(keep_mb: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """With room, the last units to run (learnt from the step before) are not gathered again for their backward: over
    6 steps each block is gathered twice in the first and once in each other; without, twice in every step. The
    numbers are DDP's either way (a layer inside them skipped on odd steps)."""
    gathers: Counter[str] = Counter()
    gather = Unit.gather

    def counted(unit: Unit, *args: Any, **kwargs: Any) -> None:
        if unit.state is UnitState.RELEASED:
            gathers[unit.path] += 1
        gather(unit, *args, **kwargs)

    class CountTraining(pl.Callback):
        def on_train_start(self, *_: Any) -> None:  # not the sanity check's evaluation
            gathers.clear()

    monkeypatch.setattr(Unit, "gather", counted)
    reference = train("cpu", "ddp_find_unused_parameters_true", module=_SkipsInsideUnits)
    strategy = sharded(3, keep_for_backward_mb=keep_mb)
    trainer = train("cpu", strategy, module=_SkipsInsideUnits, callbacks=[CountTraining()])
    assert_same(trainer, reference, f"zero3 keeping {keep_mb} MiB for backward")
    expected = 2 + 5 * (1 if keep_mb else 2)
    assert {path: gathers[path] for path in ("blocks.0", "blocks.1")} == {"blocks.0": expected, "blocks.1": expected}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("stage", STAGES)
def test_clipping_and_accumulation(device: str, stage: int) -> None:
    options = {"gradient_clip_val": 0.05, "accumulate_grad_batches": 2}
    reference = train(device, "ddp", **options)
    trainer = train(device, sharded(stage), **options)
    assert_same(trainer, reference, f"zero{stage} clipped, accumulated on {device}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("stage", STAGES)
def test_checkpoint_round_trip(device: str, stage: int, tmp_path: Path) -> None:
    """Save the sharded run at step 6, resume it in a fresh Trainer to step 10: as DDP doing the same."""
    results = {}
    for name, strategy in (("ddp", lambda: "ddp"), ("zero", lambda: sharded(stage))):
        path = tmp_path / f"{name}.ckpt"
        train(device, strategy(), steps=6).save_checkpoint(path)
        results[name] = train(device, strategy(), steps=10, ckpt_path=path)
    assert (tmp_path / "zero.ckpt").is_dir()
    assert_same(results["zero"], results["ddp"], f"zero{stage} resumed on {device}")

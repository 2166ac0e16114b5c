"""The CUDA paths, on one GPU (skipped without one): NCCL with a single rank, offload to pinned host memory with
asynchronous copies both ways, host collectives on gloo beside NCCL, mixed precision and the engine's loss scaler on
the GPU, and checkpoints of offloaded state. The oracle is ``"ddp"`` on the same GPU (its sampler shuffles the same
way) with the same seed, data and precision flag.

Tolerance: the offloaded step runs on the CPU (fused Adam) where plain training steps on the GPU, so results differ
by the two kernels' rounding, a few ulps a step; the fp32 tolerance of tests/oracle.py. Mixed
precision keeps fp32 weights and optimizer state, so the same bound holds for its weights.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from lightning_zero import Zero1Strategy, Zero2Strategy, Zero3Strategy
from lightning_zero.memory import engine_of
from tests.launch import start, write_payload
from tests.oracle import MASTER_WEIGHTS, close
from tests.workers.modules import Classifier
from tests.workers.offload_memory import bytes_in_files, local

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


class Where(pl.Callback):
    """Where the module's weights, the optimizer's masters and state live at the end of training (before teardown
    takes the module back to the CPU)."""

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        engine = engine_of(trainer.strategy)
        locals_ = [p.to_local() if isinstance(p, DTensor) else p for p in module.parameters() if p.dim() > 0]
        self.weights = {(t.device.type, t.is_pinned()) for t in locals_}
        self.masters = {(s.master.device.type, s.master.is_pinned()) for s in engine.sharded} if engine else set()
        optimizer = trainer.strategy.optimizers[0]
        self.state = {
            (v.to_local() if isinstance(v, DTensor) else v).device.type
            for entries in optimizer.state.values()
            for v in entries.values()
            if isinstance(v, torch.Tensor) and v.dim() > 0
        }


def train(
    strategy: Any,
    steps: int = 6,
    ckpt_path: Path | None = None,
    extra: list[pl.Callback] | None = None,
    **trainer_kwargs: Any,
) -> pl.Trainer:
    if dist.is_initialized():  # each run starts its own process group, with the backends its strategy asks for
        dist.destroy_process_group()
    pl.seed_everything(0)
    trainer = pl.Trainer(
        accelerator="gpu", devices=1, strategy=strategy, max_steps=steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[Where(), *(extra or [])], **trainer_kwargs,
    )
    trainer.fit(Classifier(), ckpt_path=ckpt_path)
    return trainer


def where(trainer: pl.Trainer) -> Where:
    return next(c for c in trainer.callbacks if isinstance(c, Where))


def weights(trainer: pl.Trainer) -> dict[str, torch.Tensor]:
    state = trainer.lightning_module.state_dict()
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().float().cpu() for k, v in state.items()}


def assert_same(actual: pl.Trainer, expected: pl.Trainer, what: str) -> None:
    close(torch.tensor(actual.lightning_module.losses), torch.tensor(expected.lightning_module.losses), f"{what} loss")
    want, got = weights(expected), weights(actual)
    assert got.keys() == want.keys(), what
    for key, value in got.items():
        close(value, want[key], f"{what} {key}")


@pytest.mark.parametrize("strategy", ["zero1_host", "zero2_offload", "zero3_offload", "zero2_disk"])
def test_offload_matches_plain_training(strategy: str, tmp_path: Path) -> None:
    reference = train("ddp")
    named = {
        "zero1_host": lambda: Zero1Strategy(offload_optimizer=True),
        "zero2_disk": lambda: Zero2Strategy(offload_optimizer="disk", offload_dir=tmp_path),
    }
    offloaded = train(named[strategy]() if strategy in named else strategy)
    assert_same(offloaded, reference, strategy)
    found = where(offloaded)
    assert found.state == {"cpu"}, "optimizer state left the host"
    if strategy == "zero3_offload":  # the shards themselves live in pinned host memory
        assert found.weights == {("cpu", True)}
    else:  # stages 1 and 2: the module's weights on the GPU, its masters pinned on the host
        assert found.weights == {("cuda", False)} and found.masters == {("cpu", True)}


class InFiles(pl.Callback):
    """Whether every parameter shard lies in a mapping of a file under ``directory`` as the first step's gradients
    are all there (before teardown)."""

    def __init__(self, directory: Path) -> None:
        self.directory = str(directory)
        self.shard_bytes = self.file_bytes = -1

    def on_before_optimizer_step(self, trainer: pl.Trainer, module: pl.LightningModule, *_: Any) -> None:
        if self.shard_bytes < 0:
            shards = [local(p.detach()) for p in module.parameters() if p.dim() > 0]
            self.shard_bytes = sum(t.numel() * t.element_size() for t in shards)
            self.file_bytes = bytes_in_files(shards, self.directory)


def test_parameters_on_disk_match_plain_training(tmp_path: Path) -> None:
    """ZeRO-Infinity on the GPU: the shards, their gradients and the optimizer state in files under ``offload_dir``,
    copied to the GPU for each unit's gather and back for the step (fully_shard's unpinned host copies)."""
    reference = train("ddp")
    in_files = InFiles(tmp_path)
    offloaded = train(Zero3Strategy(offload_parameters="disk", offload_dir=tmp_path), extra=[in_files])
    assert_same(offloaded, reference, "zero3_infinity")
    assert where(offloaded).weights == {("cpu", False)} and where(offloaded).state == {"cpu"}
    assert in_files.shard_bytes > 0 and in_files.file_bytes == in_files.shard_bytes


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_mixed_precision_offloaded(precision: str) -> None:
    """Autocast on the GPU; under "16-mixed" the engine's loss scaler replaces Lightning's GradScaler and votes on
    overflows over the host collective."""
    reference = train("ddp", precision=precision)
    for strategy in ("zero2_offload", "zero3_offload"):
        assert_same(train(strategy, precision=precision), reference, f"{strategy} {precision}")


def test_bf16_module_on_fp32_host_masters() -> None:
    """ZeRO mixed precision offloaded: a bf16 module on the GPU, fp32 masters on the host. The module holds its
    masters rounded to bf16, and the run follows fp32 training within bf16 rounding (the ``MASTER_WEIGHTS`` bound of
    tests/oracle.py: Adam moves a noise-gradient element by up to ``lr`` = 1e-2 a step)."""
    reference = train("ddp", steps=3)
    trainer = train(Zero2Strategy(master_weights=True, offload_optimizer=True), steps=3, precision="bf16-true")
    assert where(trainer).weights == {("cuda", False)} and where(trainer).masters == {("cpu", True)}
    for sharded in trainer.strategy.mode.engine.sharded:
        assert sharded.master.dtype == torch.float32 and sharded.param.dtype == torch.bfloat16
        assert torch.equal(sharded.local.cpu(), sharded.master.to(torch.bfloat16))
    expected = weights(reference)
    for key, value in weights(trainer).items():
        close(value, expected[key], key, MASTER_WEIGHTS)


def test_clipping_offloaded() -> None:
    """The global norm is computed from host gradient shards (a collective on gloo beside NCCL)."""
    reference = train("ddp", gradient_clip_val=0.05)
    for strategy in ("zero2_offload", "zero3_offload"):
        assert_same(train(strategy, gradient_clip_val=0.05), reference, f"{strategy} clipped")


def test_offloaded_checkpoint_resumes(tmp_path: Path) -> None:
    """Save an offloaded run's sharded checkpoint, resume it in a fresh Trainer: the same as plain training doing
    the same with its ordinary file."""
    results = {}
    for strategy in ("ddp", "zero2_offload", "zero3_offload"):
        path = tmp_path / f"{strategy}.ckpt"
        train(strategy, steps=6).save_checkpoint(path)
        results[strategy] = train(strategy, steps=10, ckpt_path=path)
    assert (tmp_path / "zero2_offload.ckpt").is_dir()
    for strategy in ("zero2_offload", "zero3_offload"):
        assert_same(results[strategy], results["ddp"], f"{strategy} resumed")


def test_ordinary_checkpoint_loads_into_offloaded_runs(tmp_path: Path) -> None:
    """A single-file checkpoint of a ``"ddp"`` run resumes under offload: each rank keeps its rows of the weights and
    of the optimizer state, on the host."""
    path = tmp_path / "ddp.ckpt"
    train("ddp", steps=6).save_checkpoint(path)
    reference = train("ddp", steps=10, ckpt_path=path)
    for strategy in ("zero2_offload", "zero3_offload"):
        resumed = train(strategy, steps=10, ckpt_path=path)
        assert where(resumed).state == {"cpu"}
        assert_same(resumed, reference, f"{strategy} from a ddp file")


def test_process_group_without_host_backend_is_refused() -> None:
    """A process group left by an earlier NCCL-only run cannot carry host collectives: a clear error, not a hang."""
    train("ddp", steps=1)
    trainer = pl.Trainer(accelerator="gpu", devices=1, strategy="zero2_offload", max_steps=1, logger=False)
    with pytest.raises(RuntimeError, match="has no CPU backend"):
        trainer.fit(Classifier())


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL between 2 ranks needs 2 GPUs")
def test_a_stopped_rank_is_named_over_nccl(tmp_path: Path) -> None:
    """Stage 3 on 2 GPUs: rank 1 stops itself (SIGSTOP) at its third step, rank 0 waits in the barrier after it. The
    stall watchdog names rank 1 stopped within ``stall_after`` (3 s) and its answer window (as long again), aborts
    NCCL's communicator so that the barrier returns, and rank 0 exits 1 long before the strategy's 120 s timeout."""
    write_payload(tmp_path, case="nccl_rank1_stops", stall_after=3.0)
    procs = start("tests.workers.stalls", [str(tmp_path)], 2, logs=tmp_path)
    try:
        begun = time.monotonic()
        procs[0].wait(timeout=240)
        took = time.monotonic() - begun
    finally:
        for proc in procs:
            proc.kill()  # rank 1 is stopped: only SIGKILL ends it
            proc.wait()
    log = (tmp_path / "rank0.log").read_text()
    assert procs[0].returncode == 1, log[-3000:]
    assert "stall watchdog on rank 0 gave up on rank 1 (PID " in log, log[-3000:]
    assert "rank 1's process is stopped (SIGSTOP, a debugger)" in log
    assert took < 120, log[-3000:]

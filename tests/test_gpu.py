"""The CUDA paths, on one GPU (skipped without one): NCCL with a single rank, offload to pinned host memory with
asynchronous copies both ways, host collectives on gloo beside NCCL, mixed precision and the engine's loss scaler on
the GPU, and checkpoints of offloaded state. The oracle is Lightning's plain single-device training with the same
seed, data and precision flag.

Tolerance: the offloaded step runs on the CPU (fused Adam) where plain training steps on the GPU, so results differ
by the two kernels' rounding, a few ulps a step; ``rtol=1e-4, atol=5e-5`` as in tests/test_parity.py. Mixed
precision keeps fp32 weights and optimizer state, so the same bound holds for its weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.distributed.tensor import DTensor

from lightning_zero import Zero1Strategy, Zero2Strategy
from tests.test_parity import close
from tests.workers.modules import Classifier

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def train(strategy: Any, steps: int = 6, ckpt_path: Path | None = None, **trainer_kwargs: Any) -> pl.Trainer:
    pl.seed_everything(0)
    trainer = pl.Trainer(
        accelerator="gpu", devices=1, strategy=strategy, max_steps=steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, **trainer_kwargs,
    )
    trainer.fit(Classifier(), ckpt_path=ckpt_path)
    return trainer


def weights(trainer: pl.Trainer) -> dict[str, torch.Tensor]:
    state = trainer.lightning_module.state_dict()
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().float().cpu() for k, v in state.items()}


def assert_same(actual: pl.Trainer, expected: pl.Trainer, what: str) -> None:
    close(torch.tensor(actual.lightning_module.losses), torch.tensor(expected.lightning_module.losses), f"{what} loss")
    want = weights(expected)
    for key, value in weights(actual).items():
        close(value, want[key], f"{what} {key}")


def state_devices(trainer: pl.Trainer) -> set[str]:
    optimizer = trainer.strategy.optimizers[0]
    found = set()
    for entries in optimizer.state.values():
        for value in entries.values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                found.add((value.to_local() if isinstance(value, DTensor) else value).device.type)
    return found


@pytest.mark.parametrize("strategy", ["zero1_host", "zero2_offload", "zero3_offload", "zero2_disk"])
def test_offload_matches_plain_training(strategy: str, tmp_path: Path) -> None:
    reference = train("auto")
    named = {
        "zero1_host": lambda: Zero1Strategy(offload_optimizer=True),
        "zero2_disk": lambda: Zero2Strategy(offload_optimizer="disk", offload_dir=tmp_path),
    }
    offloaded = train(named[strategy]() if strategy in named else strategy)
    assert_same(offloaded, reference, strategy)
    assert state_devices(offloaded) == {"cpu"}, "optimizer state left the host"
    assert next(offloaded.lightning_module.parameters()).device.type == "cuda" or strategy == "zero3_offload"
    engine = offloaded.strategy._engine
    if engine is not None:  # stages 1 and 2: pinned host masters, the module's weights on the GPU
        assert all(s.master.device.type == "cpu" and s.master.is_pinned() for s in engine.sharded)
        assert all(s.param.device.type == "cuda" for s in engine.sharded)
    else:  # stage 3: the shards themselves live in pinned host memory
        shards = [p.to_local() for p in offloaded.lightning_module.parameters() if isinstance(p, DTensor)]
        assert shards and all(s.device.type == "cpu" and s.is_pinned() for s in shards)


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_mixed_precision_offloaded(precision: str) -> None:
    """Autocast on the GPU; under "16-mixed" the engine's loss scaler replaces Lightning's GradScaler and votes on
    overflows over the host collective."""
    reference = train("auto", precision=precision)
    for strategy in ("zero2_offload", "zero3_offload"):
        assert_same(train(strategy, precision=precision), reference, f"{strategy} {precision}")


def test_bf16_module_on_fp32_host_masters() -> None:
    """ZeRO mixed precision offloaded: a bf16 module on the GPU, fp32 masters on the host; after every step the
    module holds its masters rounded to bf16, and training lowers the loss."""
    trainer = train(Zero2Strategy(master_weights=True, offload_optimizer=True), steps=12, precision="bf16-true")
    losses = trainer.lightning_module.losses
    assert sum(losses[-3:]) < sum(losses[:3])
    for sharded in trainer.strategy._engine.sharded:
        assert sharded.master.dtype == torch.float32 and sharded.master.device.type == "cpu"
        assert sharded.param.dtype == torch.bfloat16 and sharded.param.device.type == "cuda"
        assert torch.equal(sharded.local.cpu(), sharded.master.to(torch.bfloat16))


def test_clipping_offloaded() -> None:
    """The global norm is computed from host gradient shards (a collective on gloo beside NCCL)."""
    reference = train("auto", gradient_clip_val=0.05)
    for strategy in ("zero2_offload", "zero3_offload"):
        assert_same(train(strategy, gradient_clip_val=0.05), reference, f"{strategy} clipped")


def test_offloaded_checkpoint_resumes(tmp_path: Path) -> None:
    """Save an offloaded run's sharded checkpoint, resume it in a fresh Trainer: the same as plain training doing
    the same with its ordinary file."""
    results = {}
    for strategy in ("auto", "zero2_offload", "zero3_offload"):
        path = tmp_path / f"{strategy}.ckpt"
        train(strategy, steps=6).save_checkpoint(path)
        results[strategy] = train(strategy, steps=10, ckpt_path=path)
    assert (tmp_path / "zero2_offload.ckpt").is_dir()
    for strategy in ("zero2_offload", "zero3_offload"):
        assert_same(results[strategy], results["auto"], f"{strategy} resumed")

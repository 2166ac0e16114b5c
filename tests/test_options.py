"""Options, registration, bad input and the single-device case: one process, no launcher."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import StrategyRegistry

import lightning_zero
from lightning_zero import Zero1Strategy, Zero2Strategy, ZeroStrategy
from lightning_zero._offload import OffloadError
from tests.workers.modules import Classifier


def test_names_are_registered_on_import() -> None:
    assert StrategyRegistry["zero1"]["strategy"] is Zero1Strategy
    assert StrategyRegistry["zero2"]["strategy"] is Zero2Strategy
    assert lightning_zero.ZeroStrategy(stage=1).stage == 1


def test_trainer_resolves_names() -> None:
    trainer = pl.Trainer(strategy="zero1", accelerator="cpu", devices=1, logger=False)
    assert isinstance(trainer.strategy, Zero1Strategy) and trainer.strategy.stage == 1


@pytest.mark.parametrize("stage", [0, 4, "2", 2.0, True])
def test_unknown_stage_is_refused(stage: Any) -> None:
    with pytest.raises(ValueError, match=r"`stage=.*HINT: pass `stage` as one of \[1, 2"):
        ZeroStrategy(stage=stage)


def test_unknown_option_is_named() -> None:
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['overlap_comm'\].*HINT.*`memory_report`"):
        ZeroStrategy(stage=2, overlap_comm=True)


@pytest.mark.parametrize("value", ["no", 0, None])
def test_memory_report_must_be_a_bool(value: Any) -> None:
    with pytest.raises(ValueError, match=r"`memory_report=.*` must be True or False. HINT"):
        ZeroStrategy(memory_report=value)
    assert ZeroStrategy(memory_report=False).config.memory_report is False


def test_fixed_stage_class_refuses_another_stage() -> None:
    with pytest.raises(ValueError, match=r"Zero1Strategy runs stage 1.*HINT"):
        Zero1Strategy(stage=2)


@pytest.mark.parametrize("value", [0, -1, "big", None])
def test_bucket_size_must_be_positive(value: Any) -> None:
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        ZeroStrategy(bucket_cap_mb=value)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_bucket_size_must_be_finite(value: float) -> None:
    """NaN and infinity pass a `<= 0` check; refused at construction, not inside `fit` converting to bytes."""
    with pytest.raises(ValueError, match=rf"`bucket_cap_mb={value!r}` must be a finite, positive number of MiB. HINT"):
        ZeroStrategy(bucket_cap_mb=value)


def test_offload_dir_that_is_a_file_is_named_a_file(tmp_path: Path) -> None:
    a_file = tmp_path / "state.bin"
    a_file.write_text("")
    with pytest.raises(OffloadError) as error:
        ZeroStrategy(stage=2, offload_optimizer="disk", offload_dir=a_file)
    message = str(error.value)
    assert f"`offload_dir='{a_file}'` is a file, not a directory. HINT: point `offload_dir` at a directory" in message
    assert f"such as `{tmp_path}`" in message
    assert f"mkdir -p {a_file}`" not in message  # the file's own path is no directory to make


def test_unsupported_device_is_refused_before_training() -> None:
    strategy = Zero2Strategy(parallel_devices=[torch.device("meta")])
    with pytest.raises(ValueError, match=r"not on `meta`.*HINT"):
        strategy.setup_environment()


class DuckOptimizer:
    """Looks like an optimizer to Lightning, but is no `torch.optim.Optimizer`."""

    def __init__(self, params: Any) -> None:
        self.param_groups = [{"params": list(params), "lr": 0.1}]
        self.defaults = {"lr": 0.1}
        self.state: dict = {}

    def step(self, closure: Any = None) -> None: ...

    def zero_grad(self, set_to_none: bool = True) -> None: ...

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state_dict: dict) -> None: ...


def test_non_torch_optimizer_is_refused_before_training() -> None:
    class Module(Classifier):
        def configure_optimizers(self) -> Any:
            return DuckOptimizer(self.parameters())

    module = Module()
    trainer = pl.Trainer(strategy="zero2", accelerator="cpu", devices=1, max_steps=1, logger=False)
    with pytest.raises(TypeError, match=r"DuckOptimizer, which is not a `torch.optim.Optimizer`.*HINT"):
        trainer.fit(module)
    assert module.losses == []  # nothing trained


@pytest.mark.parametrize("strategy", ["zero1", "zero2"])
def test_one_device_trains_plainly(strategy: str) -> None:
    """With one device the strategy keeps the user's optimizer and gives DDP's numbers (DDP on one device)."""
    results = {}
    for name in ("ddp", strategy):
        pl.seed_everything(0)
        module = Classifier(optimizer="adamw_groups", scheduler="step", config_style="dict")
        trainer = pl.Trainer(
            strategy=name, accelerator="cpu", devices=1, max_steps=5, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, gradient_clip_val=0.1,
        )
        trainer.fit(module)
        results[name] = (module.state_dict(), trainer.optimizers[0])
    (plain, _), (zero, optimizer) = results["ddp"], results[strategy]
    assert type(optimizer) is torch.optim.AdamW  # no wrapper, no collectives
    assert trainer.strategy._engine is None
    for key, value in plain.items():
        torch.testing.assert_close(zero[key], value, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"stage": 1, "reduce_dtype": "float32"}, r"`reduce_dtype` applies to the gradient shards.*HINT"),
        ({"stage": 2, "reduce_dtype": "float64"}, r"`reduce_dtype='float64'`.*HINT"),
        ({"stage": 2, "master_weights": "yes"}, r"`master_weights='yes'` must be True or False"),
    ],
)
def test_precision_options_are_checked(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ZeroStrategy(**kwargs)


def test_master_weights_need_several_ranks() -> None:
    trainer = pl.Trainer(strategy=Zero2Strategy(master_weights=True), accelerator="cpu", devices=1,
                         precision="bf16-true", max_steps=1, logger=False)
    with pytest.raises(ValueError, match=r"this run has one.*HINT: .*bf16-mixed"):
        trainer.fit(Classifier())

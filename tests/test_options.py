"""Options, registration, bad input and the single-device case: one process, no launcher."""

from __future__ import annotations

import importlib
import inspect
import tempfile
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGIES
from lightning.pytorch.strategies import StrategyRegistry

import lightning_zero
from lightning_zero import Zero1Strategy, Zero2Strategy, ZeroStrategy
from lightning_zero._offload.target import OffloadError, OffloadTarget
from lightning_zero.memory import engine_of
from tests.workers.modules import Classifier

# each public name of the package, and the module that defines it
PUBLIC = {
    "CheckpointError": "lightning_zero._checkpoint.error",
    "OffloadError": "lightning_zero._offload.target",
    "Zero1Strategy": "lightning_zero.pytorch.strategy",
    "Zero2Strategy": "lightning_zero.pytorch.strategy",
    "Zero3Strategy": "lightning_zero.pytorch.strategy",
    "ZeroStrategy": "lightning_zero.pytorch.strategy",
    "ZeroAutoStrategy": "lightning_zero.pytorch.auto",
    "consolidate_checkpoint": "lightning_zero.consolidate",
    "whole_state_dict": "lightning_zero.consolidate",
}
FABRIC_PUBLIC = {
    **{
        name: "lightning_zero.fabric.strategy"
        for name in ("Zero1Strategy", "Zero2Strategy", "Zero3Strategy", "ZeroStrategy")
    },
    "ZeroAutoStrategy": "lightning_zero.fabric.auto",
}
# each registered name: its stage and the options it sets
NAMES = {
    "zero1": (1, {}),
    "zero2": (2, {}),
    "zero3": (3, {}),
    "zero2_offload": (2, {"offload_optimizer": True}),
    "zero3_offload": (3, {"offload_optimizer": True, "offload_parameters": True}),
    "zero3_infinity": (
        3,
        {"offload_parameters": "disk", "offload_optimizer": "disk", "offload_dir": tempfile.gettempdir()},
    ),
}
# where each name puts the optimizer and the parameter shards (on the device where not named)
PLACES = {
    "zero2_offload": (OffloadTarget.CPU, OffloadTarget.DEVICE),
    "zero3_offload": (OffloadTarget.CPU, OffloadTarget.CPU),
    "zero3_infinity": (OffloadTarget.DISK, OffloadTarget.DISK),
}
FRONT_ENDS = {"trainer": (StrategyRegistry, "lightning_zero.pytorch.strategy"),
              "fabric": (FABRIC_STRATEGIES, "lightning_zero.fabric.strategy")}  # fmt: skip


def test_public_names() -> None:
    """``__all__`` lists exactly the package's public classes and functions (and the ``fabric`` front end), each the
    object its implementation module defines; ``lightning_zero.fabric.__all__`` its strategy classes likewise."""
    defined_here = {
        name
        for name, value in vars(lightning_zero).items()
        if not name.startswith("_")
        and (inspect.isclass(value) or inspect.isfunction(value))
        and value.__module__.startswith("lightning_zero")
    }
    assert sorted(lightning_zero.__all__) == sorted([*PUBLIC, "fabric"])
    assert defined_here == set(PUBLIC)
    for name, module in PUBLIC.items():
        value = getattr(lightning_zero, name)
        assert value is getattr(importlib.import_module(module), name) and value.__module__ == module, name
    assert lightning_zero.fabric is importlib.import_module("lightning_zero.fabric")
    assert sorted(lightning_zero.fabric.__all__) == sorted(FABRIC_PUBLIC)
    for name, module in FABRIC_PUBLIC.items():
        value = getattr(lightning_zero.fabric, name)
        assert value.__module__ == module and value.__qualname__ == name
        assert value is not getattr(lightning_zero, name)  # each front end has its own classes


@pytest.mark.parametrize("front_end", FRONT_ENDS)
@pytest.mark.parametrize("name", NAMES)
def test_names_are_registered_on_import(front_end: str, name: str) -> None:
    """Each name resolves, in the registry of each front end, to that front end's class of its stage, with its
    options."""
    registry, module = FRONT_ENDS[front_end]
    stage, options = NAMES[name]
    entry = registry[name]
    expected = getattr(importlib.import_module(module), f"Zero{stage}Strategy")
    assert entry["strategy"] is expected and entry["init_params"] == options
    assert expected.fixed_stage == stage


@pytest.mark.parametrize("name", NAMES)
def test_front_ends_build_the_registered_classes(name: str) -> None:
    """``Trainer(strategy=name)`` and ``Fabric(strategy=name)`` build the class of their front end, configured."""
    stage, options = NAMES[name]
    trainer = pl.Trainer(strategy=name, accelerator="cpu", devices=2, logger=False)
    fabric = Fabric(strategy=name, accelerator="cpu", devices=2)
    for front_end, strategy in (("trainer", trainer.strategy), ("fabric", fabric.strategy)):
        _, module = FRONT_ENDS[front_end]
        assert type(strategy) is getattr(importlib.import_module(module), f"Zero{stage}Strategy"), front_end
        assert strategy.stage == stage and strategy.world_size == 2
        config = strategy.config
        assert (config.offload, config.offload_parameters) == PLACES.get(name, (OffloadTarget.DEVICE,) * 2)
        # ZeRO-Infinity's files go to the system's temporary directory, unless a class with options says otherwise
        assert config.offload_dir == (Path(options["offload_dir"]) if "offload_dir" in options else None)


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


@pytest.mark.parametrize("value", [-1, -0.5, float("nan"), float("inf"), "big", None, True])
def test_kept_for_backward_must_be_a_finite_number_of_mib(value: Any) -> None:
    with pytest.raises(ValueError, match=r"`keep_for_backward_mb=.*` must be a finite number of MiB, 0 or more. HINT"):
        ZeroStrategy(keep_for_backward_mb=value)
    assert ZeroStrategy(keep_for_backward_mb=0).config.keep_for_backward_bytes == 0


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
            strategy=name,
            accelerator="cpu",
            devices=1,
            max_steps=5,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            gradient_clip_val=0.1,
        )
        trainer.fit(module)
        results[name] = (module.state_dict(), trainer.optimizers[0])
    (plain, _), (zero, optimizer) = results["ddp"], results[strategy]
    assert type(optimizer) is torch.optim.AdamW  # no wrapper, no collectives
    assert engine_of(trainer.strategy) is None
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
    trainer = pl.Trainer(
        strategy=Zero2Strategy(master_weights=True),
        accelerator="cpu",
        devices=1,
        precision="bf16-true",
        max_steps=1,
        logger=False,
    )
    with pytest.raises(ValueError, match=r"this run has one.*HINT: .*bf16-mixed"):
        trainer.fit(Classifier())


@pytest.mark.parametrize("front_end", list(FRONT_ENDS))
def test_a_subclass_of_zero_strategy_takes_any_stage(front_end: str) -> None:
    """Only the `Zero{N}Strategy` classes fix the stage; a user's own subclass of `ZeroStrategy` takes `stage`."""
    base = importlib.import_module(FRONT_ENDS[front_end][1]).ZeroStrategy

    class Mine(base):  # type: ignore[misc, valid-type]
        pass

    assert [int(Mine(stage=stage).stage) for stage in (1, 2, 3)] == [1, 2, 3]


def test_unknown_state_dict_type_is_named() -> None:
    """As ``FSDPStrategy`` refuses one, naming the two kinds there are."""
    with pytest.raises(ValueError, match=r"`state_dict_type='local'` is not a kind of checkpoint. HINT: pass"):
        lightning_zero.Zero3Strategy(state_dict_type="local")

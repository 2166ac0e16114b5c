"""Runs inside each of 2 processes (started by tests/launch.py) for tests/test_checkpoints.py's model-only loads;
``argv``: dir.

Per strategy: a checkpoint of :class:`Classifier` saved by the Trainer and one saved by Fabric, then loads of each
into a module lacking a layer (``side``: the checkpoint holds unexpected keys) or holding one more (``extra``: keys
are missing), strict and not. Records per rank and case what happened: ``{"loaded": whether every loaded tensor
equals the saved one}`` or ``{"error": its type's bases, its first line up to "for <module>", its key lines}``.

Per strategy, every stage included, the same records for loads made inside ``torch.inference_mode()`` and
``torch.no_grad()`` (:func:`grad_mode_cases`).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric import Fabric
from torch import nn

import lightning_zero  # noqa: F401
from tests.oracle import full
from tests.scenarios import MODULE_KWARGS, cpu_trainer
from tests.workers.modules import Classifier

STRATEGIES = ("ddp", "zero2", "zero3")
GRAD_MODE_STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
GRAD_MODES = {"inference_mode": torch.inference_mode, "no_grad": torch.no_grad}
WORLD_SIZE = int(os.environ["WORLD_SIZE"])  # read now: Lightning's teardown removes it from the environment


class WithoutSide(Classifier):
    """The module with no ``side`` layer: an identity, with no parameters, in its place."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.side = nn.Identity()


class WithExtra(Classifier):
    """The module with one layer more than was saved."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.extra = nn.Linear(3, 3)


def state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: full(v).detach().clone() for k, v in module.state_dict().items()}


def outcome(load: Callable[[], nn.Module], saved: dict[str, torch.Tensor]) -> dict[str, Any]:
    try:
        module = load()
    except RuntimeError as error:
        lines = str(error).splitlines()
        return {
            "error": [cls.__name__ for cls in type(error).__mro__ if cls.__module__ == "builtins"],
            "head": lines[0].split(" from checkpoint ")[0].rstrip(":"),
            "keys": [line.strip() for line in lines[1:] if "key(s) in state_dict" in line],
        }
    loaded = state(module)
    return {"loaded": all(torch.equal(value, saved[key]) for key, value in loaded.items() if key in saved)}


def trainer_cases(strategy: str, out: Path) -> dict[str, Any]:
    pl.seed_everything(0)
    trained = cpu_trainer(strategy, 2)
    trained.fit(Classifier(**MODULE_KWARGS))
    path = out / f"{strategy}-trainer.ckpt"
    trained.save_checkpoint(path)
    saved = state(trained.lightning_module)

    def run(module: pl.LightningModule, how: str, strict: bool = True) -> Callable[[], nn.Module]:
        def load() -> nn.Module:
            module.strict_loading = strict
            getattr(cpu_trainer(strategy), how)(module, ckpt_path=path)
            return module

        return load

    return {
        "trainer.validate, a layer fewer": outcome(run(WithoutSide(**MODULE_KWARGS), "validate"), saved),
        "trainer.predict, a layer fewer": outcome(run(WithoutSide(**MODULE_KWARGS), "predict"), saved),
        "trainer.validate, a layer fewer, not strict": outcome(
            run(WithoutSide(**MODULE_KWARGS), "validate", strict=False), saved
        ),
        "trainer.test, a layer more": outcome(run(WithExtra(**MODULE_KWARGS), "test"), saved),
    }


def fabric_cases(strategy: str, out: Path) -> dict[str, Any]:
    def fabric() -> Fabric:
        made = Fabric(accelerator="cpu", devices=WORLD_SIZE, strategy=strategy)
        made.launch()  # the processes exist already: this joins the process group
        return made

    pl.seed_everything(0)
    saving = fabric()
    model = saving.setup(Classifier(**MODULE_KWARGS))
    path = out / f"{strategy}-fabric.ckpt"
    saving.save(path, {"model": model})
    saved = state(model)

    def run(module_type: type[Classifier], **kwargs: Any) -> Callable[[], nn.Module]:
        def load() -> nn.Module:
            loading = fabric()
            module = loading.setup(module_type(**MODULE_KWARGS))
            loading.load(path, {"model": module}, **kwargs)
            return module

        return load

    return {
        "fabric.load, a layer fewer": outcome(run(WithoutSide), saved),
        "fabric.load, a layer fewer, strict=False": outcome(run(WithoutSide, strict=False), saved),
        "fabric.load, a layer more": outcome(run(WithExtra), saved),
    }


def grad_mode_cases(strategy: str, out: Path) -> dict[str, Any]:
    """Lightning's habit (its FSDP test ``test_strategy_checkpoint``): the Trainer that trained loads a checkpoint for
    ``test``/``validate``/``predict`` (``ckpt_path=``) inside ``torch.inference_mode()`` or ``torch.no_grad()``; and
    ``fabric.load`` inside each. Two checkpoints of different weights, ``a`` and ``b``, are loaded in turn, so that
    every load changes the weights it is checked against."""
    saved: dict[str, dict[str, torch.Tensor]] = {}
    trainers = {}
    for seed, name in enumerate("ab"):
        pl.seed_everything(seed)
        trainers[name] = cpu_trainer(strategy, 2)
        trainers[name].fit(Classifier(**MODULE_KWARGS))
        trainers[name].save_checkpoint(out / f"{strategy}-{name}.ckpt")
        saved[name] = state(trainers[name].lightning_module)
    trained = trainers["a"]  # holds `a`: its first load is of `b`

    def run(how: str, mode: Callable[[], Any], name: str) -> Callable[[], nn.Module]:
        def load() -> nn.Module:
            with mode():
                getattr(trained, how)(ckpt_path=out / f"{strategy}-{name}.ckpt")
            return trained.lightning_module

        return load

    cases = {}
    loads = iter("bababa")
    for mode_name, mode in GRAD_MODES.items():
        for how in ("test", "validate", "predict"):
            name = next(loads)
            cases[f"trainer.{how} in {mode_name}"] = outcome(run(how, mode, name), saved[name])

    fabric = Fabric(accelerator="cpu", devices=WORLD_SIZE, strategy=strategy)
    fabric.launch()
    for seed, name in enumerate("ab"):
        pl.seed_everything(seed)
        model = fabric.setup(Classifier(**MODULE_KWARGS))
        fabric.save(out / f"{strategy}-fabric-{name}.ckpt", {"model": model})
        saved[name] = state(model)

    def fabric_load(mode: Callable[[], Any], name: str) -> Callable[[], nn.Module]:
        def load() -> nn.Module:
            with mode():
                fabric.load(out / f"{strategy}-fabric-{name}.ckpt", {"model": model})
            return model

        return load

    for mode_name, name in zip(GRAD_MODES, "ab", strict=True):  # `model` holds `b`: the first load is of `a`
        cases[f"fabric.load in {mode_name}"] = outcome(fabric_load(GRAD_MODES[mode_name], name), saved[name])
    return cases


def main() -> None:
    out = Path(sys.argv[1])
    results = {strategy: {**trainer_cases(strategy, out), **fabric_cases(strategy, out)} for strategy in STRATEGIES}
    results["grad modes"] = {strategy: grad_mode_cases(strategy, out) for strategy in GRAD_MODE_STRATEGIES}
    (out / f"outcomes-rank{torch.distributed.get_rank()}.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

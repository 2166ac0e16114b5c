"""Runs inside each of N processes (started by tests/launch.py) for tests/test_fabric.py: a hand-written Fabric loop
for every :class:`~tests.scenarios.FabricScenario` under each of its strategies, then the checkpoint exchange of the
:class:`~tests.scenarios.Resume` entries (:class:`~tests.scenarios.Exchange`): each saver trains and writes its
checkpoint, or each resume loads one. Records, per rank, the losses and the module's and optimizer's state, gathered
whole.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric import Fabric
from torch import nn
from torch.nn import functional as F

from lightning_zero._stage3.lazy import LazyTensor
from tests.oracle import full, full_optimizer_state
from tests.scenarios import (
    Clip,
    ClipBy,
    Exchange,
    FabricScenario,
    FrontEnd,
    Resume,
    Saver,
    Setup,
    Source,
    StrategySpec,
    cpu_trainer,
    read_payload,
    save_results,
)
from tests.workers.modules import MODULES, Classifier

WORLD_SIZE = int(os.environ["WORLD_SIZE"])  # read now: Lightning's teardown removes it from the environment
BATCH = 8


def make_fabric(strategy: StrategySpec, precision: str = "32-true") -> Fabric:
    fabric = Fabric(accelerator="cpu", devices=WORLD_SIZE, strategy=strategy.for_fabric(), precision=precision)
    fabric.launch()  # the processes exist already (tests/launch.py): this joins the process group
    return fabric


# --- each module's batches and loss: drawn per rank, fresh every micro-batch ----------------------------------------


def classifier_loss(model: nn.Module, hparams: Any, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(BATCH, hparams.d_in, generator=gen)
    y = torch.randint(0, hparams.classes, (BATCH,), generator=gen)
    return F.cross_entropy(model(x), y)


def language_model_loss(model: nn.Module, hparams: Any, gen: torch.Generator) -> torch.Tensor:
    tokens = torch.randint(0, hparams.vocab, (BATCH, hparams.seq), generator=gen)
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())


LOSSES: dict[str, Callable[[nn.Module, Any, torch.Generator], torch.Tensor]] = {
    "classifier": classifier_loss,
    "tied_lm": language_model_loss,
}


# --- the loop -------------------------------------------------------------------------------------------------------


def build(fabric: Fabric, scenario: FabricScenario, strategy: StrategySpec) -> pl.LightningModule:
    """The scenario's module, seeded alike on every rank; the compared strategies build it inside
    ``fabric.init_module`` when the scenario asks (the reference eagerly: its weights are the oracle)."""
    fabric.seed_everything(scenario.seed, verbose=False)
    module_class = MODULES[scenario.module]
    if not scenario.init_module or strategy == scenario.reference:
        return module_class(**scenario.module_kwargs)
    with fabric.init_module(empty_init=scenario.empty_init):
        return module_class(**scenario.module_kwargs)


def set_up(fabric: Fabric, setup: Setup, module: pl.LightningModule) -> tuple[Any, Any]:
    """The module and the optimizer its ``configure_optimizers`` builds, set up as ``setup`` says."""
    match setup:
        case Setup.TOGETHER:
            return fabric.setup(module, module.configure_optimizers())
        case Setup.SEPARATELY:  # stage 3: the optimizer is built on the shards `setup_module` left in the module
            model = fabric.setup_module(module)
            return model, fabric.setup_optimizers(module.configure_optimizers())


def clip(fabric: Fabric, model: Any, optimizer: Any, how: Clip) -> None:
    match how.by:
        case ClipBy.NORM:
            fabric.clip_gradients(model, optimizer, max_norm=how.value)
        case ClipBy.VALUE:
            fabric.clip_gradients(model, optimizer, clip_val=how.value)


def train(fabric: Fabric, scenario: FabricScenario, model: Any, optimizer: Any) -> list[float]:
    """``scenario.steps`` optimizer steps; every micro-batch but a step's last runs under ``no_backward_sync``."""
    gen = torch.Generator().manual_seed(1000 * (scenario.seed + 1) + fabric.global_rank)
    loss_of, hparams = LOSSES[scenario.module], model.hparams
    losses = []
    for _ in range(scenario.steps):
        for micro in range(scenario.accumulate):
            with fabric.no_backward_sync(model, enabled=micro < scenario.accumulate - 1):
                loss = loss_of(model, hparams, gen)
                fabric.backward(loss / scenario.accumulate)
            losses.append(loss.item())
        if scenario.clip is not None:
            clip(fabric, model, optimizer, scenario.clip)
        optimizer.step()
        optimizer.zero_grad()
    return losses


def snapshot(module: nn.Module, optimizer: Any) -> dict[str, Any]:
    """Copies of the module's state and the optimizer's, sharded tensors gathered whole (a collective: every rank
    calls it). ``optimizer`` is the one the strategy steps (stages 1 and 2: the engine's sharded wrapper)."""
    optimizer_state = full_optimizer_state(optimizer)
    optimizer_state["state"] = {
        index: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in entries.items()}
        for index, entries in optimizer_state["state"].items()
    }
    return {
        "state_dict": {k: full(v).detach().clone() for k, v in module.state_dict().items()},
        "optimizers": [optimizer_state],
        "lrs": [[g["lr"] for g in optimizer.param_groups]],
    }


def run(scenario: FabricScenario, strategy: StrategySpec) -> dict[str, Any]:
    fabric = make_fabric(strategy, scenario.precision)
    module = build(fabric, scenario, strategy)
    built_lazily = sorted(k for k, v in module.state_dict().items() if isinstance(v, LazyTensor))
    model, optimizer = set_up(fabric, scenario.setup, module)
    result: dict[str, Any] = {}
    if scenario.init_module:  # how the module was built, and the weights it started from
        result["built_lazily"] = built_lazily
        result["initial"] = snapshot(model, optimizer.optimizer)["state_dict"]
    losses = train(fabric, scenario, model, optimizer)
    return {**result, "losses": losses, **snapshot(model, optimizer.optimizer)}


# --- checkpoints ----------------------------------------------------------------------------------------------------


def save(saver: Saver, path: Path) -> dict[str, Any]:
    """Train the classifier under the saver's front end and strategy, write its checkpoint to ``path``, and return
    what it saved, gathered whole."""
    if saver.front_end is FrontEnd.TRAINER:
        trainer = trainer_for(saver.strategy, max_steps=saver.steps)
        trainer.fit(Classifier())
        trainer.save_checkpoint(path)
        return snapshot(trainer.lightning_module, trainer.optimizers[0])
    fabric = make_fabric(saver.strategy)
    loop = FabricScenario("saved", strategies=[saver.strategy], steps=saver.steps)
    model, optimizer = set_up(fabric, loop.setup, build(fabric, loop, saver.strategy))
    train(fabric, loop, model, optimizer)
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": saver.steps})
    return {**snapshot(model, optimizer.optimizer), "step": saver.steps}


def load(resume: Resume, path: Path) -> dict[str, Any]:
    """A fresh classifier (other weights than the saver's) and its optimizer, loaded from ``path`` by the resume's
    front end under its strategy; return their state, gathered whole, and what else the checkpoint held."""
    torch.manual_seed(1)
    module = Classifier()
    if resume.front_end is FrontEnd.TRAINER:
        loaded = Loaded()
        trainer = trainer_for(resume.strategy, max_steps=1, callbacks=[loaded])
        trainer.fit(module, ckpt_path=path)
        return loaded.state
    fabric = make_fabric(resume.strategy)
    model, optimizer = set_up(fabric, Setup.SEPARATELY, module)
    state = {"model": model, "optimizer": optimizer}
    if resume.saver.front_end is FrontEnd.FABRIC:
        state["step"] = 0  # the saver's own entry, restored too
    rest = fabric.load(path, state)
    return {**snapshot(model, optimizer.optimizer), "step": state.get("step"), "rest": rest}


class Loaded(pl.Callback):
    """What the Trainer restored, gathered whole, before its first step."""

    state: dict[str, Any]

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.state = snapshot(module, trainer.optimizers[0])


def trainer_for(strategy: StrategySpec, **kwargs: Any) -> pl.Trainer:
    pl.seed_everything(0, verbose=False)
    return cpu_trainer(strategy.for_trainer(), **kwargs)


def checkpoint_path(checkpoints: Path, resume: Resume) -> Path:
    directory = checkpoints / resume.saver.label
    return directory.with_suffix(".ckpt") if resume.source is Source.CONSOLIDATED else directory


# --- main -----------------------------------------------------------------------------------------------------------


def main() -> None:
    out_dir = Path(sys.argv[1])
    payload = read_payload(out_dir)
    checkpoints, resumes = Path(payload["checkpoints"]), payload["resumes"]
    results: dict[Any, Any] = {}
    for scenario in payload["scenarios"]:
        for strategy in scenario.strategies:
            results[(scenario.name, strategy.label)] = run(scenario, strategy)
    match payload["exchange"]:
        case Exchange.SAVE:
            for saver in dict.fromkeys(r.saver for r in resumes):  # each once, in order
                results[("saved", saver.label)] = save(saver, checkpoints / saver.label)
        case Exchange.LOAD:
            for resume in resumes:
                results[("loaded", resume.name)] = load(resume, checkpoint_path(checkpoints, resume))
    save_results(out_dir, int(os.environ["RANK"]), results)


if __name__ == "__main__":
    main()

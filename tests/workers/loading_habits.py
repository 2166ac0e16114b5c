"""Runs inside each of N processes (started by tests/launch.py) for tests/test_loading_habits.py: the ways users load
and hand weights around in a Fabric loop, under ``"ddp"`` and every stage in turn. Each strategy trains the classifier
a step, then loads weights as a LitGPT-style loop does (``model.load_state_dict`` of whole tensors after an
evaluation's forward, ``fabric.load_raw`` of a raw and of a Lightning file, of an optimizer file, ``fabric.load`` of a
file after an evaluation), trains a step after each, and saves and reads back its checkpoint (``fabric.load`` with
and without a ``state``). Records, per rank, each moment's weights gathered whole and the losses.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric import Fabric
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

import lightning_zero.fabric
from lightning_zero import CheckpointError, Zero3Strategy
from tests.oracle import full, full_optimizer_state
from tests.scenarios import cpu_trainer, read_payload, save_results
from tests.workers.modules import Classifier, fabric_step

WORLD_SIZE = int(os.environ.get("WORLD_SIZE", 1))  # read now: Lightning's teardown removes it
BATCH = 8


def whole_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: full(v).detach().clone() for k, v in model.state_dict().items()}


def whole_optimizer_state(optimizer: Any) -> dict[int, dict[str, Any]]:
    """Copies of the optimizer's state, gathered whole (the live tensors change with the next step)."""
    state = full_optimizer_state(optimizer.optimizer)["state"]
    return {i: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()} for i, s in state.items()}


def other_weights(model: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Whole tensors of the model's shapes, drawn from ``seed``: the same on every rank and under every strategy."""
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(full(v).shape, generator=gen) for k, v in model.state_dict().items()}


def evaluate(model: Any) -> None:
    """A forward under ``no_grad``: stage 3 leaves the root unit gathered after it."""
    with torch.no_grad():
        model(torch.randn(2, 12))


def fabric_strategy(label: str) -> Any:
    """``"zero3_full"``: ``Zero3Strategy(state_dict_type="full")``; other labels are registered names."""
    name, _, kind = label.partition("_")
    return getattr(lightning_zero.fabric, f"Zero{name[-1]}Strategy")(state_dict_type=kind) if kind else name


def run(strategy: str, files: Path) -> dict[str, Any]:
    fabric = Fabric(accelerator="cpu", devices=WORLD_SIZE, strategy=fabric_strategy(strategy))
    fabric.launch()
    fabric.seed_everything(0, verbose=False)
    module = Classifier()
    model, optimizer = fabric.setup(module, module.configure_optimizers())
    gen = torch.Generator().manual_seed(100 + fabric.global_rank)
    record: dict[str, Any] = {"losses": [fabric_step(fabric, model, optimizer, gen)]}

    def moment(name: str) -> None:
        record[name] = whole_weights(model)
        record["losses"].append(fabric_step(fabric, model, optimizer, gen))

    evaluate(model)
    model.load_state_dict(other_weights(module, 1))
    moment("load_state_dict")
    fabric.load_raw(files / "raw.pt", model)
    moment("load_raw")
    if strategy == "ddp":  # Fabric's DDP reads a raw state dict only; the equivalent by hand
        model.load_state_dict(torch.load(files / "lightning.ckpt")["state_dict"])
    else:
        fabric.load_raw(files / "lightning.ckpt", model)
    moment("load_raw_lightning_file")
    fabric.load_raw(files / "optimizer.pt", optimizer)
    record["load_raw_optimizer"] = whole_optimizer_state(optimizer)
    evaluate(model)
    fabric.load(files / "fabric_file.pt", {"model": model})
    moment("load_after_evaluation")

    saved = files / f"{strategy}-{WORLD_SIZE}.ckpt"
    fabric.save(saved, {"model": model, "optimizer": optimizer, "iter_num": 7})
    record["saved"] = {"weights": whole_weights(model), "optimizer": whole_optimizer_state(optimizer)}
    record["saved_a_file"] = saved.is_file()
    contents = fabric.load(saved)
    record["load_without_state"] = {
        "keys": sorted(contents),
        "model": {k: full(v) for k, v in contents["model"].items()},
        "optimizer_steps": sorted(float(s["step"]) for s in contents["optimizer"]["state"].values()),
        "iter_num": contents["iter_num"],
    }
    record["load_rest"] = fabric.load(saved, {"model": model, "optimizer": optimizer})
    if strategy == "zero3":
        record["view_warnings"] = {name: view_warnings(name) for name in ("zero3", "zero3_offload")}
    if strategy in ("zero1", "zero2", "zero3"):
        record["misdirected"] = [
            error_of(lambda: fabric.load(files / "raw.pt", {"model": model})),
            error_of(lambda: fabric.load_raw(saved, model)),
        ]
    return record


class ViewOut(nn.Module):
    """A module whose forward returns a view, which torch's ``fully_shard`` warns of."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x).view(-1)


def view_warnings(strategy: str) -> int:
    """How many times torch's warning of a returned view reached this rank's user in three steps under ``strategy``,
    a stage 3: ``fully_shard`` warns of it (offloaded), the package's engine has nothing to warn of."""
    fabric = Fabric(accelerator="cpu", devices=WORLD_SIZE, strategy=strategy)
    fabric.launch()
    model = fabric.setup_module(ViewOut())
    with warnings.catch_warnings(record=True) as caught:
        for _ in range(3):
            fabric.backward(model(torch.randn(2, 4)).sum())
    return sum("returned a view tensor" in str(w.message) for w in caught)


def error_of(load: Callable[[], Any]) -> str:
    try:
        load()
    except CheckpointError as error:
        return str(error)
    raise AssertionError("the load was expected to fail")


def write_files(files: Path) -> None:
    """Rank 0, before the runs: the files every strategy loads, of the classifier's shapes."""
    torch.manual_seed(0)
    module = Classifier()
    torch.save(other_weights(module, 2), files / "raw.pt")
    torch.save({"state_dict": other_weights(module, 3), "epoch": 1, "global_step": 5}, files / "lightning.ckpt")
    torch.save({"model": other_weights(module, 4), "iter_num": 3}, files / "fabric_file.pt")
    optimizer = module.configure_optimizers()
    module(torch.randn(BATCH, 12)).sum().backward()
    optimizer.step()  # Adam's moments and step, for every parameter
    torch.save(optimizer.state_dict(), files / "optimizer.pt")


def main() -> None:
    out_dir = Path(sys.argv[1])
    payload = read_payload(out_dir)
    files = out_dir / "files"
    if int(os.environ["RANK"]) == 0 and not (files / "raw.pt").exists():
        files.mkdir(exist_ok=True)
        write_files(files)
    results: dict[str, Any] = {}
    for strategy in payload["strategies"]:
        results[strategy] = run(strategy, files)  # each run's first collective waits for rank 0's files
    for strategy in payload["strategies"]:
        if strategy.endswith("_full"):
            results[f"ddp_loads_{strategy}"] = ddp_loads(files / f"{strategy}-{WORLD_SIZE}.ckpt")
    if payload["trainer"]:
        results["best_model_paths"] = {kind: best_model_path(out_dir / kind, kind) for kind in ("full", "sharded")}
    save_results(out_dir, int(os.environ["RANK"]), results)


def ddp_loads(path: Path) -> dict[str, Any]:
    """A fresh classifier and optimizer under Fabric's ``"ddp"``, loaded from a full checkpoint file of ours."""
    fabric = Fabric(accelerator="cpu", devices=WORLD_SIZE, strategy="ddp")
    fabric.launch()
    torch.manual_seed(1)
    module = Classifier()
    model, optimizer = fabric.setup(module, module.configure_optimizers())
    rest = fabric.load(path, {"model": model, "optimizer": optimizer})
    return {"weights": whole_weights(model), "optimizer": whole_optimizer_state(optimizer), "rest": rest}


def best_model_path(directory: Path, kind: str) -> str:
    """Fit the classifier under stage 3 writing ``kind`` checkpoints with ``ModelCheckpoint``; its best one's path."""
    pl.seed_everything(0, verbose=False)
    checkpoint = ModelCheckpoint(dirpath=directory, monitor="val_loss", save_top_k=1)
    trainer = cpu_trainer(
        Zero3Strategy(state_dict_type=kind),
        max_epochs=2,
        limit_train_batches=3,
        limit_val_batches=2,
        callbacks=[checkpoint],
        enable_checkpointing=True,  # QUIET turns it off; the ModelCheckpoint above needs it
    )
    trainer.fit(Classifier())
    return checkpoint.best_model_path


if __name__ == "__main__":
    main()

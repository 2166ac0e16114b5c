"""Runs inside each of N processes (started by tests/launch.py) for tests/test_peer_habits.py: what users of Lightning's
``FSDPStrategy``, ``ModelParallelStrategy`` and ``DeepSpeedStrategy`` write against their strategy, run under ``"ddp"``
and each stage in turn. Records, per rank and strategy, what each call returned or raised.
"""

from __future__ import annotations

import math
import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from lightning.fabric import Fabric
from lightning.pytorch import LightningModule
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

import lightning_zero
import lightning_zero.fabric
from lightning_zero import CheckpointError
from lightning_zero._checkpoint.keys import SHARDED_KEYS
from lightning_zero._core.optimizers import unwrap
from lightning_zero._wrap import CheckpointedForward
from tests.oracle import full, full_optimizer_state
from tests.scenarios import cpu_trainer, read_payload, save_results
from tests.workers.modules import Classifier, ManualClassifier, fabric_step

WORLD_SIZE = int(os.environ.get("WORLD_SIZE", 1))  # read now: Lightning's teardown removes it
RANK = int(os.environ.get("RANK", 0))
STEPS = 4
# DeepSpeed's WarmupDecayLR with these parameters, written out as a multiplier of `DS_LR` for "ddp"'s LambdaLR
DS_SCHEDULE = {"total_num_steps": 6, "warmup_min_lr": 0.001, "warmup_max_lr": 0.02, "warmup_num_steps": 3}
DS_CONFIG = {
    "zero_optimization": {"stage": 2},
    "gradient_clipping": 0.0,
    "optimizer": {"type": "Adam", "params": {"lr": 0.02, "betas": [0.8, 0.99], "weight_decay": 0.01}},
    "scheduler": {"type": "WarmupDecayLR", "params": DS_SCHEDULE},
}


def trainer_strategy(name: str, **options: Any) -> Any:
    """``"ddp"`` or ``"zeroN"`` with ``options`` (none for ``"ddp"``)."""
    if name == "ddp":
        return "ddp"
    return getattr(lightning_zero, f"Zero{name[-1]}Strategy")(**options)


def fabric_strategy(name: str, **options: Any) -> Any:
    if name == "ddp":
        return "ddp"
    return getattr(lightning_zero.fabric, f"Zero{name[-1]}Strategy")(**options)


def host(value: Any) -> Any:
    """``value`` with every tensor a detached host copy, DTensors kept as what they are (their local rows)."""
    if isinstance(value, dict):
        return {k: host(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(host(v) for v in value)
    if isinstance(value, DTensor):
        return {"dtensor_rows": value.to_local().detach().clone(), "shape": tuple(value.shape)}
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    return value


# --- the Trainer --------------------------------------------------------------------------------------------------


def full_state_dicts(name: str, out: Path) -> dict[str, Any]:
    """``state_dict_type="full"``: what ``lightning_module_state_dict`` and ``optimizer_state`` return after ``fit``,
    and the keys of the file ``trainer.save_checkpoint`` writes."""
    torch.manual_seed(0)
    model = Classifier()
    options = {} if name == "ddp" else {"state_dict_type": "full"}
    trainer = cpu_trainer(trainer_strategy(name, **options), max_steps=STEPS)
    trainer.fit(model)
    path = Path(trainer.strategy.broadcast(str(out / f"{name}_full.ckpt")))
    trainer.save_checkpoint(path)
    got = {
        "module": host(trainer.strategy.lightning_module_state_dict()),
        "optimizer": host(trainer.strategy.optimizer_state(trainer.optimizers[0])),
    }
    if RANK == 0:
        saved = torch.load(path, weights_only=True)
        got["file_keys"] = sorted(saved)
        got["file_optimizer_keys"] = sorted(saved["optimizer_states"][0])
    return got


def sharded_state_dicts(name: str) -> dict[str, Any]:
    """``state_dict_type="sharded"`` (the default): every rank's own entries."""
    torch.manual_seed(0)
    model = Classifier()
    trainer = cpu_trainer(trainer_strategy(name), max_steps=STEPS)
    trainer.fit(model)
    state = trainer.strategy.lightning_module_state_dict()
    optimizer = trainer.strategy.optimizer_state(trainer.optimizers[0])
    return {"module_types": {k: type(v).__name__ for k, v in state.items()}, "optimizer_keys": sorted(optimizer)}


def test_in_inference_mode(name: str) -> dict[str, Any]:
    """``trainer.test`` inside the user's ``torch.inference_mode()`` after ``fit``, Lightning's teardown included."""
    torch.manual_seed(0)
    model = Classifier()
    trainer = cpu_trainer(trainer_strategy(name), max_steps=STEPS)
    trainer.fit(model)
    with torch.inference_mode():
        metrics = trainer.test(model, verbose=False)
    return {"metrics": metrics, "weights": {k: full(v).detach().clone() for k, v in model.state_dict().items()}}


class ForeignOptimizer(Classifier):
    """``configure_optimizers`` builds its optimizer on a layer that is not part of the module."""

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(nn.Linear(4, 5).parameters(), lr=1e-2)


def foreign_parameters(name: str) -> dict[str, Any]:
    torch.manual_seed(0)
    trainer = cpu_trainer(trainer_strategy(name), max_steps=2)
    try:
        trainer.fit(ForeignOptimizer())
    except ValueError as error:
        return {"error": str(error)}
    return {"error": None}


class Wrapped(Classifier):
    """The middle layer checkpointed by the model itself, as a user of ``FSDPStrategy`` writes it."""

    def __init__(self) -> None:
        super().__init__()
        self.mid = checkpoint_wrapper(self.mid)


def own_checkpoint_wrappers(name: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = Wrapped()
    options = {} if name == "ddp" else {"activation_checkpointing": {nn.Linear}}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = cpu_trainer(trainer_strategy(name, **options), max_steps=STEPS)
        trainer.fit(model)
    messages = [str(w.message) for w in caught if "activation_checkpointing" in str(w.message)]
    checkpointed = [n for n, m in model.named_modules() if isinstance(m.__dict__.get("forward"), CheckpointedForward)]
    weights = {k: full(v).detach().clone() for k, v in model.state_dict().items()}
    return {"warnings": messages, "checkpointed": checkpointed, "weights": weights, "losses": list(model.losses)}


class DeepSpeedLikeOptimizer(Classifier):
    """For ``"ddp"``: the objects DeepSpeed builds for :data:`DS_CONFIG`, written by hand: AdamW (DeepSpeed's "Adam")
    and the WarmupDecayLR formula as a multiplier of the optimizer's lr."""

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=DS_LR, betas=(0.8, 0.99), weight_decay=0.01)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: warmup_decay_lr(step - 1) / DS_LR)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])


DS_LR = 0.02


def warmup_decay_lr(iteration: int) -> float:
    """DeepSpeed's WarmupDecayLR at ``iteration`` (-1 before the first step): a log warm-up from ``warmup_min_lr`` to
    ``warmup_max_lr`` over ``warmup_num_steps``, then linear to 0 at ``total_num_steps``."""
    low, high = DS_SCHEDULE["warmup_min_lr"], DS_SCHEDULE["warmup_max_lr"]
    warm, total = DS_SCHEDULE["warmup_num_steps"], DS_SCHEDULE["total_num_steps"]
    if iteration < 0:
        return low
    if iteration < warm:
        gamma = math.log(iteration + 1) / math.log(warm)
    else:
        gamma = max(0.0, (total - iteration) / max(1.0, total - warm))
    return low + (high - low) * gamma


def deepspeed_optimizer(name: str, out: Path) -> dict[str, Any]:
    """``"ddp"`` with :class:`DeepSpeedLikeOptimizer`; ``"zero2"`` from :data:`DS_CONFIG` (the JSON file the test
    wrote), whose ``optimizer`` takes the place of the module's ``configure_optimizers``."""
    torch.manual_seed(0)
    model = DeepSpeedLikeOptimizer()
    model.lrs = []
    strategy = "ddp" if name == "ddp" else lightning_zero.ZeroStrategy(deepspeed_config=out / "ds_config.json")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = cpu_trainer(strategy, max_steps=STEPS + 2)
        trainer.fit(model)
    return {
        "lrs": list(model.lrs),
        "optimizer_class": type(unwrap(trainer.optimizers[0])).__name__,
        "warned": any("takes the place of `configure_optimizers`" in str(w.message) for w in caught),
        "weights": {k: full(v).detach().clone() for k, v in model.state_dict().items()},
        "losses": list(model.losses),
    }


class Recurrent(LightningModule):
    """An LSTM over short sequences, its last output classified: a module whose forward reads its parameters through
    the LSTM's own list of them."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(6, 10, num_layers=2, batch_first=True)
        self.head = nn.Linear(10, 3)
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        out, _ = self.lstm(x)
        loss = nn.functional.cross_entropy(self.head(out[:, -1]), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-2)

    def train_dataloader(self) -> DataLoader:
        gen = torch.Generator().manual_seed(5)
        return DataLoader(
            TensorDataset(torch.randn(64, 5, 6, generator=gen), torch.randint(0, 3, (64,), generator=gen)), batch_size=8
        )


def recurrent(name: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = Recurrent()
    cpu_trainer(trainer_strategy(name), max_steps=STEPS).fit(model)
    return {"weights": {k: full(v).detach().clone() for k, v in model.state_dict().items()}, "losses": model.losses}


class SkipsOddSteps(Classifier):
    """``training_step`` returns ``None`` on odd batches."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        loss = super().training_step(batch, batch_idx)
        return None if batch_idx % 2 else loss


def skipped_steps(name: str) -> dict[str, Any]:
    """Lightning refuses a skipped step in distributed training: the same error under every strategy."""
    torch.manual_seed(0)
    try:
        cpu_trainer(trainer_strategy(name), max_steps=STEPS).fit(SkipsOddSteps())
    except RuntimeError as error:
        return {"error": str(error)}
    return {"error": None}


class BuiltInConfigureModel(Classifier):
    """The output layer built in ``configure_model``; records its parameters' dtype and device there and at
    ``on_fit_start``."""

    def configure_model(self) -> None:
        self.head = nn.Linear(4, 4)
        self.seen = {"configure_model": (self.head.weight.dtype, self.head.weight.device.type)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(super().forward(x))

    def on_fit_start(self) -> None:
        self.seen["on_fit_start"] = (self.head.weight.dtype, self.head.weight.device.type)


def configure_model_dtype(name: str) -> dict[str, Any]:
    """Under each precision flag, the layers of ``configure_model`` have the flag's dtype, there and once set up."""
    seen = {}
    for precision in ("bf16-true", "32-true"):
        torch.manual_seed(0)
        model = BuiltInConfigureModel()
        cpu_trainer(trainer_strategy(name), max_steps=1, precision=precision).fit(model)
        seen[precision] = model.seen
    return seen


def optimizer_count(name: str, out: Path) -> dict[str, Any]:
    """Resuming a file of one optimizer's state with two optimizers configured: refused by name."""
    path = out / "one_optimizer.ckpt"
    torch.manual_seed(0)
    trainer = cpu_trainer("ddp" if name == "ddp" else trainer_strategy(name, state_dict_type="full"), max_steps=1)
    trainer.fit(Classifier())
    trainer.save_checkpoint(path)
    trainer = cpu_trainer(trainer_strategy(name), max_steps=2)
    try:
        trainer.fit(ManualClassifier(two_optimizers=True), ckpt_path=path)
    except CheckpointError as error:
        return {"error": str(error)}
    return {"error": None}


def storage_options(name: str, out: Path) -> dict[str, Any]:
    """``trainer.save_checkpoint(..., storage_options=...)``: refused, as ``FSDPStrategy`` refuses it."""
    trainer = cpu_trainer(trainer_strategy(name), max_steps=1)
    trainer.fit(Classifier())
    try:
        trainer.save_checkpoint(out / f"{name}_options.ckpt", storage_options={"compress": True})
    except TypeError as error:
        return {"error": str(error)}
    return {"error": None}


# --- Fabric -------------------------------------------------------------------------------------------------------


def fabric_run(strategy: Any) -> tuple[Fabric, Any, Any]:
    fabric = Fabric(accelerator="cpu", devices=WORLD_SIZE, strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    model, optimizer = fabric.setup(*_module_and_optimizer())
    gen = torch.Generator().manual_seed(100 + fabric.global_rank)
    for _ in range(2):
        fabric_step(fabric, model, optimizer, gen)
    return fabric, model, optimizer


def _module_and_optimizer() -> tuple[nn.Module, torch.optim.Optimizer]:
    module = Classifier()
    return module, torch.optim.Adam(module.parameters(), lr=1e-2)


def whole_torch_optimizer_state(model: Any, optimizer: Any) -> dict[str, Any]:
    """torch's ``get_optimizer_state_dict`` on Fabric's objects, whole on every rank."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return host(get_optimizer_state_dict(model, optimizer, options=options))


def fabric_full_file(name: str, out: Path) -> dict[str, Any]:
    """``fabric.save`` of one file (``state_dict_type="full"``), read back by ``torch.load`` and by ``fabric.load``;
    torch's ``get_optimizer_state_dict`` on Fabric's objects before and after."""
    options = {} if name == "ddp" else {"state_dict_type": "full"}
    fabric, model, optimizer = fabric_run(fabric_strategy(name, **options))
    before = whole_torch_optimizer_state(model, optimizer)
    path = Path(fabric.broadcast(str(out / f"{name}_fabric.pt")))
    fabric.save(path, {"model": model, "optimizer": optimizer, "steps": 1})
    got: dict[str, Any] = {"before": before, "round_trip": _round_trip(optimizer)}
    if fabric.global_rank == 0:
        saved = torch.load(path, weights_only=True)
        got["file_keys"], got["file_optimizer_keys"] = sorted(saved), sorted(saved["optimizer"])
    fabric.barrier()
    fabric2, model2, optimizer2 = fabric_run(fabric_strategy(name))
    got["remainder"] = fabric2.load(path, {"model": model2, "optimizer": optimizer2})
    got["after"] = whole_torch_optimizer_state(model2, optimizer2)
    return got


def _round_trip(optimizer: Any) -> bool:
    """Whether the optimizer takes back what its ``state_dict()`` gives, as any torch optimizer does."""
    state = optimizer.state_dict()
    optimizer.load_state_dict(state)
    return sorted(state) == ["param_groups", "state"] and all(isinstance(k, int) for k in state["state"])


def earlier_full_file(name: str, out: Path) -> dict[str, Any]:
    """A full file of an earlier release, with the record of sharded entries inside the optimizer state, loads as
    the same file without it does."""
    fabric, model, optimizer = fabric_run(fabric_strategy(name, state_dict_type="full"))
    path = Path(fabric.broadcast(str(out / f"{name}_new.pt")))
    fabric.save(path, {"model": model, "optimizer": optimizer})
    old = path.with_name(f"{name}_earlier.pt")
    if fabric.global_rank == 0:
        saved = torch.load(path, weights_only=True)
        state = saved["optimizer"]["state"]
        saved["optimizer"][SHARDED_KEYS] = {i: [k for k in s if k != "step"] for i, s in state.items()}
        torch.save(saved, old)
    fabric.barrier()
    loaded = {}
    for label, source in (("new", path), ("earlier", old)):
        fabric2, model2, optimizer2 = fabric_run(fabric_strategy(name))
        fabric2.load(source, {"model": model2, "optimizer": optimizer2})
        loaded[label] = host(full_optimizer_state(optimizer2.optimizer))
    return loaded


def save_filter(name: str, out: Path) -> dict[str, Any]:
    """``fabric.save(path, state, filter=...)`` keeps only the module's weights that pass the filter, as ``"ddp"``
    does, in a single file and in a directory (read back whole by ``fabric.load(path)``)."""
    kept: dict[str, Any] = {}
    kinds = ["full"] if name == "ddp" else ["full", "sharded"]
    for kind in kinds:
        options = {} if name == "ddp" else {"state_dict_type": kind}
        fabric, model, optimizer = fabric_run(fabric_strategy(name, **options))
        path = Path(fabric.broadcast(str(out / f"{name}_{kind}_filtered")))
        state = {"model": model, "optimizer": optimizer, "steps": 3}
        fabric.save(path, state, filter={"model": lambda key, value: key.endswith("weight")})
        loaded = fabric.load(path)
        kept[kind] = {"model": sorted(loaded["model"]), "others": sorted(k for k in loaded if k != "model")}
    return kept


def compiled_fabric(name: str, out: Path) -> dict[str, Any]:
    """``fabric.setup(torch.compile(model), optimizer)``: Fabric sets up the module inside and compiles it again over
    what the strategy made of it (``aot_eager``: no C++ toolchain needed); three steps, then one file of it."""
    options = {} if name == "ddp" else {"state_dict_type": "full"}
    fabric = Fabric(accelerator="cpu", devices=WORLD_SIZE, strategy=fabric_strategy(name, **options))
    fabric.launch()
    torch.manual_seed(0)
    module, optimizer = _module_and_optimizer()
    model, optimizer = fabric.setup(torch.compile(module, backend="aot_eager"), optimizer)
    gen = torch.Generator().manual_seed(100 + fabric.global_rank)
    losses = [fabric_step(fabric, model, optimizer, gen) for _ in range(3)]
    weights = {k: full(v).detach().clone() for k, v in model.state_dict().items()}
    path = Path(fabric.broadcast(str(out / f"{name}_compiled.pt")))
    fabric.save(path, {"model": model})
    saved = sorted(torch.load(path, weights_only=True)["model"]) if fabric.global_rank == 0 else None
    return {"compiled": type(model._forward_module).__name__, "losses": losses, "weights": weights, "saved": saved}


def local_scheme(name: str, out: Path) -> dict[str, Any]:
    """``fabric.save("local://<absolute path>")`` and ``fabric.load`` of it, sharded and full; an ``s3://`` path."""
    got: dict[str, Any] = {}
    for kind in ("sharded", "full"):
        fabric, model, optimizer = fabric_run(fabric_strategy(name, state_dict_type=kind))
        url = fabric.broadcast("local://" + str(out / f"{name}_{kind}_local"))
        fabric.save(url, {"model": model, "optimizer": optimizer, "steps": 5})
        state = {"model": model, "optimizer": optimizer, "steps": 0}
        fabric.load(url, state)
        got[kind] = {"steps": state["steps"], "exists": Path(url.removeprefix("local://")).exists()}
    try:
        fabric.save("s3://bucket/checkpoint", {"model": model})
    except ValueError as error:
        got["remote"] = str(error)
    got["stray"] = sorted(str(p) for p in Path.cwd().glob("local:*"))
    return got


RUNS: dict[str, Callable[..., dict[str, Any]]] = {
    "full_state_dicts": full_state_dicts,
    "sharded_state_dicts": lambda name, out: sharded_state_dicts(name),
    "test_in_inference_mode": lambda name, out: test_in_inference_mode(name),
    "foreign_parameters": lambda name, out: foreign_parameters(name),
    "own_checkpoint_wrappers": lambda name, out: own_checkpoint_wrappers(name),
    "deepspeed_optimizer": deepspeed_optimizer,
    "fabric_full_file": fabric_full_file,
    "earlier_full_file": earlier_full_file,
    "local_scheme": local_scheme,
    "recurrent": lambda name, out: recurrent(name),
    "skipped_steps": lambda name, out: skipped_steps(name),
    "storage_options": storage_options,
    "save_filter": save_filter,
    "configure_model_dtype": lambda name, out: configure_model_dtype(name),
    "optimizer_count": optimizer_count,
    "compiled_fabric": compiled_fabric,
}


def main() -> None:
    out = Path(sys.argv[1])
    payload = read_payload(out)
    results: dict[str, dict[str, Any]] = {}
    for run, names in payload["runs"].items():
        for name in names:
            results.setdefault(run, {})[name] = RUNS[run](name, out)
    save_results(out, RANK, results)


if __name__ == "__main__":
    main()

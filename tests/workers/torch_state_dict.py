"""Runs inside each of N processes (started by tests/launch.py) for tests/test_torch_state_dict.py: torch's own
``torch.distributed.checkpoint.state_dict`` functions on the module and optimizer a Fabric strategy returns, under
``"ddp"`` and every stage in turn.

Each strategy trains the classifier a step, then takes full state dicts (``full_state_dict=True, cpu_offload=True``:
rank 0 alone holds them), sets other full ones (every rank holding them, then rank 0 alone with
``broadcast_from_rank0=True``) and trains a step after each. Records, per rank, what the getters returned, the
weights and optimizer state after each set, gathered whole, and the losses.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
from lightning.fabric import Fabric
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from lightning_zero.fabric import Zero2Strategy
from tests.oracle import full, full_optimizer_state
from tests.scenarios import read_payload, save_results
from tests.workers.modules import Classifier, fabric_step

WORLD_SIZE = int(os.environ.get("WORLD_SIZE", 1))  # read now: Lightning's teardown removes it
BATCH = 8
GATHERED = StateDictOptions(full_state_dict=True, cpu_offload=True)
EVERY_RANK = StateDictOptions(full_state_dict=True)
FROM_RANK_ZERO = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)


def other_state(seed: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A classifier's weights and Adam state after one step, drawn from ``seed``, keyed by parameter name as torch's
    full state dicts are: the same on every rank and under every strategy."""
    torch.manual_seed(seed)
    module = Classifier()
    optimizer = torch.optim.Adam(module.parameters(), lr=1e-2)
    module(torch.randn(BATCH, 12)).sum().backward()
    optimizer.step()
    names = [name for name, _ in module.named_parameters()]
    state = optimizer.state_dict()
    named = {names[i]: entries for i, entries in state["state"].items()}
    groups = [{**group, "params": [names[i] for i in group["params"]]} for group in state["param_groups"]]
    return module.state_dict(), {"state": named, "param_groups": groups}


def whole(model: Any, optimizer: Any) -> dict[str, Any]:
    weights = {k: full(v).detach().clone() for k, v in model.state_dict().items()}
    state = full_optimizer_state(optimizer.optimizer)["state"]
    copied = {i: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()} for i, s in state.items()}
    return {"weights": weights, "optimizer": copied}


def copied(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: copied(v) for k, v in value.items()}
    if isinstance(value, list):
        return [copied(v) for v in value]
    return value


def make_fabric(label: str) -> Fabric:
    """``"zero2_master"``: bf16 weights, fp32 master shards the optimizer steps on; other labels are registered
    names."""
    if label == "zero2_master":
        strategy = Zero2Strategy(master_weights=True)
        return Fabric(accelerator="cpu", devices=WORLD_SIZE, strategy=strategy, precision="bf16-true")
    return Fabric(accelerator="cpu", devices=WORLD_SIZE, strategy=label)


def run(strategy: str) -> dict[str, Any]:
    fabric = make_fabric(strategy)
    fabric.launch()
    fabric.seed_everything(0, verbose=False)
    classifier = Classifier()
    model, optimizer = fabric.setup(classifier, torch.optim.Adam(classifier.parameters(), lr=1e-2))
    module, set_up = model.module, optimizer.optimizer  # what the strategy returned
    gen = torch.Generator().manual_seed(100 + fabric.global_rank)
    losses = [fabric_step(fabric, model, optimizer, gen)]
    record: dict[str, Any] = {"losses": losses, "trained": whole(model, optimizer)}
    got = {
        "model": get_model_state_dict(module, options=GATHERED),
        "optimizer": get_optimizer_state_dict(module, set_up, options=GATHERED),
    }
    record["got"] = copied(got)  # on a CPU module the values may alias the live tensors, which the sets below change
    for name, options, seed in (("every_rank", EVERY_RANK, 1), ("from_rank_zero", FROM_RANK_ZERO, 2)):
        weights, optimizer_state = other_state(seed)
        if options.broadcast_from_rank0 and fabric.global_rank != 0:
            weights, optimizer_state = {}, {}
        set_model_state_dict(module, weights, options=options)
        set_optimizer_state_dict(module, set_up, optimizer_state, options=options)
        record[name] = whole(model, optimizer)
        # what the optimizer steps on: the fp32 masters where there are, as the strategy saves them
        masters = fabric.strategy.get_module_state_dict(module)
        record[name]["masters"] = {k: full(v).detach().clone() for k, v in masters.items()}
        record["losses"].append(fabric_step(fabric, model, optimizer, gen))
    return record


def main() -> None:
    out_dir = Path(sys.argv[1])
    strategies = read_payload(out_dir)["strategies"]
    save_results(out_dir, int(os.environ["RANK"]), {strategy: run(strategy) for strategy in strategies})


if __name__ == "__main__":
    main()

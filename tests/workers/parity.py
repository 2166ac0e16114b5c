"""Runs inside each of N processes (started by tests/launch.py): trains every scenario under every strategy and
saves what rank 0 ends with, and what every rank measured, for the test to compare."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

import lightning_zero  # noqa: F401  (registers the strategy names)
from tests.workers.modules import MODULES


def run(scenario: dict[str, Any], strategy: str) -> dict[str, Any]:
    pl.seed_everything(scenario.get("seed", 0), workers=True)
    module = MODULES[scenario["module"]](**scenario.get("module_kwargs", {}))
    trainer_kwargs = dict(
        accelerator="cpu",
        devices=int(scenario["world_size"]),
        strategy=strategy,
        max_steps=scenario.get("max_steps", 6),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=scenario.get("limit_val_batches", 0),
    )
    trainer_kwargs.update(scenario.get("trainer_kwargs", {}))
    trainer = pl.Trainer(**trainer_kwargs)
    trainer.fit(module)
    result: dict[str, Any] = {
        "losses": list(module.losses),
        "state_dict": {k: v.detach().clone() for k, v in module.state_dict().items()},
        "optimizers": [trainer.strategy.optimizer_state(opt) for opt in trainer.optimizers],
        "lrs": [[g["lr"] for g in opt.param_groups] for opt in trainer.optimizers],
        "callback_metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
    }
    for fn in scenario.get("after_fit", []):
        if fn == "predict":
            preds = trainer.predict(module)
            result["predict"] = torch.cat(preds) if preds else None
        else:
            result[fn] = getattr(trainer, fn)(module, verbose=False)
    return result


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    out_dir = Path(sys.argv[2])
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else None
    results = {}
    for scenario in spec:
        for strategy in scenario["strategies"]:
            results[(scenario["name"], strategy)] = run(scenario, strategy)
            rank = torch.distributed.get_rank()
    torch.save(results, out_dir / f"rank{rank}.pt")


if __name__ == "__main__":
    main()

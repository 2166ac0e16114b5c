"""Runs inside each of N processes (started by tests/launch.py): trains a module under ``zero3`` in one Trainer after
another, then in one Fabric after another, and records whether each finished module is freed once the user drops it,
and whether the process is then as it was before the runs: a ``fully_shard`` model of the user's own trains to the same
weights as before them, and torch's collectives, its c10d logger and the warnings filters are what they were. Fabric
never tears its strategy down: its runs end with what its users do (the next run, the modules dropped). Last, the
stall watchdog's thread ends once the process group is destroyed.

``python -m tests.workers.lifetime OUT``
"""

from __future__ import annotations

import gc
import json
import logging
import sys
import time
import warnings
import weakref
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader

from lightning_zero._watchdog import watchdog
from tests.scenarios import cpu_trainer
from tests.workers.modules_zero3 import TiedLM, token_data


def train_once() -> weakref.ref[TiedLM]:
    module = TiedLM()
    cpu_trainer("zero3", 2, num_sanity_val_steps=0).fit(module)
    return weakref.ref(module)


def train_once_with_fabric() -> weakref.ref[TiedLM]:
    """Two steps of a Fabric loop; the Fabric, its module and optimizer dropped when it returns."""
    fabric = Fabric(accelerator="cpu", devices=2, strategy="zero3")
    fabric.launch()  # the process group exists: it joins it
    module = TiedLM()
    model, optimizer = fabric.setup(module, torch.optim.AdamW(module.parameters(), lr=1e-2))
    for (tokens,) in list(DataLoader(token_data(16, 9, 29, 11), batch_size=8)):
        logits = model(tokens[:, :-1])
        fabric.backward(F.cross_entropy(logits.reshape(-1, 29), tokens[:, 1:].reshape(-1)))
        optimizer.step()
        optimizer.zero_grad()
    return weakref.ref(module)


def users_own_fully_shard_model() -> list[torch.Tensor]:
    """A model the user shards by hand on the default group, trained 3 SGD steps: its full weights."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    for layer in (model[0], model[2], model):
        fully_shard(layer)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(3):
        loss = model(torch.randn(4, 8, generator=generator)).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return [p.full_tensor().detach().clone() for p in model.parameters()]


def process_wide_state() -> dict[str, Any]:
    """What a strategy could leave behind in the process: the module-level collectives of ``fully_shard``'s parameter
    group, the handlers of torch's c10d logger, the warnings filters."""
    from torch.distributed import c10d_logger
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as param_group

    logger = getattr(c10d_logger, "_c10d_logger", logging.getLogger())
    return {
        "collectives": (param_group.foreach_all_gather, param_group.foreach_reduce),
        "c10d handlers": list(logger.handlers),
        "warnings filters": list(warnings.filters),
    }


def runs(train: Any, before: list[torch.Tensor], state_before: dict[str, Any]) -> dict[str, Any]:
    """Three runs of ``train``, then what they left: which modules live on, what process-wide state changed, and
    whether the user's own model trains as before."""
    finished = [train() for _ in range(3)]
    gc.collect()
    alive = [ref() is not None for ref in finished]
    changed = [name for name, value in process_wide_state().items() if value != state_before[name]]
    after = users_own_fully_shard_model()
    same_weights = all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    return {"alive": alive, "changed": changed, "same weights": same_weights}


def main(out: Path) -> None:
    dist.init_process_group("gloo")  # the runs below join it, as they would a launcher's
    before = users_own_fully_shard_model()
    state_before = process_wide_state()
    result = {"trainer": runs(train_once, before, state_before), "fabric": runs(train_once_with_fabric, before,
                                                                                 state_before)}  # fmt: skip
    rank = dist.get_rank()
    dist.destroy_process_group()
    deadline = time.monotonic() + 5
    while watchdog._WATCHER is not None and watchdog._WATCHER.alive and time.monotonic() < deadline:
        time.sleep(0.05)
    result["watchdog thread after the group"] = "alive" if watchdog._WATCHER and watchdog._WATCHER.alive else "ended"
    (out / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]))

"""Runs inside each of N processes (started by tests/launch.py): trains a module under ``zero3`` in one Trainer after
another and records whether each finished module is freed once the user drops it, and whether the process is then as
it was before the fits: a ``fully_shard`` model of the user's own trains to the same weights as before them, and
torch's collectives, its c10d logger and the warnings filters are what they were.

``python -m tests.workers.lifetime OUT``
"""

from __future__ import annotations

import gc
import json
import logging
import sys
import warnings
import weakref
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

from tests.scenarios import cpu_trainer
from tests.workers.modules_zero3 import TiedLM


def train_once() -> weakref.ref[TiedLM]:
    module = TiedLM()
    cpu_trainer("zero3", 2, num_sanity_val_steps=0).fit(module)
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


def main(out: Path) -> None:
    dist.init_process_group("gloo")  # the fits below join it, as they would a launcher's
    before = users_own_fully_shard_model()
    state_before = process_wide_state()
    finished = [train_once() for _ in range(3)]
    gc.collect()
    alive = [ref() is not None for ref in finished]
    changed = [name for name, value in process_wide_state().items() if value != state_before[name]]
    after = users_own_fully_shard_model()
    same_weights = all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    result = {"alive": alive, "changed": changed, "same weights": same_weights}
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]))

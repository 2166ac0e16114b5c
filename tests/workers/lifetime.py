"""Runs inside each of N processes (started by tests/launch.py): trains a module under ``zero3`` in one Trainer after
another and records whether each finished module is freed once the user drops it.

``python -m tests.workers.lifetime OUT``
"""

from __future__ import annotations

import gc
import json
import sys
import weakref
from pathlib import Path

import torch.distributed as dist

from tests.scenarios import cpu_trainer
from tests.workers.modules_zero3 import TiedLM


def train_once() -> weakref.ref[TiedLM]:
    module = TiedLM()
    cpu_trainer("zero3", 2, num_sanity_val_steps=0).fit(module)
    return weakref.ref(module)


def main(out: Path) -> None:
    finished = [train_once() for _ in range(3)]
    gc.collect()
    alive = [ref() is not None for ref in finished]
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(alive))


if __name__ == "__main__":
    main(Path(sys.argv[1]))

"""The parts of Lightning's interface that differ between the releases this package supports, in one place: each
says what changed and what the older releases get.

- Fabric's ``setup_module_and_optimizers``: Lightning 2.6 passes a learning-rate scheduler along and takes back three
  values; older releases pass none and take two (:func:`set_up_together`).
- loading a checkpoint file (:func:`load_file`): Lightning 2.6 passes the user's ``weights_only`` on to
  ``torch.load``; older releases take no such argument and always load the whole pickle (``weights_only=False``).
- ``weights_only`` itself (:data:`TAKES_WEIGHTS_ONLY`): Lightning 2.6 takes it in ``Trainer.fit`` (and its other
  entry points), ``fabric.load`` and the strategies' ``load_checkpoint``; older releases in none of them, and their
  loads reach a strategy without it (``None``: torch's default).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning.fabric.strategies import Strategy
from torch import nn
from torch.optim import Optimizer

_SETUP_TAKES_SCHEDULER = "scheduler" in inspect.signature(Strategy.setup_module_and_optimizers).parameters
TAKES_WEIGHTS_ONLY = "weights_only" in inspect.signature(Strategy.load_checkpoint).parameters
"""Whether the installed Lightning's loads take a ``weights_only`` (2.6 on)."""


def set_up_together(module: nn.Module, optimizers: list[Optimizer], scheduler: Any | None) -> tuple[Any, ...]:
    """What Fabric's ``setup_module_and_optimizers`` returns in the installed release."""
    return (module, optimizers, scheduler) if _SETUP_TAKES_SCHEDULER else (module, optimizers)


def load_file(load: Callable[..., Any], path: Path, weights_only: bool | None) -> Any:
    """``load(path)`` (a checkpoint IO's or a strategy's ``load_checkpoint``), with ``weights_only`` where the
    installed Lightning takes it."""
    if "weights_only" in inspect.signature(load).parameters:
        return load(path, weights_only=weights_only)
    return load(path)


__all__ = ["TAKES_WEIGHTS_ONLY", "load_file", "set_up_together"]

"""The optimizers the front ends hand the core, out of their wrappers: Lightning's ``LightningOptimizer``, Fabric's
``_FabricOptimizer`` and, in stages 1 and 2, this package's :class:`~lightning_zero._engine.optimizer.ZeroOptimizer`."""

from __future__ import annotations

from lightning.fabric.wrappers import _FabricOptimizer
from lightning.pytorch.core.optimizer import LightningOptimizer
from torch.optim import Optimizer

from lightning_zero._engine.optimizer import ZeroOptimizer


def as_set_up(optimizer: Optimizer) -> Optimizer:
    """The optimizer as the strategy set it up (a :class:`ZeroOptimizer` in stages 1 and 2), out of the front ends'
    wrappers: Lightning's ``LightningOptimizer`` and Fabric's ``_FabricOptimizer`` both keep it as ``_optimizer``."""
    while isinstance(optimizer, (LightningOptimizer, _FabricOptimizer)):
        optimizer = optimizer._optimizer
    return optimizer


def unwrap(optimizer: Optimizer) -> Optimizer:
    """The ``torch.optim`` optimizer itself, out of the front ends' wrappers and this package's."""
    optimizer = as_set_up(optimizer)
    return optimizer.optimizer if isinstance(optimizer, ZeroOptimizer) else optimizer


def check_configured(optimizer: object) -> None:
    """What ``configure_optimizers`` returned must be a plain ``torch.optim`` optimizer."""
    optimizer = as_set_up(optimizer)  # type: ignore[arg-type]
    if not isinstance(optimizer, Optimizer) or isinstance(optimizer, ZeroOptimizer):
        raise TypeError(
            f"`configure_optimizers` returned {type(optimizer).__name__}, which is not a `torch.optim.Optimizer`."
            " HINT: return an optimizer from `torch.optim` (or a subclass of `torch.optim.Optimizer`) built on"
            " `self.parameters()`; ZeRO shards its state itself."
        )

"""Fabric's ``strategy="zero_auto"``: the stage and offload chosen when the first module is set up, from its size,
its optimizer and each rank's memory (see :mod:`lightning_zero._auto`)."""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from lightning.fabric.strategies import DDPStrategy
from lightning.fabric.strategies.registry import _StrategyRegistry
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zero._auto.choice import optimizer_key
from lightning_zero._config import Stage
from lightning_zero._core.auto import AutoChoosing
from lightning_zero._core.front_end import register_auto
from lightning_zero.fabric.strategy import ZeroStrategy


class ZeroAutoStrategy(AutoChoosing, ZeroStrategy):
    """The first of ``zero1``, ``zero2``, ``zero3``, ``zero2_offload``, ``zero3_offload`` and ``zero3_infinity`` whose
    model state fits each rank's memory beside the activation reserve, chosen at ``fabric.setup`` from the module and
    its optimizer; the options are those of the Trainer's ``lightning_zero.ZeroAutoStrategy``.

    The choice needs the module's size, so ``fabric.init_module()`` builds the module whole on every rank, as stages
    1 and 2 do, before it is chosen; a model larger than that belongs to ``Fabric(strategy="zero3")``.
    """

    def __init__(
        self,
        *,
        max_stage: int = 3,
        offload: bool | str = True,
        activation_reserve: float | int | None = None,
        optimizer: str = "adam",
        memory_per_rank: int | None = None,
        offload_dir: str | Path | None = None,
        **options: Any,
    ) -> None:
        options = self._take_options(
            options,
            offload_dir,
            max_stage=max_stage,
            offload=offload,
            activation_reserve=activation_reserve,
            optimizer=optimizer,
            memory_per_rank=memory_per_rank,
        )
        super().__init__(Stage.PARAMETERS, **options)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        register_auto(strategy_registry, cls)

    @override
    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager:
        """Before the choice, eager construction (the stage is not known yet)."""
        if self.auto_choice is None:
            return DDPStrategy.module_init_context(self, empty_init)
        return super().module_init_context(empty_init)

    @override
    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[Optimizer], scheduler: Any | None = None
    ) -> tuple[Any, ...]:
        keys = [optimizer_key(optimizer) for optimizer in optimizers]
        self._choose_for(module, next((key for key in keys if key is not None), None))
        return super().setup_module_and_optimizers(module, optimizers, scheduler)

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        self._choose_for(module, None)
        return super().setup_module(module)

    def _choose_for(self, module: nn.Module, optimizer: str | None) -> None:
        precision = str(getattr(self.precision, "precision", "32-true"))
        self._choose(module, precision, optimizer, builds_later=False)

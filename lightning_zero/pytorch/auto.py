"""The Trainer's ``strategy="zero_auto"``: the stage and offload chosen at set-up from the model's size and each
rank's memory (see :mod:`lightning_zero._auto`)."""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities.model_helpers import is_overridden
from typing_extensions import override

from lightning_zero._auto.choice import check_optimizer, optimizer_key
from lightning_zero._config import Stage
from lightning_zero._core.auto import AutoChoosing
from lightning_zero._core.front_end import register_auto
from lightning_zero._core.optimizers import unwrap
from lightning_zero.pytorch.strategy import ZeroStrategy


class ZeroAutoStrategy(AutoChoosing, ZeroStrategy):
    """The first of ``zero1``, ``zero2``, ``zero3``, ``zero2_offload``, ``zero3_offload`` and ``zero3_infinity`` (the
    order of their traffic; on CPU ranks stepping Adam or AdamW the two host-stepping ones first, whose fused kernel is
    the fastest there) whose model state fits each rank's memory beside the activation reserve, chosen when
    ``fit`` sets up, before any rank builds a ``configure_model`` model; the table of the choice is logged on rank 0
    and kept in :attr:`auto_choice`.

    ``Trainer(strategy="zero_auto")`` or ``Trainer(strategy=ZeroAutoStrategy(...))``.

    Args:
        max_stage: the highest stage the choice may run (1, 2 or 3).
        offload: ``True`` (the default): host memory or files under ``offload_dir``; ``"cpu"``: host memory, no
            files; ``False``: no offload.
        activation_reserve: the part of each rank's memory left for activations, buffers and the framework: a
            fraction below 1 or bytes; by default a quarter of it, at least 256 MiB but at most half.
        optimizer: the optimizer the estimate assumes (``"adam"``, ``"adamw"``, ``"sgd-momentum"``, ``"sgd"``);
            ``configure_optimizers`` runs after the choice, and fails where its optimizer's state does not fit.
        memory_per_rank: bytes each rank may use instead of what is measured (the tightest memory group or the
            available memory, shared by the node's ranks; on a GPU the device's free memory).
        offload_dir: where ZeRO-Infinity's files go, if it is chosen (default: the temporary directory).
        options: the other options of :class:`ZeroStrategy`, but those the choice sets (``stage``, ``offload_*``,
            the disk options, ``deepspeed_config``). ``auto_wrap_policy`` applies if stage 3 is chosen.
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

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """Before the choice, eager construction, as ``"ddp"`` builds (the stage is not known yet: the choice counts
        the module built); a module too large to build whole on a rank builds in ``configure_model`` instead."""
        if self.auto_choice is None:
            with super(ZeroStrategy, self).tensor_init_context(empty_init):
                yield
            return
        with super().tensor_init_context(empty_init):
            yield

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        module = self.lightning_module
        assert module is not None
        precision = str(getattr(self.precision_plugin, "precision", "32-true"))
        self._choose(module, precision, None, is_overridden("configure_model", module, LightningModule))

    @override
    def setup_optimizers(self, trainer: Trainer) -> None:
        super().setup_optimizers(trainer)
        assert self.auto_choice is not None
        for optimizer in self.optimizers:
            key = optimizer_key(unwrap(optimizer))
            if key is not None:
                check_optimizer(self.auto_choice, key, self.auto_options)

"""The Trainer's precision plugins made ZeRO-aware (see :mod:`lightning_zero._core.precision`): one subclass of each
plugin class a ``precision=`` flag gives a DDP-style strategy."""

from __future__ import annotations

from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from torch import Tensor

from lightning_zero._core.precision import ZeroPrecisionMixin, zero_aware_class


class _TrainerMixin(ZeroPrecisionMixin):
    def pre_backward(self, tensor: Tensor, module: LightningModule) -> Tensor:
        return self.scaled_loss(super().pre_backward(tensor, module))  # type: ignore[misc]


class ZeroPrecision(_TrainerMixin, Precision):
    """``precision="32-true"`` under the ZeRO strategies."""


class ZeroMixedPrecision(_TrainerMixin, MixedPrecision):
    """``precision="16-mixed"`` or ``"bf16-mixed"``; on a GPU the engine's loss scaling replaces the ``GradScaler``."""


class ZeroHalfPrecision(_TrainerMixin, HalfPrecision):
    """``precision="16-true"`` or ``"bf16-true"`` (with ``master_weights=True``: ZeRO mixed precision)."""


class ZeroDoublePrecision(_TrainerMixin, DoublePrecision):
    """``precision="64-true"``: the module, its gradients and the optimizer state in float64, sharded as any other
    dtype."""


_ZERO_AWARE = (ZeroPrecision, ZeroMixedPrecision, ZeroHalfPrecision, ZeroDoublePrecision)


def zero_aware(plugin: Precision) -> Precision:
    """Make ``plugin`` (Lightning's, as the ``precision`` flag chose it) ZeRO-aware in place, settings kept."""
    if not isinstance(plugin, ZeroPrecisionMixin):
        plugin.__class__ = zero_aware_class(plugin, _ZERO_AWARE, __name__)
    return plugin

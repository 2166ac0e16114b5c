"""The Trainer's precision plugins made ZeRO-aware (see :mod:`lightning_zero._core.precision`)."""

from __future__ import annotations

from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from torch import Tensor

from lightning_zero._core.precision import ZeroPrecisionMixin
from lightning_zero._core.precision import zero_aware as _zero_aware


class _TrainerMixin(ZeroPrecisionMixin):
    def pre_backward(self, tensor: Tensor, module: LightningModule) -> Tensor:
        return self.scaled_loss(super().pre_backward(tensor, module))  # type: ignore[misc]


class ZeroPrecision(_TrainerMixin, Precision):
    """``precision="32-true"``."""


class ZeroMixedPrecision(_TrainerMixin, MixedPrecision):
    """``precision="16-mixed"`` and ``"bf16-mixed"``."""


class ZeroHalfPrecision(_TrainerMixin, HalfPrecision):
    """``precision="16-true"`` and ``"bf16-true"``."""


class ZeroDoublePrecision(_TrainerMixin, DoublePrecision):
    """``precision="64-true"``."""


_ZERO_AWARE: dict[type, type] = {
    Precision: ZeroPrecision,
    MixedPrecision: ZeroMixedPrecision,
    HalfPrecision: ZeroHalfPrecision,
    DoublePrecision: ZeroDoublePrecision,
}


def zero_aware(plugin: Precision) -> Precision:
    return _zero_aware(plugin, _ZERO_AWARE, __name__)

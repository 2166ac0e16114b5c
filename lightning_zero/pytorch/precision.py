"""The Trainer's precision plugins made ZeRO-aware (see :mod:`lightning_zero._core.precision`): ``ZeroPrecision``
(``precision="32-true"``), ``ZeroMixedPrecision`` (``"16-mixed"``, ``"bf16-mixed"``), ``ZeroHalfPrecision``
(``"16-true"``, ``"bf16-true"``) and ``ZeroDoublePrecision`` (``"64-true"``)."""

from __future__ import annotations

from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from torch import Tensor

from lightning_zero._core.precision import ZeroPrecisionMixin, zero_aware_classes
from lightning_zero._core.precision import zero_aware as _zero_aware


class _TrainerMixin(ZeroPrecisionMixin):
    def pre_backward(self, tensor: Tensor, module: LightningModule) -> Tensor:
        return self.scaled_loss(super().pre_backward(tensor, module))  # type: ignore[misc]


_BASES = (Precision, MixedPrecision, HalfPrecision, DoublePrecision)
_ZERO_AWARE = zero_aware_classes(_TrainerMixin, _BASES, __name__)
ZeroPrecision, ZeroMixedPrecision, ZeroHalfPrecision, ZeroDoublePrecision = _ZERO_AWARE.values()


def zero_aware(plugin: Precision) -> Precision:
    return _zero_aware(plugin, _ZERO_AWARE, __name__)

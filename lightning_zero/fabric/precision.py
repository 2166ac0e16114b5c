"""Fabric's precision plugins made ZeRO-aware (see :mod:`lightning_zero._core.precision`): ``ZeroPrecision``
(``precision="32-true"``), ``ZeroMixedPrecision`` (``"16-mixed"``, ``"bf16-mixed"``), ``ZeroHalfPrecision``
(``"16-true"``, ``"bf16-true"``) and ``ZeroDoublePrecision`` (``"64-true"``)."""

from __future__ import annotations

from typing import Any

from lightning.fabric.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from torch import Tensor, nn

from lightning_zero._core.precision import ZeroPrecisionMixin, zero_aware_classes
from lightning_zero._core.precision import zero_aware as _zero_aware


class _FabricMixin(ZeroPrecisionMixin):
    def backward(self, tensor: Tensor, model: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        super().backward(self.scaled_loss(tensor), model, *args, **kwargs)  # type: ignore[misc]


_BASES = (Precision, MixedPrecision, HalfPrecision, DoublePrecision)
_ZERO_AWARE = zero_aware_classes(_FabricMixin, _BASES, __name__)
ZeroPrecision, ZeroMixedPrecision, ZeroHalfPrecision, ZeroDoublePrecision = _ZERO_AWARE.values()


def zero_aware(plugin: Precision) -> Precision:
    return _zero_aware(plugin, _ZERO_AWARE, __name__)

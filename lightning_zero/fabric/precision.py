"""Fabric's precision plugins made ZeRO-aware (see :mod:`lightning_zero._core.precision`): one subclass of each
plugin class a ``precision=`` flag gives a DDP-style strategy."""

from __future__ import annotations

from typing import Any

from lightning.fabric.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from torch import Tensor, nn

from lightning_zero._core.precision import ZeroPrecisionMixin, zero_aware_class


class _FabricMixin(ZeroPrecisionMixin):
    def backward(self, tensor: Tensor, model: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        super().backward(self.scaled_loss(tensor), model, *args, **kwargs)  # type: ignore[misc]


class ZeroPrecision(_FabricMixin, Precision):
    """``Fabric(precision="32-true")`` under the ZeRO strategies: clipping reads the gradients where the stage keeps
    them."""


class ZeroMixedPrecision(_FabricMixin, MixedPrecision):
    """``Fabric(precision="16-mixed")`` or ``"bf16-mixed"``."""


class ZeroHalfPrecision(_FabricMixin, HalfPrecision):
    """``Fabric(precision="16-true")`` or ``"bf16-true"``; with ``master_weights=True`` the optimizer steps on fp32
    master shards."""


class ZeroDoublePrecision(_FabricMixin, DoublePrecision):
    """``Fabric(precision="64-true")``."""


_ZERO_AWARE = (ZeroPrecision, ZeroMixedPrecision, ZeroHalfPrecision, ZeroDoublePrecision)


def zero_aware(plugin: Precision) -> Precision:
    """Make ``plugin`` (Lightning's, as the ``precision`` flag chose it) ZeRO-aware in place, settings kept."""
    if not isinstance(plugin, ZeroPrecisionMixin):
        plugin.__class__ = zero_aware_class(plugin, _ZERO_AWARE, __name__)
    return plugin

"""Makes Lightning's precision plugins clip the gradients ZeRO keeps, wherever the stage keeps them."""

from __future__ import annotations

from collections.abc import Iterator
from functools import cache

from lightning.pytorch.plugins.precision import Precision
from torch import Tensor
from torch.optim import Optimizer

from lightning_zero._optimizer import ZeroOptimizer


class _ZeroPrecisionMixin:
    def main_params(self, optimizer: Optimizer) -> Iterator[Tensor]:
        if isinstance(optimizer, ZeroOptimizer):
            return optimizer.main_params()
        return super().main_params(optimizer)  # type: ignore[misc]


@cache
def _zero_aware_class(cls: type[Precision]) -> type[Precision]:
    return type(f"Zero{cls.__name__}", (_ZeroPrecisionMixin, cls), {})


def zero_aware(plugin: Precision) -> Precision:
    """Give ``plugin`` (any Lightning precision plugin, kept as an instance of its class) ZeRO-aware clipping."""
    if not isinstance(plugin, _ZeroPrecisionMixin):
        plugin.__class__ = _zero_aware_class(type(plugin))
    return plugin

"""Makes Lightning's precision plugins work with ZeRO's gradients: clipping where the stage keeps them, and the
engine's loss scaling where gradients are fp16 and sharded."""

from __future__ import annotations

from collections.abc import Iterator
from functools import cache
from typing import Any

from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.precision import Precision
from torch import Tensor
from torch.optim import Optimizer

from lightning_zero._loss_scaler import LossScaler
from lightning_zero._optimizer import ZeroOptimizer

_SCALER_KEY = "lightning_zero_loss_scaler"


class _ZeroPrecisionMixin:
    zero_loss_scaler: LossScaler | None = None  # set by the strategy when the engine scales the loss

    def main_params(self, optimizer: Optimizer) -> Iterator[Tensor]:
        if isinstance(optimizer, ZeroOptimizer):
            return optimizer.main_params()
        return super().main_params(optimizer)  # type: ignore[misc]

    def pre_backward(self, tensor: Tensor, module: LightningModule) -> Tensor:
        tensor = super().pre_backward(tensor, module)  # type: ignore[misc]
        scaler = self.zero_loss_scaler
        return tensor if scaler is None else tensor * scaler.scale

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()  # type: ignore[misc]
        if self.zero_loss_scaler is not None:
            state = {**state, _SCALER_KEY: self.zero_loss_scaler.state_dict()}
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        scaler_state = state_dict.pop(_SCALER_KEY, None)
        if scaler_state is not None and self.zero_loss_scaler is not None:
            self.zero_loss_scaler.load_state_dict(scaler_state)
        super().load_state_dict(state_dict)  # type: ignore[misc]


@cache
def _zero_aware_class(cls: type[Precision]) -> type[Precision]:
    return type(f"Zero{cls.__name__}", (_ZeroPrecisionMixin, cls), {})


def zero_aware(plugin: Precision) -> Precision:
    """Give ``plugin`` (any Lightning precision plugin, kept as an instance of its class) ZeRO-aware clipping and loss
    scaling."""
    if not isinstance(plugin, _ZeroPrecisionMixin):
        plugin.__class__ = _zero_aware_class(type(plugin))
    return plugin

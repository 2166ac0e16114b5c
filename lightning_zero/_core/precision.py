"""Makes Lightning's precision plugins work with ZeRO's gradients: clipping where the stage keeps them, and the
engine's loss scaling where gradients are fp16 and sharded.

Each of Lightning's plugins that a ``precision=`` flag gives a DDP-style strategy has a ZeRO-aware subclass defined
here, at module level, so a strategy holding one pickles by reference (``start_method="spawn"`` sends it to every
rank). The plugin the Trainer built becomes an instance of that subclass in place, keeping its settings."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from torch import Tensor
from torch.optim import Optimizer

from lightning_zero._engine.loss_scaler import LossScaler
from lightning_zero._engine.optimizer import ZeroOptimizer

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


class ZeroPrecision(_ZeroPrecisionMixin, Precision):
    """``precision="32-true"``."""


class ZeroMixedPrecision(_ZeroPrecisionMixin, MixedPrecision):
    """``precision="16-mixed"`` and ``"bf16-mixed"``."""


class ZeroHalfPrecision(_ZeroPrecisionMixin, HalfPrecision):
    """``precision="16-true"`` and ``"bf16-true"``."""


class ZeroDoublePrecision(_ZeroPrecisionMixin, DoublePrecision):
    """``precision="64-true"``."""


_ZERO_AWARE: dict[type[Precision], type[Precision]] = {
    Precision: ZeroPrecision,
    MixedPrecision: ZeroMixedPrecision,
    HalfPrecision: ZeroHalfPrecision,
    DoublePrecision: ZeroDoublePrecision,
}


def zero_aware(plugin: Precision) -> Precision:
    """Give ``plugin`` ZeRO-aware clipping and loss scaling: it becomes an instance of the matching ``Zero*`` class,
    with its settings (a ``MixedPrecision``'s scaler, a ``HalfPrecision``'s dtype) kept."""
    if isinstance(plugin, _ZeroPrecisionMixin):
        return plugin
    zero_class = _ZERO_AWARE.get(type(plugin))
    if zero_class is None:
        known = ", ".join(f"`{cls.__name__}`" for cls in _ZERO_AWARE)
        raise TypeError(
            f"The precision plugin `{type(plugin).__name__}` is not one the ZeRO strategies can adapt; they clip and"
            f" scale sharded gradients in Lightning's {known}. HINT: pass `Trainer(precision=...)` with one of"
            " '32-true', '16-mixed', 'bf16-mixed', '16-true', 'bf16-true', '64-true'; for a plugin of your own,"
            " derive it from the matching class of `lightning_zero._core.precision`, e.g. `ZeroMixedPrecision`."
        )
    plugin.__class__ = zero_class
    return plugin

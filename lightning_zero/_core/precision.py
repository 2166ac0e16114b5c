"""Makes Lightning's precision plugins (the Trainer's and Fabric's) work with ZeRO's gradients: clipping where the
stage keeps them, and the engine's loss scaling where gradients are fp16 and sharded.

Each front end maps every plugin class a ``precision=`` flag gives a DDP-style strategy to a ZeRO-aware subclass
written in its ``precision`` module, so a strategy holding one pickles by reference (``start_method="spawn"`` sends
it to every rank). The plugin Lightning built becomes an instance of that subclass in place, keeping its settings:
the front end does that to its own plugin, and gives it the mode's loss scaler (``zero_loss_scaler``) when the
optimizers are set up.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch import Tensor
from torch.optim import Optimizer

from lightning_zero._engine.loss_scaler import LossScaler
from lightning_zero._engine.optimizer import ZeroOptimizer

_SCALER_KEY = "lightning_zero_loss_scaler"


class ZeroPrecisionMixin:
    """Placed before a Lightning precision class: clipping reads the gradients where the stage keeps them, and the
    loss is multiplied by the engine's scale when the engine scales it."""

    zero_loss_scaler: LossScaler | None = None  # set by the front end when the mode scales the loss (fp16 shards)
    zero_took_scaler = False  # whether the engine took this plugin's GradScaler: every later engine scales too

    def main_params(self, optimizer: Optimizer) -> Iterator[Tensor]:
        if isinstance(optimizer, ZeroOptimizer):
            return optimizer.main_params()
        return super().main_params(optimizer)  # type: ignore[misc]

    def scaled_loss(self, loss: Tensor) -> Tensor:
        """The loss that goes backward: multiplied by the engine's scale when the engine scales it."""
        scaler = self.zero_loss_scaler
        return loss if scaler is None else loss * scaler.scale

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


def zero_aware_class(plugin: object, classes: tuple[type, ...], where: str) -> type:
    """The one of ``classes`` (the ZeRO-aware subclasses defined in module ``where``, each of one Lightning class)
    made for ``plugin``'s class; the front end makes its plugin an instance of it."""
    zero_class = next((cls for cls in classes if _adapted(cls) is type(plugin)), None)
    if zero_class is None:
        known = ", ".join(f"`{_adapted(cls).__name__}`" for cls in classes)
        raise TypeError(
            f"The precision plugin `{type(plugin).__name__}` is not one the ZeRO strategies can adapt; they clip and"
            f" scale sharded gradients in Lightning's {known}. HINT: pass `precision=...` with one of '32-true',"
            " '16-mixed', 'bf16-mixed', '16-true', 'bf16-true', '64-true'; for a plugin of your own, derive it from"
            f" the matching class of `{where}`, e.g. `ZeroMixedPrecision`."
        )
    return zero_class


def _adapted(zero_class: type) -> type:
    """The Lightning class a ZeRO-aware class adapts: its last base, after the mixin."""
    return zero_class.__bases__[-1]


def take_over_scaler(plugin: ZeroPrecisionMixin) -> bool:
    """Take a mixed-precision plugin's ``GradScaler`` away (``"16-mixed"`` on a GPU): it would look only at this
    rank's gradient shards for overflows, so the engine scales the loss instead. Returns whether the engine scales in
    its place: also for the engine of a later ``fit``, which finds the scaler taken already."""
    if getattr(plugin, "scaler", None) is not None:
        plugin.scaler = None  # type: ignore[attr-defined]
        plugin.zero_took_scaler = True
    return plugin.zero_took_scaler

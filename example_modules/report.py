"""A callback that prints how much the training loss fell, for people reading a run and for the example tests."""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override


class LossReport(Callback):
    """At the end of training, print on rank 0 the mean loss of its first and of its last ``window`` steps.

    The losses are rank 0's own (not averaged across ranks), which needs no extra collective.
    The line reads ``train_loss start=5.5123 end=2.0456 steps=60``.
    """

    def __init__(self, window: int = 5) -> None:
        if window < 1:
            raise ValueError(f"`window={window}` must be at least 1.")
        self.window = window
        self.losses: list[float] = []

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.losses.append(float(outputs["loss"]))

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.is_global_zero or not self.losses:
            return
        window = min(self.window, len(self.losses))
        start = sum(self.losses[:window]) / window
        end = sum(self.losses[-window:]) / window
        print(f"train_loss start={start:.4f} end={end:.4f} steps={len(self.losses)}", flush=True)

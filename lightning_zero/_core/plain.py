"""One device and nothing offloaded: the module trains plainly, with the optimizers as configured and no collectives."""

from __future__ import annotations

from torch import nn
from torch.optim import Optimizer

from lightning_zero._core.mode import Mode


class PlainMode(Mode):
    """What DDP does on one device."""

    def _place(self, module: nn.Module) -> None:
        module.to(self.device)

    def _wrap_optimizers(
        self, module: nn.Module, optimizers: list[Optimizer], grad_scaler_taken: bool
    ) -> list[Optimizer]:
        if self.config.master_weights:
            raise ValueError(
                "`master_weights=True` shards fp32 master weights across ranks; this run has one."
                " HINT: on one device use `precision='bf16-mixed'`, which keeps fp32 weights, or offload the masters"
                " to the host with `offload_optimizer=True`."
            )
        return optimizers

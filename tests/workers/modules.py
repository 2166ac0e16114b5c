"""LightningModules written for DDP, used unchanged by the parity tests under every strategy."""

from __future__ import annotations

from typing import Any

import torch
import torchmetrics
from lightning.pytorch import LightningModule
from torch import nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader, TensorDataset


def make_data(n: int = 96, d_in: int = 12, classes: int = 4, seed: int = 1234) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d_in, generator=gen)
    y = torch.randint(0, classes, (n,), generator=gen)
    return TensorDataset(x, y)


class Lars(Optimizer):
    """SGD with a LARS trust ratio: the step of each parameter is scaled by ||w|| / ||g||, whole-parameter norms."""

    def __init__(self, params: Any, lr: float = 0.1, momentum: float = 0.9, trust: float = 0.02) -> None:
        super().__init__(params, dict(lr=lr, momentum=momentum, trust=trust))

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                w_norm, g_norm = p.norm(), p.grad.norm()
                ratio = torch.where((w_norm > 0) & (g_norm > 0), group["trust"] * w_norm / g_norm, 1.0)
                state = self.state[p]
                buf = state.setdefault("momentum_buffer", torch.zeros_like(p))
                buf.mul_(group["momentum"]).add_(p.grad * ratio)
                p.add_(buf, alpha=-group["lr"])
        return loss


class Classifier(LightningModule):
    """A small MLP with odd shapes: a 0-dim temperature, a bias shorter than the world size, BatchNorm, a metric."""

    def __init__(
        self,
        optimizer: str = "adam",
        d_in: int = 12,
        hidden: int = 37,
        classes: int = 4,
        batch_norm: bool = False,
        freeze_first: bool = False,
        unused_branch: bool = False,
        scheduler: str | None = None,
        config_style: str = "optimizer",
        batch_size: int = 8,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.inp = nn.Linear(d_in, hidden, bias=not batch_norm)  # a bias before BatchNorm gets only rounding noise
        self.norm = nn.BatchNorm1d(hidden) if batch_norm else nn.Identity()
        self.mid = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, classes)
        self.gate = nn.Parameter(torch.randn(1, hidden))  # dim 0 shorter than the world size: empty shards
        self.temperature = nn.Parameter(torch.tensor(1.5))  # 0-dim: replicated
        self.side = nn.Linear(hidden, hidden)  # used on every other step when unused_branch
        if freeze_first:
            self.inp.requires_grad_(False)
        self.accuracy = torchmetrics.classification.MulticlassAccuracy(num_classes=classes)
        self.losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.norm(self.inp(x))) * torch.sigmoid(self.gate)
        h = torch.tanh(self.mid(h))
        if not self.hparams.unused_branch or self.global_step % 2 == 0:
            h = h + 0.5 * torch.tanh(self.side(h))
        return self.out(h) / self.temperature

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = nn.functional.cross_entropy(logits, y)
        self.accuracy(logits, y)
        self.log("train_acc", self.accuracy, on_step=True, on_epoch=False)
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self(x), y), sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("test_loss", nn.functional.cross_entropy(self(x), y), sync_dist=True)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> Any:
        name = self.hparams.optimizer
        params = [p for p in self.parameters() if p.requires_grad]
        if name == "adam":
            opt: Optimizer = torch.optim.Adam(params, lr=1e-2)
        elif name == "adamw_groups":
            decay = [p for n, p in self.named_parameters() if p.requires_grad and n.endswith("weight")]
            other = [p for n, p in self.named_parameters() if p.requires_grad and not n.endswith("weight")]
            opt = torch.optim.AdamW(
                [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0, "lr": 3e-3}], lr=1e-2
            )
        elif name == "sgd":
            opt = torch.optim.SGD(params, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3)
        elif name == "lars":
            opt = Lars(params)
        else:
            raise ValueError(name)
        if self.hparams.scheduler == "step":
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
            if self.hparams.config_style == "dict":
                return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
            return [opt], [{"scheduler": sched, "interval": "step"}]
        if self.hparams.config_style == "list":
            return [opt]
        return opt

    def train_dataloader(self) -> DataLoader:
        return DataLoader(make_data(), batch_size=self.hparams.batch_size)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(make_data(n=48, seed=7), batch_size=8)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(make_data(n=48, seed=8), batch_size=8)

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(make_data(n=32, seed=9), batch_size=8)


def fabric_step(fabric: Any, model: Any, optimizer: Any, gen: torch.Generator, batch: int = 8) -> float:
    """One step of a Fabric loop on the classifier (its default sizes), on a batch drawn from ``gen``; the loss."""
    x, y = torch.randn(batch, 12, generator=gen), torch.randint(0, 4, (batch,), generator=gen)
    loss = nn.functional.cross_entropy(model(x), y)
    fabric.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


class ManualClassifier(Classifier):
    """Manual optimization: one optimizer, or a generator/discriminator pair stepped alternately with toggling."""

    def __init__(self, two_optimizers: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.automatic_optimization = False
        self.two_optimizers = two_optimizers

    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        if not self.two_optimizers:
            opt = self.optimizers()
            opt.zero_grad()
            loss = nn.functional.cross_entropy(self(x), y)
            self.manual_backward(loss)
            self.clip_gradients(opt, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
            opt.step()
            self.losses.append(loss.item())
            return
        opt_body, opt_head = self.optimizers()
        self.toggle_optimizer(opt_body)
        loss = nn.functional.cross_entropy(self(x), y)
        self.manual_backward(loss)
        opt_body.step()
        opt_body.zero_grad()
        self.untoggle_optimizer(opt_body)
        self.toggle_optimizer(opt_head)
        loss2 = nn.functional.cross_entropy(self(x * 0.5), y) + self.out.weight.pow(2).mean()
        self.manual_backward(loss2)
        opt_head.step()
        opt_head.zero_grad()
        self.untoggle_optimizer(opt_head)
        self.losses.append(loss.item() + loss2.item())

    def configure_optimizers(self) -> Any:
        if not self.two_optimizers:
            return torch.optim.Adam(self.parameters(), lr=1e-2)
        head = [self.out.weight, self.out.bias, self.temperature]
        head_ids = {id(p) for p in head}
        body = [p for p in self.parameters() if id(p) not in head_ids]
        return torch.optim.Adam(body, lr=1e-2), torch.optim.SGD(head, lr=0.1, momentum=0.5)


class OverflowClassifier(Classifier):
    """Blows up the loss on rank 1 only, at its third training step, so that fp16 gradients overflow there."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.calls = 0
        self.skipped_steps: list[int] = []
        self.loss_scale_at_start: float | None = None
        self._before: torch.Tensor | None = None

    def on_train_start(self) -> None:
        self.loss_scale_at_start = self._scaler().scale

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self._before = self.mid.weight.detach().clone()
        if self.calls == 2 and self.global_rank == 1:
            loss = loss * 1e6  # times the loss scale: beyond fp16's range
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if torch.equal(self.mid.weight, self._before):
            self.skipped_steps.append(self.calls)
        self.calls += 1

    def _scaler(self) -> Any:
        return self.trainer.precision_plugin.zero_loss_scaler

    def report(self) -> dict[str, Any]:
        return {
            "skipped_steps": self.skipped_steps,
            "loss_scale": self._scaler().scale,
            "loss_scale_at_start": self.loss_scale_at_start,
        }


MODULES = {"classifier": Classifier, "manual": ManualClassifier, "overflow": OverflowClassifier}


from tests.workers.modules_zero3 import MODULES_ZERO3  # noqa: E402  (stage-3 test modules)

MODULES.update(MODULES_ZERO3)

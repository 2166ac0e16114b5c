"""A small CNN classifier with BatchNorm, and synthetic images it can learn in a few dozen steps on CPU.

Each class is a sine grating at its own orientation; every image has a random phase and Gaussian noise, so the
network must learn oriented filters rather than memorise pixels.
"""

from __future__ import annotations

import math

import torch
from lightning.pytorch import LightningDataModule, LightningModule
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy


def conv_block(c_in: int, c_out: int) -> nn.Sequential:
    """3x3 convolution, BatchNorm, ReLU, then 2x2 max-pooling: halves height and width."""
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, 3, padding=1, bias=False),  # BatchNorm's shift makes a bias redundant
        nn.BatchNorm2d(c_out),
        nn.ReLU(),
        nn.MaxPool2d(2),
    )


class ImageClassifier(LightningModule):
    """Two convolution blocks, global average pooling and a linear head, trained with AdamW.

    Args:
        num_classes: must match the data's.
        width: channels of the first block; the second has twice as many.
        learning_rate, weight_decay: for AdamW.
    """

    def __init__(
        self, num_classes: int = 8, width: int = 16, learning_rate: float = 1e-2, weight_decay: float = 1e-4
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.features = nn.Sequential(conv_block(1, width), conv_block(width, 2 * width))
        self.head = nn.Linear(2 * width, num_classes)
        # One metric object per split: each accumulates its own state across steps.
        self.train_acc = MulticlassAccuracy(num_classes=num_classes)
        self.val_acc = MulticlassAccuracy(num_classes=num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """``images`` (batch, 1, height, width) -> logits (batch, num_classes)."""
        return self.head(self.features(images).mean(dim=(2, 3)))

    def setup(self, stage: str) -> None:
        data = self.trainer.datamodule
        if isinstance(data, GratingData) and data.num_classes != self.hparams.num_classes:
            raise ValueError(
                f"The data have {data.num_classes} classes but the model predicts {self.hparams.num_classes}."
                f" HINT: set `model.init_args.num_classes: {data.num_classes}`."
            )

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        images, labels = batch
        logits = self(images)
        loss = F.cross_entropy(logits, labels)
        self.train_acc(logits, labels)
        self.log("train_loss", loss, prog_bar=True)
        self.log("train_acc", self.train_acc, on_step=True, on_epoch=False)
        return loss

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        images, labels = batch
        logits = self(images)
        self.val_acc(logits, labels)
        self.log("val_loss", F.cross_entropy(logits, labels), prog_bar=True, sync_dist=True)
        self.log("val_acc", self.val_acc, prog_bar=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(
            self.parameters(), lr=self.hparams.learning_rate, weight_decay=self.hparams.weight_decay
        )


class GratingData(LightningDataModule):
    """Noisy oriented sine gratings, one orientation per class, generated in memory from ``seed``.

    Args:
        num_classes: orientations, evenly spaced over 180 degrees.
        image_size: height and width in pixels.
        cycles: periods of the grating across the image.
        noise: standard deviation of the Gaussian noise added to the unit-amplitude grating.
        train_samples, val_samples: images in each split (before they are split across ranks).
        batch_size: images per batch on each rank.
        seed: fixes the samples, so every rank generates the same data.
    """

    def __init__(
        self,
        num_classes: int = 8,
        image_size: int = 16,
        cycles: float = 3.0,
        noise: float = 1.5,
        train_samples: int = 4096,
        val_samples: int = 512,
        batch_size: int = 32,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.num_classes = num_classes
        self.image_size = image_size
        self.cycles = cycles
        self.noise = noise
        self.train_samples = train_samples
        self.val_samples = val_samples
        self.batch_size = batch_size
        self.seed = seed

    def setup(self, stage: str) -> None:
        gen = torch.Generator().manual_seed(self.seed)
        images, labels = self._sample(self.train_samples + self.val_samples, gen)
        self.train_set = TensorDataset(images[: self.train_samples], labels[: self.train_samples])
        self.val_set = TensorDataset(images[self.train_samples :], labels[self.train_samples :])

    def _sample(self, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        labels = torch.randint(0, self.num_classes, (n,), generator=gen)
        angle = labels * math.pi / self.num_classes  # (n,)
        phase = torch.rand(n, generator=gen) * 2 * math.pi  # (n,)
        coords = torch.arange(self.image_size, dtype=torch.float32)
        y, x = torch.meshgrid(coords, coords, indexing="ij")  # (size, size) each
        along = x * torch.cos(angle)[:, None, None] + y * torch.sin(angle)[:, None, None]  # (n, size, size)
        grating = torch.sin(2 * math.pi * self.cycles / self.image_size * along + phase[:, None, None])
        images = grating + self.noise * torch.randn(grating.shape, generator=gen)
        return images.unsqueeze(1), labels

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size)

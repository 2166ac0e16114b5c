"""A GPT-style decoder and a synthetic next-token task it can learn in a few dozen steps on CPU.

The data come from a fixed random Markov chain over the vocabulary: each token has ``branching`` possible successors
with fixed probabilities. An untrained model scores about ``ln(vocab_size)``; one that has learned the chain
approaches the chain's entropy (about ``ln(branching)``), so the loss visibly falls.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from lightning.pytorch import LightningDataModule, LightningModule
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override

INIT_STD = 0.02  # GPT-2's standard deviation for weights and embeddings


class GPTShape(NamedTuple):
    n_layer: int
    n_head: int
    d_model: int
    vocab_size: int
    seq_len: int


# Parameter counts with the tied head, counted once.
SIZES: dict[str, GPTShape] = {
    "tiny": GPTShape(n_layer=4, n_head=4, d_model=64, vocab_size=256, seq_len=64),  # 0.22M
    "small": GPTShape(n_layer=6, n_head=8, d_model=256, vocab_size=1024, seq_len=128),  # 5.0M
    "medium": GPTShape(n_layer=8, n_head=8, d_model=512, vocab_size=8192, seq_len=256),  # 29.5M
    "large": GPTShape(n_layer=12, n_head=12, d_model=768, vocab_size=32000, seq_len=512),  # 110M
    "350m": GPTShape(n_layer=24, n_head=16, d_model=1024, vocab_size=32000, seq_len=1024),  # 336M
    "1b": GPTShape(n_layer=20, n_head=16, d_model=2048, vocab_size=32000, seq_len=1024),  # 1.07B
    # GPT-2's own shapes, for benchmarks/bench_gpu.py
    "gpt2-small": GPTShape(n_layer=12, n_head=12, d_model=768, vocab_size=50257, seq_len=1024),  # 124M
    "gpt2-medium": GPTShape(n_layer=24, n_head=16, d_model=1024, vocab_size=50257, seq_len=1024),  # 355M
    # GPT-2 small's blocks at negligible arithmetic: the host's work per step, for benchmarks/bench_host.py
    "gpt2-host": GPTShape(n_layer=12, n_head=4, d_model=64, vocab_size=256, seq_len=32),  # 0.62M
}


def shape_of(size: str) -> GPTShape:
    if size not in SIZES:
        raise ValueError(f"Unknown GPT size {size!r}. HINT: pick one of {list(SIZES)}.")
    return SIZES[size]


class Linear(nn.Linear):
    """``nn.Linear`` initialised as GPT-2 does: weights from N(0, ``std``), zero bias.

    The rule lives in ``reset_parameters()``, which ``nn.Linear``'s constructor calls (and which stage 3 records,
    like any initialisation, for layers built in ``configure_model``), so every stage starts from it.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, std: float = INIT_STD) -> None:
        self.std = std  # before nn.Linear's constructor, which calls reset_parameters()
        super().__init__(in_features, out_features, bias)

    @override
    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=self.std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class Embedding(nn.Embedding):
    """``nn.Embedding`` initialised as GPT-2 does, from N(0, 0.02), in ``reset_parameters()`` (see ``Linear``)."""

    @override
    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=INIT_STD)


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_head: int, residual_std: float) -> None:
        super().__init__()
        if d_model % n_head:
            raise ValueError(f"d_model={d_model} is not divisible by n_head={n_head}.")
        self.n_head = n_head
        self.qkv = Linear(d_model, 3 * d_model)
        self.proj = Linear(d_model, d_model, std=residual_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, d_model = x.shape
        # (3, batch, n_head, seq, head_dim)
        qkv = self.qkv(x).view(batch, seq, 3, self.n_head, d_model // self.n_head).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, d_model))


class Block(nn.Module):
    """Pre-norm transformer block: attention then a 4x MLP, each added to the residual stream.

    ``residual_std`` initialises the two layers that write into the residual stream: GPT-2 scales them down with depth
    so the stream's variance does not grow with the number of blocks.
    """

    def __init__(self, d_model: int, n_head: int, residual_std: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head, residual_std)
        self.ln_2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            Linear(d_model, 4 * d_model), nn.GELU(), Linear(4 * d_model, d_model, std=residual_std)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPTLanguageModel(LightningModule):
    """A decoder-only language model of a named size, trained with AdamW and a warmup-then-cosine schedule.

    The layers are built in ``configure_model``, which the ``Trainer`` calls inside the strategy's initialisation
    context: under ZeRO stage 3 they are built without memory and each rank then materialises only its shards,
    so even the large sizes never exist whole on one rank. Outside a ``Trainer``, call ``configure_model()`` first.

    Args:
        size: one of ``SIZES``.
        learning_rate: peak learning rate, reached after ``warmup_steps``.
        weight_decay: applied to matrices and embeddings only, not to biases and LayerNorm.
        warmup_steps: steps of linear warmup from zero.
        min_lr_ratio: the cosine decay ends at ``learning_rate * min_lr_ratio`` on the last step.
    """

    def __init__(
        self,
        size: str = "tiny",
        learning_rate: float = 3e-3,
        weight_decay: float = 0.1,
        warmup_steps: int = 10,
        min_lr_ratio: float = 0.1,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.shape = shape_of(size)

    @override
    def configure_model(self) -> None:
        """Build the layers, once: Lightning calls this hook on every ``fit``, ``validate``, ``test`` and ``predict``.
        Weights come from each layer's ``reset_parameters()`` (GPT-2's initialisation)."""
        if self.layers_built:
            return
        shape = self.shape
        residual_std = INIT_STD / math.sqrt(2 * shape.n_layer)
        self.tok_emb = Embedding(shape.vocab_size, shape.d_model)
        self.pos_emb = Embedding(shape.seq_len, shape.d_model)
        self.blocks = nn.ModuleList(Block(shape.d_model, shape.n_head, residual_std) for _ in range(shape.n_layer))
        self.ln_f = nn.LayerNorm(shape.d_model)
        self.head = Linear(shape.d_model, shape.vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # tied: one matrix reads tokens in and scores them out

    @property
    def layers_built(self) -> bool:
        return "blocks" in self._modules

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """``tokens`` (batch, seq) of ids -> logits (batch, seq, vocab_size)."""
        if not self.layers_built:
            raise RuntimeError(
                "The GPT's layers are built in `configure_model`, which the Trainer calls."
                " HINT: call `model.configure_model()` before using the model outside a Trainer."
            )
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def _loss(self, batch: list[torch.Tensor]) -> torch.Tensor:
        (tokens,) = batch  # (batch, seq_len + 1): inputs and their next-token targets
        logits = self(tokens[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())

    def setup(self, stage: str) -> None:
        data = self.trainer.datamodule
        if isinstance(data, MarkovTokenData) and data.shape != self.shape:
            raise ValueError(
                f"The data are shaped for GPT size {data.size!r} but the model is {self.hparams.size!r}."
                f" HINT: set `data.init_args.size: {self.hparams.size}`."
            )

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), prog_bar=True, sync_dist=True)

    def configure_optimizers(self) -> dict[str, Any]:
        params = [p for p in self.parameters() if p.requires_grad]  # the tied matrix appears once
        groups = [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": self.hparams.weight_decay},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ]
        optimizer = torch.optim.AdamW(groups, lr=self.hparams.learning_rate, betas=(0.9, 0.95))
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, self._lr_factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def _lr_factor(self, step: int) -> float:
        warmup = self.hparams.warmup_steps
        if step < warmup:
            return (step + 1) / warmup
        total = max(self.trainer.estimated_stepping_batches, warmup + 1)
        progress = min((step - warmup) / (total - warmup), 1.0)
        floor = self.hparams.min_lr_ratio
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


class MarkovTokenData(LightningDataModule):
    """Token sequences sampled from a fixed random Markov chain, generated in memory from ``seed``.

    Args:
        size: the GPT size whose vocabulary and sequence length the data match.
        branching: successors each token can have; the chain's entropy is at most ``ln(branching)``.
        train_samples, val_samples: sequences in each split (before they are split across ranks).
        batch_size: sequences per batch on each rank.
        seed: fixes the chain and the samples, so every rank generates the same data.
    """

    def __init__(
        self,
        size: str = "tiny",
        branching: int = 4,
        train_samples: int = 4096,
        val_samples: int = 256,
        batch_size: int = 16,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.size = size
        self.shape = shape_of(size)
        self.branching = branching
        self.train_samples = train_samples
        self.val_samples = val_samples
        self.batch_size = batch_size
        self.seed = seed

    def setup(self, stage: str) -> None:
        gen = torch.Generator().manual_seed(self.seed)
        vocab = self.shape.vocab_size
        successors = torch.randint(0, vocab, (vocab, self.branching), generator=gen)  # sparse: vocab^2 is 4 GB at 1b
        weights = torch.rand(vocab, self.branching, generator=gen) ** 2  # squared: some successors dominate
        sequences = self._sample(successors, weights, self.train_samples + self.val_samples, gen)
        self.train_set = TensorDataset(sequences[: self.train_samples])
        self.val_set = TensorDataset(sequences[self.train_samples :])

    def _sample(self, successors: torch.Tensor, weights: torch.Tensor, n: int, gen: torch.Generator) -> torch.Tensor:
        tokens = torch.empty(n, self.shape.seq_len + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, self.shape.vocab_size, (n,), generator=gen)
        for t in range(1, tokens.shape[1]):
            previous = tokens[:, t - 1]
            choice = torch.multinomial(weights[previous], 1, generator=gen)
            tokens[:, t] = successors[previous].gather(1, choice).squeeze(1)
        return tokens

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size)

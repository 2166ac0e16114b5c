"""Runs inside each of 2 processes (started by tests/test_clip_resume.py): a LitGPT-style Fabric loop (a tiny GPT with
biased attention projections, AdamW, ``fabric.clip_gradients(model, optimizer, max_norm=1.0)``), under each strategy
of the payload's ``strategies``: ``STEPS`` steps, a save, then a fresh module and optimizer that load it and train
``STEPS`` more; with ``resume=False`` in the payload, ``2 * STEPS`` steps straight.

``python -m tests.workers.clip_resume OUT``; each rank writes ``OUT/rank<r>.pt``: per strategy, the total gradient
norm of every step (as ``clip_gradients`` returned it), the losses, and the module's final parameters, whole.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from lightning.fabric import Fabric
from torch import nn
from torch.nn import functional as F

from tests.oracle import full
from tests.scenarios import StrategySpec, read_payload, save_results

STEPS = 3
VOCAB, WIDTH, HEADS, SEQ, BATCH = 48, 32, 4, 12, 4
MAX_NORM = 1.0
LR = 1e-3


class Attention(nn.Module):
    """LitGPT's ``CausalSelfAttention`` in small: one biased projection to queries, keys and values."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH, bias=True)
        self.proj = nn.Linear(WIDTH, WIDTH, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (y.view(b, t, HEADS, -1).transpose(1, 2) for y in self.qkv(x).split(WIDTH, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, WIDTH))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm_1 = nn.LayerNorm(WIDTH)
        self.attn = Attention()
        self.norm_2 = nn.LayerNorm(WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm_1(x))
        return x + self.mlp(self.norm_2(x))


class TinyGPT(nn.Module):
    """LitGPT's ``GPT`` in small: embedding, blocks in a ``ModuleList`` (stage 3's units), final norm, head, and
    LitGPT's own initialisation through ``model.apply``."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.h = nn.ModuleList(Block() for _ in range(2))
        self.ln_f = nn.LayerNorm(WIDTH)
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Embedding, nn.Linear)):
            nn.init.normal_(module.weight, mean=0.0, std=0.2)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.normal_(module.bias, mean=0.0, std=0.02)  # nonzero: the key biases' gradients are then rounding

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def train(fabric: Fabric, model: nn.Module, optimizer: torch.optim.Optimizer, steps: range, record: dict) -> None:
    for step in steps:
        gen = torch.Generator().manual_seed(1000 * fabric.global_rank + step)  # each rank's own batch, per step
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        fabric.backward(loss)
        record["norms"].append(fabric.clip_gradients(model, optimizer, max_norm=MAX_NORM).item())
        optimizer.step()
        optimizer.zero_grad()
        record["losses"].append(loss.item())


def setup(fabric: Fabric) -> tuple[nn.Module, torch.optim.Optimizer]:
    fabric.seed_everything(7, verbose=False)
    model = TinyGPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    return fabric.setup(model, optimizer)


def run(strategy: str, resume: bool, out: Path) -> dict[str, Any]:
    fabric = Fabric(accelerator="cpu", devices=2, strategy=StrategySpec(strategy).for_fabric())
    fabric.launch()
    record: dict[str, Any] = {"norms": [], "losses": []}
    model, optimizer = setup(fabric)
    if not resume:
        train(fabric, model, optimizer, range(2 * STEPS), record)
    else:
        train(fabric, model, optimizer, range(STEPS), record)
        path = out / f"{strategy}.ckpt"
        fabric.save(path, {"model": model, "optimizer": optimizer})
        model, optimizer = setup(fabric)
        fabric.load(path, {"model": model, "optimizer": optimizer})
        train(fabric, model, optimizer, range(STEPS, 2 * STEPS), record)
    record["params"] = {name: full(p).detach().clone() for name, p in model.module.named_parameters()}
    return record


def main(out: Path) -> None:
    payload = read_payload(out)
    results = {strategy: run(strategy, payload["resume"], out) for strategy in payload["strategies"]}
    save_results(out, torch.distributed.get_rank(), results)


if __name__ == "__main__":
    main(Path(sys.argv[1]))

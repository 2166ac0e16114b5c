"""LightningModules for the stage-3 tests, written for DDP and used unchanged under every strategy: repeated blocks
(the units), an embedding tied to the output head, modules called twice in one forward, frozen and trainable
parameters in one block, a penalty on weights read in ``training_step`` outside ``forward``, layers built in
``configure_model``, and memory probes that walk tensors from inside forward and backward."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from lightning.pytorch import LightningModule
from torch import nn
from torch.nn import functional as F
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero.memory import storage_bytes


def token_data(n: int, seq: int, vocab: int, seed: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randint(0, vocab, (n, seq), generator=gen))


class LiveBytes(TorchDispatchMode):
    """While active: the bytes of the real storages operations allocated that are still alive, and their peak (each
    storage counted once, until the allocator frees it)."""

    def __init__(self) -> None:
        super().__init__()
        self._live: set[int] = set()
        self.now = self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in pytree.tree_leaves(out):
            if type(tensor) is torch.Tensor and not tensor.is_meta:
                storage = tensor.untyped_storage()
                if storage._cdata not in self._live:
                    self._live.add(storage._cdata)
                    self.now += storage.nbytes()
                    self.peak = max(self.peak, self.now)
                    weakref.finalize(storage, self._freed, storage._cdata, storage.nbytes())
        return out

    def _freed(self, key: int, nbytes: int) -> None:
        self._live.discard(key)
        self.now -= nbytes


class Block(nn.Module):
    """A residual MLP block; ``skip`` is frozen in some blocks, so one unit holds frozen and trainable parameters."""

    def __init__(self, width: int, frozen_skip: bool) -> None:
        super().__init__()
        self.forward_calls = 0  # with activation checkpointing, backward runs the forward again
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)
        self.skip = nn.Linear(width, width)
        self.skip.requires_grad_(not frozen_skip)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.forward_calls += torch.is_grad_enabled()  # training forwards, and their recomputation in backward
        return x + self.down(F.gelu(self.up(self.norm(x)))) + 0.5 * torch.tanh(self.skip(x))


class TiedLM(LightningModule):
    """A small language model: embedding tied to the head, ``depth`` blocks, a mixer and block 0 used twice."""

    def __init__(
        self,
        vocab: int = 29,
        width: int = 24,
        depth: int = 3,
        seq: int = 9,
        penalty: float = 1e-3,
        penalty_on_unit: bool = False,
        build_in_configure_model: bool = False,
        probe_memory: bool = False,
        uneven_val: bool = False,
        scheduler: bool = False,
        batch_size: int = 8,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.losses: list[float] = []
        self.memory: dict[str, int] = {}
        if not build_in_configure_model:
            self._build()

    def setup(self, stage: str) -> None:
        if self.hparams.build_in_configure_model and stage == "fit":
            self._setup_bytes = LiveBytes()  # to `configure_optimizers`: building the model and sharding it
            self._setup_bytes.__enter__()

    def configure_model(self) -> None:
        if not self.hparams.build_in_configure_model or hasattr(self, "embed"):
            return
        self._build()
        self.memory["configure_model_bytes"] = storage_bytes(list(self.parameters()))

    def _build(self) -> None:
        h = self.hparams
        self.embed = nn.Embedding(h.vocab, h.width)
        self.mixer = nn.Linear(h.width, h.width)
        self.blocks = nn.ModuleList([Block(h.width, frozen_skip=i == 1) for i in range(h.depth)])
        self.norm = nn.LayerNorm(h.width)
        self.head = nn.Linear(h.width, h.vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        h = h + torch.tanh(self.mixer(h))
        for block in self.blocks:
            h = block(h)
        h = self.blocks[0](h)  # a unit called twice in one forward
        h = h + torch.tanh(self.mixer(h))  # and a module of the root unit
        return self.head(self.norm(h))

    def _loss(self, batch: list[torch.Tensor]) -> torch.Tensor:
        tokens = batch[0]
        logits = self(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, self.hparams.vocab), tokens[:, 1:].reshape(-1))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        # weights read outside forward: the tied head and the final norm (root unit under every policy tested); with
        # ``penalty_on_unit``, a weight of the last block too, which stage 3 refuses with a clear error
        penalty = self.head.weight.pow(2).sum() + self.norm.weight.pow(2).sum()
        if self.hparams.penalty_on_unit:
            penalty = penalty + self.blocks[-1].up.weight.pow(2).sum()
        loss = loss + self.hparams.penalty * penalty
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def test_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        self.log("test_loss", self._loss(batch), sync_dist=True)

    def predict_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> Any:
        if getattr(self, "_setup_bytes", None) is not None:
            self._setup_bytes.__exit__(None, None, None)
            self.memory["setup_peak_bytes"] = self._setup_bytes.peak
            self._setup_bytes = None
        decay = [p for p in self.parameters() if p.requires_grad and p.dim() == 2]
        other = [p for p in self.parameters() if p.requires_grad and p.dim() != 2]
        groups = [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}]
        opt = torch.optim.AdamW(groups, lr=1e-2)
        if not self.hparams.scheduler:
            return opt
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self) -> DataLoader:
        return DataLoader(token_data(96, self.hparams.seq, self.hparams.vocab, 11), batch_size=self.hparams.batch_size)

    def val_dataloader(self) -> DataLoader:
        n = 48 + (8 * self.global_rank if self.hparams.uneven_val else 0)  # uneven: each rank a different length
        return DataLoader(token_data(n, self.hparams.seq, self.hparams.vocab, 12), batch_size=8)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(token_data(48, self.hparams.seq, self.hparams.vocab, 13), batch_size=8)

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(token_data(32, self.hparams.seq, self.hparams.vocab, 14), batch_size=8)

    # --- memory probes ------------------------------------------------------------------------------------------

    def _model_state(self) -> list[torch.Tensor]:
        """Every parameter storage reachable now: the module's registered parameters (gathered ones where a unit is
        gathered), the optimizer's (the shards), their gradients and the optimizer state."""
        params = list(self.parameters())
        if self._trainer is not None:
            for opt in self.trainer.optimizers:
                params += [p for group in opt.param_groups for p in group["params"]]
                params += [v for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
        return params + [p.grad for p in params if isinstance(p, nn.Parameter) and p.grad is not None]

    def _probe_step(self, *_: Any) -> None:
        peak = storage_bytes(self._model_state())
        self.memory["step_peak_bytes"] = max(self.memory.get("step_peak_bytes", 0), peak)

    def _probe_forward(self, module: nn.Module, inputs: Any, output: Any) -> None:
        self._probe_step()
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(self._probe_step)  # runs in backward, before this module's backward

    def on_train_start(self) -> None:
        if self.hparams.probe_memory:
            for module in self.modules():
                if module is not self:
                    module.register_forward_pre_hook(self._probe_step)
                    module.register_forward_hook(self._probe_forward)

    def on_train_batch_end(self, *_: Any) -> None:
        calls = sum(b.forward_calls for b in self.blocks)
        self.log("block_forward_calls", float(calls), on_step=True, on_epoch=False, reduce_fx="max")
        if not self.hparams.probe_memory and not self.hparams.build_in_configure_model:
            return
        opt = self.trainer.optimizers[0]
        at_rest = {
            "param_bytes": storage_bytes(list(self.parameters())),
            "state_bytes": storage_bytes([v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]),
        }
        for key, value in {**self.memory, **at_rest}.items():
            self.log(key, float(value), on_step=True, on_epoch=False, reduce_fx="max")

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        if self.hparams.probe_memory:
            self.memory["grad_bytes"] = storage_bytes([p.grad for p in self.parameters() if p.grad is not None])


MODULES_ZERO3 = {"tied_lm": TiedLM}


def blocks_only(module: nn.Module, name: str) -> bool:
    """A wrap policy as a function (the blocks, by name), for the stage-3 variants of tests/test_zero3.py."""
    return name.startswith("blocks.") and name.count(".") == 1

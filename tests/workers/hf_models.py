"""Runs inside each of N processes (started by tests/launch.py) for tests/test_hf_models.py: Hugging Face
``transformers`` models (and a peft LoRA adapter) built the ways their users build them, inside the strategy's
construction context: in ``configure_model`` (Trainer) or under ``fabric.init_module()`` (Fabric), from a config, by
``from_pretrained`` of a folder, or LitGPT-style with ``model.apply(init_fn)`` after an ``empty_init`` construction.
Each case trains a few steps under each strategy; records, per rank, the weights right after set-up (gathered whole),
the losses, and the weights at the end.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric import Fabric
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_zero  # noqa: F401  (registers the strategy names)
from tests.launch import read_payload
from tests.oracle import full
from tests.scenarios import cpu_trainer, save_results

WORLD_SIZE = int(os.environ.get("WORLD_SIZE", 1))  # read now: Lightning's teardown removes it
VOCAB, SEQ, STEPS = 97, 12, 3


@dataclass(frozen=True)
class Case:
    """A model and the way it is built; ``front``: ``"trainer"`` (in ``configure_model``), ``"trainer_init_module"``
    (in ``__init__`` under ``Trainer.init_module()``) or ``"fabric"`` (under ``fabric.init_module()``)."""

    name: str
    front: str
    model: str  # "gpt2", "llama", "t5"
    build: str = "config"  # "config", "pretrained", "apply_init", "lora", "frozen_embeddings"
    strategies: tuple[str, ...] = ("ddp", "zero3")
    saved: bool = False  # the Trainer saves a checkpoint at the end, as `{name}-{strategy}.ckpt`


def config(kind: str) -> Any:
    import transformers

    if kind == "gpt2":
        return transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32)
    if kind == "llama":
        return transformers.LlamaConfig(
            num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=VOCAB, max_position_embeddings=32,
        )  # fmt: skip
    return transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0
    )


def model_class(kind: str) -> Any:
    import transformers

    return {
        "gpt2": transformers.GPT2LMHeadModel,
        "llama": transformers.LlamaForCausalLM,
        "t5": transformers.T5ForConditionalGeneration,
    }[kind]


def save_pretrained(kind: str, folder: Path) -> None:
    """A tiny pretrained folder, made with ``save_pretrained``: random weights moved off their initial values, so a
    load that is lost shows."""
    torch.manual_seed(1000)
    model = model_class(kind)(config(kind))
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(folder)


def litgpt_init(module: nn.Module) -> None:
    """A LitGPT-style ``_init_weights``, applied with ``model.apply`` after construction."""
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, mean=0.0, std=math.sqrt(2.0 / 5 / 32))
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.trunc_normal_(module.weight, std=0.02, a=-0.04, b=0.04)
    elif getattr(module, "weight", None) is not None and module.weight.dim() == 1:
        nn.init.ones_(module.weight)


def build(case: Case, pretrained: Path) -> nn.Module:
    """Inside the strategy's construction context."""
    cls = model_class(case.model)
    if case.build == "pretrained":
        return cls.from_pretrained(pretrained / case.model)
    model = cls(config(case.model))
    if case.build == "apply_init":
        model.apply(litgpt_init)
    elif case.build == "frozen_embeddings":
        model.get_input_embeddings().weight.requires_grad_(False)
    elif case.build == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True))
    return model


def batches(rank: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(50 + rank)
    return [torch.randint(0, VOCAB, (4, SEQ), generator=gen) for _ in range(STEPS)]


def loss_of(model: nn.Module, kind: str, tokens: torch.Tensor) -> torch.Tensor:
    if kind == "t5":
        return model(input_ids=tokens, labels=tokens.flip(1)).loss
    return model(input_ids=tokens, labels=tokens).loss


def whole(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: full(v).detach().clone() for k, v in model.state_dict().items()}


class HFModule(pl.LightningModule):
    """A LightningModule as users write it: the Hugging Face model built in ``configure_model``, or in ``__init__``
    (under ``Trainer.init_module()`` for the ``"trainer_init_module"`` front)."""

    def __init__(self, case: Case, pretrained: Path) -> None:
        super().__init__()
        self.case, self.pretrained = case, pretrained
        self.record: dict[str, Any] = {"losses": []}
        if case.front == "trainer_init_module":
            self.model = build(case, pretrained)

    def configure_model(self) -> None:
        if not hasattr(self, "model"):
            self.model = build(self.case, self.pretrained)

    def on_train_start(self) -> None:
        self.record["initial"] = whole(self.model)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = loss_of(self.model, self.case.model, batch[0])
        self.record["losses"].append(loss.item())
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.cat(batches(self.global_rank))), batch_size=4)


def run_trainer(case: Case, strategy: str, pretrained: Path, out_dir: Path) -> dict[str, Any]:
    pl.seed_everything(7, verbose=False)
    trainer = cpu_trainer(strategy, max_steps=STEPS)
    with trainer.init_module():
        module = HFModule(case, pretrained)
    trainer.fit(module)
    if case.saved:
        trainer.save_checkpoint(out_dir / f"{case.name}-{strategy}.ckpt")
    return {**module.record, "final": whole(module.model)}


def run_fabric(case: Case, strategy: str, pretrained: Path, out_dir: Path) -> dict[str, Any]:
    fabric = Fabric(accelerator="cpu", devices=WORLD_SIZE, strategy=strategy)
    fabric.launch()
    fabric.seed_everything(7, verbose=False)
    if case.build == "apply_init":  # LitGPT's pretraining script: no initialisation at construction, then its own
        with fabric.init_module(empty_init=True):
            module = model_class(case.model)(config(case.model))
        module.apply(litgpt_init)
    else:
        with fabric.init_module():
            module = build(case, pretrained)
    optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-2)
    model, optimizer = fabric.setup(module, optimizer)
    record: dict[str, Any] = {"initial": whole(model), "losses": []}
    for tokens in batches(fabric.global_rank):
        loss = loss_of(model, case.model, tokens)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        record["losses"].append(loss.item())
    return {**record, "final": whole(model)}


def main(out_dir: Path) -> None:
    payload = read_payload(out_dir)
    results: dict[tuple[str, str], Any] = {}
    for case in payload["cases"]:
        for strategy in case.strategies:
            run = run_fabric if case.front == "fabric" else run_trainer
            results[(case.name, strategy)] = run(case, strategy, payload["pretrained"], out_dir)
    save_results(out_dir, int(os.environ["RANK"]), results)


if __name__ == "__main__":
    main(Path(sys.argv[1]))

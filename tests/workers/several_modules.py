"""Runs inside each of N processes (started by tests/launch.py) for tests/test_several_modules.py: a GAN-style Fabric
loop (a generator and a critic, each set up with its own optimizer, and a frozen feature module between them) under
``"ddp"`` and every stage in turn.

Each strategy trains 3 steps, saves the state of all its modules and optimizers, trains 2 more; then fresh modules
(other weights) load that checkpoint and train the same 2 steps again, and, under the sharded strategies, fresh
modules load ``"ddp"``'s file and do too. Records, per rank, the losses and the modules' weights and optimizer state
gathered whole.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
from lightning.fabric import Fabric
from torch import nn
from torch.nn import functional as F

import lightning_zero.fabric
from tests.oracle import full, full_optimizer_state
from tests.scenarios import read_payload, save_results

WORLD_SIZE = int(os.environ.get("WORLD_SIZE", 1))  # read now: Lightning's teardown removes it
BATCH, NOISE, DATA = 8, 6, 8


class Generator(nn.Sequential):
    def __init__(self) -> None:
        super().__init__(nn.Linear(NOISE, 16), nn.ReLU(), nn.Linear(16, DATA))


class Critic(nn.Sequential):
    def __init__(self) -> None:
        super().__init__(nn.Linear(DATA, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))


class Features(nn.Linear):
    """Frozen: trained by nothing, set up by the sharded strategies (``"ddp"`` refuses a module without trainable
    parameters; its users move it to the device instead)."""

    def __init__(self) -> None:
        super().__init__(DATA, DATA)
        self.requires_grad_(False)


def fabric_strategy(label: str) -> Any:
    """``"zero3_full"``: ``Zero3Strategy(state_dict_type="full")``; other labels are registered names."""
    name, _, kind = label.partition("_")
    return getattr(lightning_zero.fabric, f"Zero{name[-1]}Strategy")(state_dict_type=kind) if kind else name


class Gan:
    """The modules and optimizers of one run, set up on one Fabric the ways users do: the generator with its
    optimizer in one call, the critic first and its optimizer after (as FSDP users must)."""

    def __init__(self, strategy: str, seed: int) -> None:
        self.fabric = Fabric(accelerator="cpu", devices=WORLD_SIZE, strategy=fabric_strategy(strategy))
        self.fabric.launch()  # the processes exist already: this joins the process group
        torch.manual_seed(7)
        features = Features()  # saved by no one: the same in every run
        torch.manual_seed(seed)
        generator, critic = Generator(), Critic()
        self.g, self.g_opt = self.fabric.setup(generator, torch.optim.Adam(generator.parameters(), lr=1e-2))
        self.d = self.fabric.setup_module(critic)
        self.d_opt = self.fabric.setup_optimizers(torch.optim.Adam(self.d.parameters(), lr=1e-2, betas=(0.5, 0.9)))
        if strategy == "ddp":
            self.features = self.fabric.to_device(features)
        else:
            self.features = self.fabric.setup_module(features)

    def state(self) -> dict[str, Any]:
        return {"generator": self.g, "critic": self.d, "g_opt": self.g_opt, "d_opt": self.d_opt, "step": 0}

    def step(self, gen: torch.Generator) -> tuple[float, float]:
        """One critic step on real and generated samples (its gradients clipped), then one generator step through the
        critic (whose gradients from it are dropped by the next critic step's ``zero_grad``)."""
        real = torch.randn(BATCH, DATA, generator=gen) * 0.5 + 1.0
        fake = self.g(torch.randn(BATCH, NOISE, generator=gen))
        self.d_opt.zero_grad()
        d_loss = (
            F.softplus(-self.d(self.features(real))).mean() + F.softplus(self.d(self.features(fake.detach()))).mean()
        )
        self.fabric.backward(d_loss)
        self.fabric.clip_gradients(self.d, self.d_opt, max_norm=0.5)  # the critic's own norm, as under "ddp"
        self.d_opt.step()
        g_loss = F.softplus(-self.d(self.features(fake))).mean()
        self.fabric.backward(g_loss)
        self.g_opt.step()
        self.g_opt.zero_grad()
        return d_loss.item(), g_loss.item()

    def snapshot(self) -> dict[str, Any]:
        weights = {
            f"{k}/{n}": full(v).detach().clone()
            for k, m in (("g", self.g), ("d", self.d), ("f", self.features))
            for n, v in m.state_dict().items()
        }
        optimizers = {
            k: _copied(full_optimizer_state(o.optimizer)["state"]) for k, o in (("g", self.g_opt), ("d", self.d_opt))
        }
        return {"weights": weights, "optimizers": optimizers}


def _copied(state: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
    return {i: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()} for i, s in state.items()}


def run(strategy: str, files: Path) -> dict[str, Any]:
    gan = Gan(strategy, seed=0)
    gen = torch.Generator().manual_seed(100 + gan.fabric.global_rank)
    record: dict[str, Any] = {"losses": [gan.step(gen) for _ in range(3)]}
    saved = files / f"{strategy}.ckpt"
    gan.fabric.save(saved, {**gan.state(), "step": 3})
    record["saved"] = gan.snapshot()
    record["saved_a_file"] = saved.is_file()
    at_save = gen.get_state()
    record["continued"] = [gan.step(gen) for _ in range(2)]
    record["end"] = gan.snapshot()

    sources = {"own": saved} if strategy == "ddp" else {"own": saved, "ddp": files / "ddp.ckpt"}
    for source, path in sources.items():
        resumed = Gan(strategy, seed=1)
        state = resumed.state()
        rest = resumed.fabric.load(path, state)
        gen.set_state(at_save)
        record[f"resumed_from_{source}"] = {
            "loaded": resumed.snapshot(),
            "step": state["step"],
            "rest": rest,
            "losses": [resumed.step(gen) for _ in range(2)],
            "end": resumed.snapshot(),
        }
    if strategy != "ddp":
        record["contents"] = contents(Gan(strategy, seed=2).fabric.load(saved))
    return record


def contents(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """What ``fabric.load(path)`` returned, whole tensors by the user's names."""
    return {
        "keys": sorted(checkpoint),
        "modules": {k: {n: full(v) for n, v in checkpoint[k].items()} for k in ("generator", "critic")},
        "steps": {k: sorted(float(s["step"]) for s in checkpoint[k]["state"].values()) for k in ("g_opt", "d_opt")},
    }


def main() -> None:
    out_dir = Path(sys.argv[1])
    payload = read_payload(out_dir)
    files = out_dir / "files"
    files.mkdir(exist_ok=True)
    results = {strategy: run(strategy, files) for strategy in payload["strategies"]}
    save_results(out_dir, int(os.environ["RANK"]), results)


if __name__ == "__main__":
    main()

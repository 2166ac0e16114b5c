"""The example configs train end to end through `python -m example_modules fit` on 2 CPU processes, and learn."""

from __future__ import annotations

import csv
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from example_modules.gpt import GPTLanguageModel

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "example_modules" / "configs"


@pytest.mark.parametrize(
    ("config", "chance_loss", "max_end_loss"),
    [
        ("zero2.yaml", math.log(256), 3.0),  # GPT "tiny": 256 tokens; the Markov chain's floor is far below 3
        ("zero2_class_path.yaml", math.log(256), 3.0),
        ("zero3.yaml", math.log(256), 3.0),
        ("zero3_class_path.yaml", math.log(256), 3.0),  # Block units, activation checkpointing
        ("vision_zero2.yaml", math.log(8), 0.8),  # 8 orientations
    ],
)
def test_example_config_trains(config: str, chance_loss: float, max_end_loss: float, tmp_path: Path) -> None:
    cmd = [
        sys.executable, "-m", "example_modules", "fit",
        "--config", str(CONFIGS / config),
        f"--trainer.logger.init_args.save_dir={tmp_path}",
        "--trainer.enable_progress_bar=false",
    ]  # fmt: skip
    # A process group set up earlier in this pytest process leaves its rendezvous variables behind; the example must
    # choose its own port, as on a fresh machine.
    stale = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK")
    env = {k: v for k, v in os.environ.items() if k not in stale}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"

    report = re.search(r"^train_loss start=(\S+) end=(\S+) steps=(\d+)$", proc.stdout, re.MULTILINE)
    assert report is not None, proc.stdout[-3000:]
    start, end, steps = float(report[1]), float(report[2]), int(report[3])
    assert steps == yaml.safe_load((CONFIGS / config).read_text())["trainer"]["max_steps"]
    assert abs(start - chance_loss) < 0.3, f"an untrained model should score near chance, {chance_loss:.3f}: {start}"
    assert end < max_end_loss, f"train_loss fell only from {start} to {end}"

    (metrics,) = tmp_path.glob("*/version_0/metrics.csv")
    with metrics.open() as f:
        val_losses = [float(row["val_loss"]) for row in csv.DictReader(f) if row["val_loss"]]
    assert len(val_losses) == 2, val_losses  # val_check_interval is half of max_steps
    assert val_losses[-1] < min(val_losses[0], max_end_loss), val_losses


def test_gpt_builds_its_layers_once_in_configure_model() -> None:
    """No layers before `configure_model`; calling it again keeps the first call's parameters (Lightning calls it on
    every `fit`, `validate`, ...); GPT-2's initialisation comes from the layers' `reset_parameters()`."""
    model = GPTLanguageModel(size="tiny")
    assert not model.layers_built and not list(model.parameters())
    torch.manual_seed(0)
    model.configure_model()
    params = list(model.parameters())
    model.configure_model()
    assert all(a is b for a, b in zip(params, model.parameters(), strict=True))
    assert model.head.weight is model.tok_emb.weight
    block = model.blocks[0]
    assert abs(model.tok_emb.weight.std().item() - 0.02) < 0.001
    assert abs(block.attn.proj.weight.std().item() - 0.02 / math.sqrt(2 * 4)) < 0.0005  # scaled down with depth
    assert not block.attn.qkv.bias.any()

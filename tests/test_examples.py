"""The example configs train end to end through `python -m example_modules fit` on 2 CPU processes, and learn; so
does the hand-written Fabric loop `python -m example_modules.fabric_gpt`."""

from __future__ import annotations

import csv
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from lightning.pytorch import LightningDataModule, LightningModule

from example_modules import fabric_gpt
from example_modules.__main__ import ExampleCLI
from example_modules.gpt import GPTLanguageModel
from lightning_zero._checkpoint.directory import is_checkpoint_dir
from tests.launch import without_rendezvous

pytestmark = pytest.mark.slow  # every test here launches processes

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "example_modules" / "configs"
LOSS_REPORT = re.compile(r"^train_loss start=(\S+) end=(\S+) steps=(\d+)$", re.MULTILINE)


def fresh_env() -> dict[str, str]:
    """An example chooses its own port, as on a fresh machine."""
    return without_rendezvous(OMP_NUM_THREADS="1")


def loss_report(output: str) -> tuple[float, float, int]:
    report = LOSS_REPORT.search(output)
    assert report is not None, output[-3000:]
    return float(report[1]), float(report[2]), int(report[3])


@pytest.mark.parametrize(
    ("config", "chance_loss", "max_end_loss"),
    [
        ("zero2.yaml", math.log(256), 3.0),  # GPT "tiny": 256 tokens; the Markov chain's floor is far below 3
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
    proc = subprocess.run(cmd, cwd=REPO, env=fresh_env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"

    start, end, steps = loss_report(proc.stdout)
    assert steps == yaml.safe_load((CONFIGS / config).read_text())["trainer"]["max_steps"]
    assert abs(start - chance_loss) < 0.3, f"an untrained model should score near chance, {chance_loss:.3f}: {start}"
    assert end < max_end_loss, f"train_loss fell only from {start} to {end}"

    (metrics,) = tmp_path.glob("*/version_0/metrics.csv")
    with metrics.open() as f:
        val_losses = [float(row["val_loss"]) for row in csv.DictReader(f) if row["val_loss"]]
    assert len(val_losses) == 2, val_losses  # val_check_interval is half of max_steps
    assert val_losses[-1] < min(val_losses[0], max_end_loss), val_losses


@pytest.mark.parametrize(
    ("config", "twin", "strategy", "options"),
    [
        ("zero2_class_path.yaml", "zero2.yaml", "Zero2Strategy", {"bucket_cap_mb": 10}),
        ("zero3.yaml", "zero3_class_path.yaml", "Zero3Strategy", {}),
    ],
)
def test_a_config_is_its_trained_twin_but_for_the_strategy(
    config: str, twin: str, strategy: str, options: dict, tmp_path: Path
) -> None:
    """Configs that differ from one trained above only in how the strategy is named: parsed as the example's CLI
    parses them, each builds its strategy with its options (the defaults where it names none), and every other setting
    is its twin's."""
    import lightning_zero
    from lightning_zero._config import ZeroConfig

    cli = ExampleCLI(
        LightningModule, LightningDataModule, subclass_mode_model=True, subclass_mode_data=True, run=False,
        args=["--config", str(CONFIGS / config), f"--trainer.logger.init_args.save_dir={tmp_path}"],
    )  # fmt: skip
    built = cli.trainer.strategy
    assert type(built) is getattr(lightning_zero, strategy)
    assert built.config == ZeroConfig(stage=built.config.stage, **options)
    settings = [yaml.safe_load((CONFIGS / name).read_text()) for name in (config, twin)]
    for each in settings:
        each["trainer"].pop("strategy")
        each["trainer"]["logger"]["init_args"].pop("name")
    assert settings[0] == settings[1]


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


def test_fabric_loop_trains_and_resumes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """30 steps of the Fabric loop under ``zero3`` on 2 CPU processes: the loss falls well below chance and the
    checkpoint directory is written; the same command under ``zero2`` in one process (this one) resumes from it and
    continues where it stopped."""
    checkpoint = tmp_path / "checkpoint"
    cmd = [sys.executable, "-m", "example_modules.fabric_gpt", "--strategy", "zero3", "--devices", "2",
           "--steps", "30", "--checkpoint", str(checkpoint)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=fresh_env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    start, end, steps = loss_report(proc.stdout)
    assert steps == 30 and abs(start - math.log(256)) < 0.3, start
    assert end < start - 1.0, f"train_loss fell only from {start} to {end}"
    assert is_checkpoint_dir(checkpoint)

    fabric_gpt.main(["--strategy", "zero2", "--devices", "1", "--steps", "32", "--checkpoint", str(checkpoint)])
    output = capsys.readouterr().out
    assert f"resumed from {checkpoint} at step 30" in output
    resumed_start, _, resumed_steps = loss_report(output)
    assert resumed_steps == 2 and resumed_start < start - 1.0, resumed_start

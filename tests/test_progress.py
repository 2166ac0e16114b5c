"""``python -m lightning_zero consolidate`` draws a progress bar on a terminal, and only there: stderr captured to a
file (as a log is) gets none, a pseudo-terminal (a real one, from the ``pty`` module) gets tqdm's bar, and ``--quiet``
silences it on the terminal too. Each case consolidates a real checkpoint; the terminal's cases are processes of their
own, attached to it."""

from __future__ import annotations

import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from lightning_zero.__main__ import main as command_line
from tests.launch import without_gloo_connections, without_rendezvous
from tests.scenarios import MODULE_KWARGS
from tests.workers.modules import Classifier

pytestmark = pytest.mark.slow  # every test here launches processes

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = tmp_path_factory.mktemp("progress") / "checkpoint"
    pl.seed_everything(0)
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy="zero2", max_steps=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    trainer.fit(Classifier(**MODULE_KWARGS))
    trainer.save_checkpoint(target)
    return target


def consolidate(checkpoint: Path, output: Path, *flags: str) -> tuple[str, str]:
    """Run the command in a process whose stderr is a pseudo-terminal; return its stdout and what it drew there."""
    return on_a_terminal([sys.executable, "-m", "lightning_zero", "consolidate", str(checkpoint), str(output), *flags])


def on_a_terminal(argv: list[str]) -> tuple[str, str]:
    env = without_rendezvous(PYTHONPATH=str(REPO))
    controller, attached = pty.openpty()
    fcntl.ioctl(attached, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))  # a terminal's size: 80 columns
    with subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=attached) as proc:
        os.close(attached)
        drawn = b""
        while True:  # read the terminal as it is written, so the child never blocks on a full one
            try:
                chunk = os.read(controller, 4096)
            except OSError:  # EIO: the child closed its end
                break
            if not chunk:
                break
            drawn += chunk
        stdout = proc.stdout.read().decode()
    os.close(controller)
    assert proc.returncode == 0, drawn.decode(errors="replace")
    return stdout, drawn.decode(errors="replace")


def test_consolidate_draws_a_bar_only_on_a_terminal(
    checkpoint: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    assert command_line(["consolidate", str(checkpoint), str(tmp_path / "logged.ckpt")]) == 0
    logged = capfd.readouterr()  # file descriptors 1 and 2, as a log file receives them
    assert logged.err == "" and logged.out == f"wrote {tmp_path / 'logged.ckpt'}\n"

    stdout, drawn = consolidate(checkpoint, tmp_path / "terminal.ckpt")
    assert "reading checkpoint: 100%" in drawn and "\r" in drawn, drawn  # tqdm redraws the line in place
    assert stdout == f"wrote {tmp_path / 'terminal.ckpt'}\n"

    stdout, drawn = consolidate(checkpoint, tmp_path / "quiet.ckpt", "--quiet")
    assert drawn == "" and stdout == "", drawn

    weights = [torch.load(tmp_path / f"{name}.ckpt")["state_dict"] for name in ("logged", "terminal", "quiet")]
    for other in weights[1:]:
        assert other.keys() == weights[0].keys()
        assert all(torch.equal(other[k], weights[0][k]) for k in other)


def test_fabric_load_of_a_whole_checkpoint_draws_a_bar_on_a_terminal(checkpoint: Path) -> None:
    """``fabric.load(path)`` with no ``state`` reads every tensor of a directory whole: a large one takes a while."""
    script = (
        "import sys; from lightning.fabric import Fabric; import lightning_zero;"
        " fabric = Fabric(accelerator='cpu', devices=1, strategy='zero2'); fabric.launch();"
        " print(sorted(fabric.load(sys.argv[1])['state_dict'])[:1])"
    )
    stdout, drawn = on_a_terminal([sys.executable, "-c", script, str(checkpoint)])
    assert "reading checkpoint: 100%" in drawn, drawn
    assert without_gloo_connections(stdout).startswith("['"), stdout  # the weights came back


RESUME = (
    "import sys; import lightning.pytorch as pl; import lightning_zero;"
    " from tests.scenarios import MODULE_KWARGS; from tests.workers.modules import Classifier;"
    " trainer = pl.Trainer(accelerator='cpu', devices=1, strategy='zero2', max_steps=3, logger=False,"
    " enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False);"
    " trainer.fit(Classifier(**MODULE_KWARGS), ckpt_path=sys.argv[1]); print(trainer.global_step)"
)


def test_resuming_from_a_directory_draws_a_bar_only_on_a_terminal(checkpoint: Path) -> None:
    """``Trainer.fit(ckpt_path=DIR)`` loads every rank's shards straight into the live tensors; rank 0 draws the bar
    of its bytes, on a terminal only."""
    stdout, drawn = on_a_terminal([sys.executable, "-c", RESUME, str(checkpoint)])
    assert "loading checkpoint: 100%" in drawn and "\r" in drawn, drawn
    assert stdout.strip().endswith("3"), stdout  # resumed at step 2, trained one more

    logged = subprocess.run(
        [sys.executable, "-c", RESUME, str(checkpoint)], cwd=REPO, env=without_rendezvous(PYTHONPATH=str(REPO)),
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert "loading checkpoint" not in logged.stderr and "\r" not in logged.stderr, logged.stderr

"""The charts the benchmarks draw beside their tables, from the same numbers.

matplotlib is optional (the ``bench`` extra): without it a benchmark prints its tables and says how to get the
charts. Every chart carries its provenance in a footer: the device the numbers were measured on, the torch and
Lightning releases, the commit they were measured at (``+changes`` when the work tree differed from it) and the date.
By default a chart is written to ``docs/assets/charts/``, where the documentation shows it; ``--chart PATH`` writes it
elsewhere.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
CHARTS = REPO / "docs" / "assets" / "charts"
COLORS = {
    "ddp": "#7f7f7f", "zero1": "#1f77b4", "zero2": "#ff7f0e", "zero3": "#2ca02c", "fsdp2": "#9467bd",
    "hybrid": "#8c564b", "zero++": "#d62728",
}  # fmt: skip
DPI = 100


def add_chart_argument(parser: argparse.ArgumentParser, name: str) -> None:
    """``--chart PATH``: where the benchmark draws its chart (``docs/assets/charts/NAME.png`` by default)."""
    default = CHARTS / f"{name}.png"
    parser.add_argument("--chart", type=Path, default=default, help=f"the PNG (default {default.relative_to(REPO)})")


def color(strategy: str) -> str:
    """One colour per strategy in every chart: the first known name ``strategy`` starts with."""
    return next((c for name, c in COLORS.items() if strategy.startswith(name)), "#000000")


def pyplot() -> Any:
    """matplotlib's ``pyplot`` drawing to files, or ``None`` (with a note on stderr) where matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print('matplotlib is not installed, so no chart: `pip install -e ".[bench]"` draws one', file=sys.stderr)
        return None
    return plt


def cpu() -> str:
    """This machine's processor, the cores this process may use and the load average as the benchmark started, e.g.
    ``"AMD EPYC 7B13, 2 cores, load 0.3"``: CPU times measured on a busy machine are not an idle one's."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {len(os.sched_getaffinity(0))} cores, load {LOAD:.1f}"


def _revision() -> str:
    """The commit checked out, with ``+changes`` if the package or the benchmarks differ from it."""

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else ""

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    if git("status", "--porcelain", "--untracked-files=no", "--", "lightning_zero", "benchmarks"):
        commit += "+changes"
    return commit


REVISION = _revision()  # as the benchmark starts: the code that measured, whatever changes while it runs
LOAD = os.getloadavg()[0]  # what else the machine was running as the benchmark started, which its times reflect


RELEASES = f"torch {version('torch')}, lightning {version('lightning')}"  # what the numbers were measured on


def provenance(device: str) -> str:
    """``"<device> | torch 2.13.0+cpu, lightning 2.6.6 | commit abc1234 | 2026-11-23"``: where, on what and when the
    numbers were measured."""
    return f"{device} | {RELEASES} | commit {REVISION} | {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d}"


def save(figure: Any, path: Path, device: str) -> None:
    """Write ``figure`` to ``path`` with its provenance in a footer, and say where."""
    figure.text(0.99, 0.005, provenance(device), ha="right", va="bottom", fontsize=7, color="#555555")
    figure.tight_layout(rect=(0, 0.03, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=DPI)
    import matplotlib.pyplot as plt

    plt.close(figure)
    print(f"\nchart: {path}", flush=True)

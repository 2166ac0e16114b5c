"""The GPU benchmark's own code runs, on the CPU: so a machine with a GPU measures instead of debugging the script, and
draws its chart."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # every test here launches processes

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_benchmark_runs_on_the_cpu(tmp_path: Path) -> None:
    """The GPU benchmark's code on the CPU, ``ddp`` and the sharded path of stage 3 (the one that differs most; each
    stage's path is trained against ``ddp`` elsewhere), with its profile of each run."""
    table = tmp_path / "table.md"
    argv = [
        sys.executable, "-m", "benchmarks.bench_gpu", "--device", "cpu", "--sizes", "tiny", "--precision", "32-true",
        "--strategies", "ddp,zero3", "--steps", "2", "--warmup", "1", "--rounds", "1", "--batch-size", "2",
        "--out", str(table), "--chart", str(tmp_path / "gpu.png"), "--profile", str(tmp_path / "profile"),
    ]  # fmt: skip
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [line.split(" | ") for line in table.read_text().splitlines() if line.startswith("| tiny |")]
    assert [row[1] for row in rows] == ["ddp", "zero3"], table.read_text()
    for strategy in ("ddp", "zero3"):  # operators by device (here the host) and by host time, from the timed steps
        profile = (tmp_path / "profile" / f"tiny-{strategy}.txt").read_text()
        assert "by device time" in profile and "by host time" in profile and "aten::mm" in profile, profile[:2000]
    for row in rows:
        assert float(row[2].replace(",", "")) > 0  # tokens/s
    assert rows[0][3] == "1.000"  # ddp against itself
    assert "failed" not in done.stdout, done.stdout
    assert (tmp_path / "gpu.png").read_bytes().startswith(b"\x89PNG"), done.stdout  # the chart, from the same runs


def test_offload_capacity_chart_is_drawn_from_its_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The capacity benchmark needs a CUDA GPU; its chart's code runs here on rows shaped as it measures them (two of
    the table in docs/guides/offload.md: device and host bytes per parameter, largest model, what bounds it)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # the benchmark runs as a script, beside its helpers
    import bench_offload

    rows = {"plain (no ZeRO), fp32": (20.06, 17.38, 4.2, "GPU"), "zero3_offload, fp32": (0.83, 17.70, 7.6, "host")}
    bench_offload.capacity_chart(rows, "capacity", "a GPU", tmp_path / "capacity.png")
    assert (tmp_path / "capacity.png").read_bytes().startswith(b"\x89PNG")


def test_infinity_benchmark_measures_every_way_and_the_capacity_run(tmp_path: Path) -> None:
    """The ZeRO-Infinity benchmark at a tiny size: a row of numbers for each way asked for and for the capacity run,
    the chart, and nothing left in the offload directory."""
    offload = tmp_path / "offload"
    offload.mkdir()
    argv = [
        sys.executable, "-m", "benchmarks.bench_infinity", "--width", "64", "--layers", "2", "--steps", "2",
        "--ways", "ddp,zero3_infinity", "--capacity-layers", "3", "--offload-dir", str(offload),
        "--chart", str(tmp_path / "infinity.png"),
    ]  # fmt: skip
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [line.strip("|").split(" | ") for line in done.stdout.splitlines() if line.startswith("| ")]
    rows = [[cell.strip() for cell in row] for row in rows if row[0].strip() != "way"]
    ways = ["ddp", "zero3_infinity, auto", "zero3_infinity, auto"]  # the last: the capacity run; zero3 ways name their
    # page_cache option
    assert [row[0] for row in rows] == ways, done.stdout
    for row in rows:
        params, states, per_param, step, largest = (float(row[i]) for i in (2, 3, 11, 12, 14))
        assert params == pytest.approx((3 if row is rows[-1] else 2) * (64 * 64 + 64) / 1e9, rel=1e-3)
        assert states > 0 and per_param > 0 and step > 0 and largest > 0, row
        assert all(float(peak) > 0 for column in (4, 5) for peak in row[column].split(" / ")), row
        assert row[1] == "none" and row[13] == "-", row  # no memory limit without --memory-limit
    assert "mapped" in done.stdout  # the offload files' note
    assert done.stdout.count("Peak RSS before the first step") == 2  # the ways', then the capacity run's
    assert list(offload.iterdir()) == []  # each run's directory removed after it
    assert (tmp_path / "infinity.png").read_bytes().startswith(b"\x89PNG"), done.stdout


def test_host_benchmark_times_and_profiles_each_strategy(tmp_path: Path) -> None:
    """The host-time benchmark on one rank: a row of step times with the speed against ``ddp``, and the profile split
    of each run into the framework's parts, which add up to the step."""
    table = tmp_path / "host.md"
    argv = [
        sys.executable, "-m", "benchmarks.bench_host", "--world-sizes", "1", "--strategies", "ddp,zero3",
        "--rounds", "1", "--steps", "3", "--warmup", "2", "--profile", "--out", str(table),
        "--chart", str(tmp_path / "host.png"),
    ]  # fmt: skip
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = table.read_text().splitlines()
    timed = [line for line in lines if line.startswith("| 1 | ") and line.count("|") == 4]
    assert len(timed) == 1, table.read_text()
    ddp_ms, zero3 = (cell.strip() for cell in timed[0].split("|")[2:4])
    assert float(ddp_ms) > 0 and zero3.endswith("x)"), timed
    header = next(line for line in lines if line.startswith("| ranks | strategy |"))
    names = [cell.strip() for cell in header.strip("|").split("|")][3:]
    profiled = [line.split(" | ") for line in lines if line.startswith("| 1 | ") and line.count("|") > 4]
    assert [row[1] for row in profiled] == ["ddp", "zero3"], table.read_text()
    for row in profiled:
        step, parts = float(row[2]), dict(zip(names, (float(cell.strip(" |")) for cell in row[3:]), strict=True))
        # the shares are of the sampled step (they add up to it by construction): what is checked is that samples
        # landed in the model's own code, so the sampler saw the timed steps
        assert step > 0 and min(parts.values()) >= 0 and parts["model"] > 0, row
    assert (tmp_path / "host.png").read_bytes().startswith(b"\x89PNG")

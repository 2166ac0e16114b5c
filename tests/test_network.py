"""Two hosts on a network of a cluster's speed (benchmarks/bench_network.py's namespaces: a private network whose
loopback is rate-limited, a private ``/dev/shm`` per host, torchrun joining them on 127.0.0.1): plain stage 3 and
ZeRO++ both train across them, and ZeRO++'s bytes between the hosts, counted in the collectives, are a small share of
plain stage 3's. Skipped, with the reason, where the namespaces cannot be made (not root, no ``unshare`` or ``tc``)."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _namespaces_missing() -> str | None:
    if os.geteuid() != 0:
        return "making network and mount namespaces needs root"
    for tool in ("unshare", "tc", "ip"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed"
    probe = subprocess.run(["unshare", "--net", "--mount", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"`unshare --net --mount` fails here: {probe.stderr.strip()}"
    return None


@pytest.mark.slow
def test_zero_plus_plus_trains_across_two_hosts_on_a_limited_link(tmp_path: Path) -> None:
    missing = _namespaces_missing()
    if missing is not None:
        pytest.skip(missing)
    results = tmp_path / "network.json"
    command = [
        sys.executable, "-m", "benchmarks.bench_network", "--rates", "10", "--steps", "3", "--width", "64",
        "--layers", "1", "--way", "zero3", "--way", "zero++", "--results", str(results),
        "--chart", str(tmp_path / "network.png"), "--timeout", "300",
    ]  # fmt: skip
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=420)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    measured = json.loads(results.read_text())["10.0"]
    plain, zero_plus_plus = measured["zero3"], measured["zero++"]
    assert math.isfinite(plain["loss"]) and math.isfinite(zero_plus_plus["loss"])
    assert abs(zero_plus_plus["loss"] - plain["loss"]) < 0.02 * plain["loss"]  # quantized, not another run
    assert plain["crossing_per_step"] > 0
    assert zero_plus_plus["crossing_per_step"] < 0.3 * plain["crossing_per_step"], measured

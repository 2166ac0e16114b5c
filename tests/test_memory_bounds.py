"""Communication memory that does not grow with the model: the stage 1/2 engine's reusable buffers stay a few buckets
however many buckets the model has (stage 1 gathers two buckets at a time; stage 2 also stages at most three buckets
for its reduce-scatters and reuses those buffers for the gather)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.launch import launch

pytestmark = pytest.mark.slow  # every test here launches processes


def test_engine_retains_a_few_buckets(tmp_path: Path) -> None:
    launch("tests.workers.memory_bounds", [str(tmp_path)], world_size=2)
    results = json.loads((tmp_path / "pool.json").read_text())
    for stage, in_flight in (("1", 2), ("2", 3)):
        run = results[stage]
        assert run["buckets"] >= 6, run  # enough buckets that a pool growing with them would show
        assert max(run["retained"]) <= in_flight * run["largest_bucket"], (stage, run)
        assert run["retained"][-1] > 0, run  # the buffers are kept from step to step, not allocated each time

"""The CPU ranks of a benchmark: started by the test suite's launcher, each writing its results as JSON into an output
directory that the starting process reads them back from."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from tests.launch import launch


def run_ranks(module: str, argv: list[str], world_size: int, **launch_options: Any) -> list[Any]:
    """Run ``python -m module argv --out-dir DIR`` on ``world_size`` ranks; each rank's results, in rank order."""
    with tempfile.TemporaryDirectory() as tmp:
        launch(module, [*argv, "--out-dir", tmp], world_size, **launch_options)
        return [json.loads(_file(Path(tmp), rank).read_text()) for rank in range(world_size)]


def save_rank_results(out_dir: Path, rank: int, results: Any) -> None:
    """In a rank: its results, for :func:`run_ranks`."""
    _file(out_dir, rank).write_text(json.dumps(results))


def _file(out_dir: Path, rank: int) -> Path:
    return out_dir / f"rank{rank}.json"

"""Hybrid sharding (``shard_group_size="node"``) on 2 simulated nodes of 2 CPU processes, against ``"ddp"`` on the
same 4: every stage ends with DDP's weights, optimizer state and losses (the parity tolerance of tests/test_parity.py:
gradients are summed in another order, within a node and then across nodes); parameter gathers never cross a node;
the checkpoints are the ordinary sharded directories, resumed on 2 ranks of one node under another stage.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.launch import launch
from tests.test_parity import close

WORKER = "tests.workers.hybrid"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("hybrid")
    launch(WORKER, ["train", str(out)], world_size=4, nodes=2, timeout=300)
    launch(WORKER, ["resume", str(out)], world_size=2, timeout=300)
    return {**torch.load(out / "train.pt", weights_only=False), **torch.load(out / "resume.pt", weights_only=False)}


def assert_matches(actual: dict[str, Any], expected: dict[str, Any], what: str) -> None:
    close(torch.tensor(actual["losses"]), torch.tensor(expected["losses"]), f"{what} losses")
    for key, value in expected["state_dict"].items():
        close(actual["state_dict"][key], value, f"{what} {key}")
    for index, entries in expected["optimizer"]["state"].items():
        for key, value in entries.items():
            close(torch.as_tensor(actual["optimizer"]["state"][index][key]), torch.as_tensor(value), f"{what} {key}")


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_matches_ddp(runs: dict[str, Any], stage: int) -> None:
    assert_matches(runs[f"zero{stage}"], runs["ddp"], f"hybrid zero{stage}")


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_only_gradient_shards_cross_nodes(runs: dict[str, Any], stage: int) -> None:
    """Parameters are gathered within a node; what crosses is the all-reduce of this rank's gradient shards."""
    crossing = runs[f"zero{stage}"]["across_nodes"]
    assert crossing.get("all_gather", 0) == 0 and crossing.get("reduce_scatter", 0) == 0, crossing
    assert crossing["all_reduce"] > 0, crossing


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_checkpoint_restores_exactly_on_one_node_under_another_stage(runs: dict[str, Any], stage: int) -> None:
    """Saved at step 6 by the 4 ranks of two shard groups, restored by 2 ranks of one node under another stage:
    weights, buffers (rank 0's, as a single file keeps them), optimizer state and step exactly as saved."""
    saved, restored = runs[f"zero{stage}"], runs[f"restored-zero{stage}"]
    assert restored["global_step"] == saved["global_step"] == 6
    assert restored["state_dict"].keys() == saved["state_dict"].keys()
    for key, value in saved["state_dict"].items():
        assert torch.equal(restored["state_dict"][key], value), key
    for index, entries in saved["optimizer"]["state"].items():
        for key, value in entries.items():
            assert torch.equal(torch.as_tensor(restored["optimizer"]["state"][index][key]), torch.as_tensor(value))


def test_training_goes_on_after_the_resume(runs: dict[str, Any]) -> None:
    continued = runs["continued"]  # the stage-2 hybrid checkpoint, on 2 ranks under stage 3, to step 8
    assert continued["global_step"] == 8 and len(continued["losses"]) == 2
    assert all(torch.isfinite(torch.tensor(continued["losses"])))

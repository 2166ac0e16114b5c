"""Stages 1 and 2 against DDP: the same seeded LightningModule, written for DDP, trained for several steps on 2 and
3 CPU processes under each strategy, must end with the same parameters, buffers, optimizer state and losses, within
the fp32 tolerance of tests/oracle.py (where its derivation lives).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.oracle import compare_runs, shard_numels
from tests.scenarios import Scenario, StrategySpec, run_scenarios, trainer_features
from tests.workers.modules import Classifier

pytestmark = pytest.mark.slow  # every test here launches processes

ZERO = (StrategySpec("zero1"), StrategySpec("zero2"))


def scenario(name: str, **fields: Any) -> Scenario:
    return Scenario(name, strategies=("ddp", *ZERO), **fields)


SCENARIOS = [
    *trainer_features(*ZERO),
    scenario("scheduler_lists", module_kwargs={"scheduler": "step", "config_style": "list"}),
    scenario("memory", module_kwargs={"hidden": 256}, max_steps=2),
    # Save at step 12 (an epoch end on 2 and on 3 ranks), resume in a fresh Trainer and module, compare with DDP
    # doing the same: model, optimizer state, scheduler and loop progress all went through the checkpoint.
    scenario("resume", module_kwargs={"scheduler": "step", "config_style": "dict"}, resume_at=12, max_steps=14),
    # An ordinary DDP checkpoint resumed under each stage.
    scenario("resume_from_ddp", resume_at=12, max_steps=14, save_with=StrategySpec("ddp")),
]
BY_NAME = {s.name: s for s in SCENARIOS}


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"{n}procs")
def results(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[dict[Any, Any]]:
    return run_scenarios(SCENARIOS, request.param, tmp_path_factory.mktemp("parity"))


@pytest.mark.parametrize("name", BY_NAME)
@pytest.mark.parametrize("strategy", ZERO, ids=str)
def test_matches_ddp(results: list[dict[Any, Any]], name: str, strategy: StrategySpec) -> None:
    compare_runs(results, BY_NAME[name], strategy)


@pytest.mark.parametrize("strategy", ZERO, ids=str)
def test_ranks_hold_identical_parameters(results: list[dict[Any, Any]], strategy: StrategySpec) -> None:
    """After each step every rank's shards are gathered everywhere: all ranks end with the same full weights."""
    for name in BY_NAME:
        first = results[0][(name, strategy.label)]["state_dict"]
        for rank, per_rank in enumerate(results[1:], start=1):
            for key, value in per_rank[(name, strategy.label)]["state_dict"].items():
                if key.startswith("norm.running") or key.endswith("num_batches_tracked"):
                    continue  # BatchNorm statistics follow each rank's own batches, as under DDP
                assert torch.equal(value, first[key]), f"{name}/{strategy}: rank {rank} differs in {key}"


def test_scenarios_change_the_weights(results: list[dict[Any, Any]]) -> None:
    """Guards the oracle: training really moved the parameters, so matching DDP means something."""
    torch.manual_seed(0)
    initial = Classifier().state_dict()
    final = results[0][("adam", "ddp")]["state_dict"]
    assert (final["mid.weight"] - initial["mid.weight"]).abs().max() > 1e-3


def memory_shards(world_size: int, rank: int) -> tuple[int, int, int, int]:
    """:func:`~tests.oracle.shard_numels` of the module of the "memory" scenario."""
    return shard_numels(Classifier(**BY_NAME["memory"].module_kwargs), world_size, rank)


@pytest.mark.parametrize("strategy", ZERO, ids=str)
def test_optimizer_state_is_sharded(results: list[dict[Any, Any]], strategy: StrategySpec) -> None:
    """Adam's two moments exist on each rank only for its shard: the total over ranks, plus nothing but the
    per-parameter step counters (4 bytes each), which every rank keeps."""
    world_size = len(results)
    ddp_bytes = results[0][("memory", "ddp")]["state_bytes"][0]
    num_params, _, _, rows = memory_shards(world_size, 0)
    moments_total = ddp_bytes - 4 * num_params
    per_rank = []
    for rank, per in enumerate(results):
        _, local, _, _ = memory_shards(world_size, rank)
        got = per[("memory", strategy.label)]["state_bytes"][0]
        assert got == 2 * 4 * local + 4 * num_params, f"rank {rank}: {got} bytes of optimizer state"
        per_rank.append(got - 4 * num_params)
    replicated = 1  # the 0-dim temperature: every rank keeps its moments
    assert sum(per_rank) == moments_total + 2 * 4 * (world_size - 1) * replicated  # else an exact partition
    assert max(per_rank) <= moments_total / world_size + 2 * 4 * rows  # uneven splits: at most a row per parameter


def test_stage2_keeps_only_gradient_shards(results: list[dict[Any, Any]]) -> None:
    world_size = len(results)
    ddp_grads = results[0][("memory", "ddp")]["grad_bytes"]
    for rank, per in enumerate(results):
        zero2 = per[("memory", "zero2")]
        num_params, _, padded, rows = memory_shards(world_size, rank)
        assert zero2["full_grads"] == 0, "full gradients outlived backward"
        assert zero2["grad_bytes"] == 4 * (padded + num_params)  # padded shards and one presence flag each
        assert zero2["grad_bytes"] <= ddp_grads / world_size + 4 * (rows + num_params)  # padding: a row + flag each
        zero1 = per[("memory", "zero1")]
        assert zero1["full_grads"] == num_params
        assert zero1["grad_bytes"] == ddp_grads + 4 * num_params  # full gradients, in buckets with their flags

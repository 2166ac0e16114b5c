"""Stages 1 and 2 against DDP: the same seeded LightningModule, written for DDP, trained for several steps on 2 and
3 CPU processes under each strategy, must end with the same parameters, buffers, optimizer state and losses.

Tolerance (fp32): the strategies sum the same per-rank gradients in a different order (bucketed all-reduce vs
reduce-scatter, division before or after the sum), which moves results by a few ulps (~1e-7 relative) per step.
Adam normalises each element's update to about ``lr`` (1e-2 here), so for the rare element whose gradient sits at the
noise floor those ulps can move the update by a relative 1e-3 (1e-5 absolute, seen on 3 ranks with a 65k-element
weight): hence ``atol=5e-5``, still 200 times below a single step of ``lr``. Anything wrong in sharding, gathering or
reduction moves parameters by whole steps, orders of magnitude above it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.launch import run_scenarios

RTOL, ATOL = 1e-4, 5e-5
ZERO = ["zero1", "zero2"]


def scenario(name: str, reference: str = "ddp", **fields: Any) -> dict[str, Any]:
    return {"name": name, "module": "classifier", "strategies": [reference, *ZERO], **fields}


UNUSED_OK = "ddp_find_unused_parameters_true"  # DDP needs this where parameters go without gradients

SCENARIOS = [
    scenario("adam"),
    scenario("param_groups", module_kwargs={"optimizer": "adamw_groups", "config_style": "list"}),
    scenario("sgd_scheduler_dict", module_kwargs={"optimizer": "sgd", "scheduler": "step", "config_style": "dict"}),
    scenario("scheduler_lists", module_kwargs={"scheduler": "step", "config_style": "list"}),
    scenario("lars_trust_ratio", module_kwargs={"optimizer": "lars"}),
    scenario("accumulate", trainer_kwargs={"accumulate_grad_batches": 3}, max_steps=4),
    scenario("clip_norm", trainer_kwargs={"gradient_clip_val": 0.05, "gradient_clip_algorithm": "norm"}),
    scenario("clip_value", trainer_kwargs={"gradient_clip_val": 0.01, "gradient_clip_algorithm": "value"}),
    scenario("frozen", module_kwargs={"freeze_first": True}),
    scenario("unused_every_other_step", reference=UNUSED_OK, module_kwargs={"unused_branch": True}),
    scenario(
        "batchnorm_eval",
        module_kwargs={"batch_norm": True},
        limit_val_batches=2,
        trainer_kwargs={"val_check_interval": 3},
        after_fit=["validate", "test", "predict"],
    ),
    scenario("memory", module_kwargs={"hidden": 256}, max_steps=2),
    # Save at step 12 (an epoch end on 2 and on 3 ranks), resume in a fresh Trainer and module, compare with DDP
    # doing the same: model, optimizer state, scheduler and loop progress all went through the checkpoint.
    scenario("resume", module_kwargs={"scheduler": "step", "config_style": "dict"}, resume_at=12, max_steps=14),
    # An ordinary DDP checkpoint resumed under each stage.
    scenario("resume_from_ddp", resume_at=12, max_steps=14, save_with="ddp"),
    {"name": "manual_one", "module": "manual", "strategies": ["ddp", *ZERO]},
    {
        "name": "manual_two_optimizers",
        "module": "manual",
        "module_kwargs": {"two_optimizers": True},
        "strategies": [UNUSED_OK, *ZERO],
    },
]
NAMES = [s["name"] for s in SCENARIOS]


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"{n}procs")
def results(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[dict[Any, Any]]:
    return run_scenarios([dict(s) for s in SCENARIOS], request.param, tmp_path_factory.mktemp("parity"))


def close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(actual.float(), expected.float(), rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


def compare_optimizer_states(actual: dict[str, Any], expected: dict[str, Any], what: str) -> None:
    assert actual["state"].keys() == expected["state"].keys(), f"{what}: parameters with state differ"
    for index, expected_state in expected["state"].items():
        for key, value in expected_state.items():
            got = actual["state"][index][key]
            if isinstance(value, torch.Tensor):
                close(got, value, f"{what} state[{index}][{key}]")
            else:
                assert got == value, f"{what} state[{index}][{key}]"
    for got, want in zip(actual["param_groups"], expected["param_groups"], strict=True):
        assert {k: v for k, v in got.items() if k != "params"} == {k: v for k, v in want.items() if k != "params"}


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("strategy", ZERO)
def test_matches_ddp(results: list[dict[Any, Any]], name: str, strategy: str) -> None:
    spec = next(s for s in SCENARIOS if s["name"] == name)
    compare_runs(results, spec, strategy)


def compare_runs(results: list[dict[Any, Any]], spec: dict[str, Any], strategy: str) -> None:
    """Every rank's run of ``spec`` under ``strategy`` ended like its run under the scenario's first strategy."""
    name = spec["name"]
    for rank, per_rank in enumerate(results):
        expected, actual = per_rank[(name, spec["strategies"][0])], per_rank[(name, strategy)]
        what = f"{name}/{strategy}/rank{rank}"
        assert len(actual["losses"]) == len(expected["losses"]) > 0
        close(torch.tensor(actual["losses"]), torch.tensor(expected["losses"]), f"{what} losses")
        assert actual["state_dict"].keys() == expected["state_dict"].keys()
        for key, value in expected["state_dict"].items():
            close(actual["state_dict"][key], value, f"{what} {key}")
        assert len(actual["optimizers"]) == len(expected["optimizers"])
        for i, (got, want) in enumerate(zip(actual["optimizers"], expected["optimizers"], strict=True)):
            compare_optimizer_states(got, want, f"{what} optimizer{i}")
        assert actual["lrs"] == expected["lrs"]
        for key, value in expected["callback_metrics"].items():
            assert actual["callback_metrics"][key] == pytest.approx(value, rel=RTOL, abs=ATOL), f"{what} {key}"
        for fn in spec.get("after_fit", []):
            if fn == "predict":
                close(actual["predict"], expected["predict"], f"{what} predict")
            else:
                # one dict of metrics per dataloader; pytest.approx compares a dict, not a list of them
                assert [pytest.approx(m, rel=RTOL, abs=ATOL) for m in expected[fn]] == actual[fn], f"{what} {fn}"


@pytest.mark.parametrize("strategy", ZERO)
def test_ranks_hold_identical_parameters(results: list[dict[Any, Any]], strategy: str) -> None:
    """After each step every rank's shards are gathered everywhere: all ranks end with the same full weights."""
    for name in NAMES:
        first = results[0][(name, strategy)]["state_dict"]
        for rank, per_rank in enumerate(results[1:], start=1):
            for key, value in per_rank[(name, strategy)]["state_dict"].items():
                if key.startswith("norm.running") or key.endswith("num_batches_tracked"):
                    continue  # BatchNorm statistics follow each rank's own batches, as under DDP
                assert torch.equal(value, first[key]), f"{name}/{strategy}: rank {rank} differs in {key}"


def test_scenarios_change_the_weights(results: list[dict[Any, Any]]) -> None:
    """Guards the oracle: training really moved the parameters, so matching DDP means something."""
    from tests.workers.modules import Classifier

    torch.manual_seed(0)
    initial = Classifier().state_dict()
    final = results[0][("adam", "ddp")]["state_dict"]
    assert (final["mid.weight"] - initial["mid.weight"]).abs().max() > 1e-3


def shard_numels(name: str, world_size: int, rank: int) -> tuple[int, int, int, int]:
    """(parameters, this rank's shard elements, padded shard elements, elements in one row of each parameter)
    of the scenario's module."""
    from lightning_zero._engine.layout import ShardSpec
    from tests.workers.modules import Classifier

    spec = next(s for s in SCENARIOS if s["name"] == name)
    module = Classifier(**spec.get("module_kwargs", {}))
    specs = [ShardSpec(p.shape, world_size) for p in module.parameters() if p.requires_grad]
    local = sum(s.local_numel(rank) for s in specs)
    return len(specs), local, sum(s.padded_numel for s in specs), sum(s.row_numel for s in specs)


@pytest.mark.parametrize("strategy", ZERO)
def test_optimizer_state_is_sharded(results: list[dict[Any, Any]], strategy: str) -> None:
    """Adam's two moments exist on each rank only for its shard: the total over ranks, plus nothing but the
    per-parameter step counters (4 bytes each), which every rank keeps."""
    world_size = len(results)
    ddp_bytes = results[0][("memory", "ddp")]["state_bytes"][0]
    num_params, _, _, rows = shard_numels("memory", world_size, 0)
    moments_total = ddp_bytes - 4 * num_params
    per_rank = []
    for rank, per in enumerate(results):
        _, local, _, _ = shard_numels("memory", world_size, rank)
        got = per[("memory", strategy)]["state_bytes"][0]
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
        num_params, _, padded, rows = shard_numels("memory", world_size, rank)
        assert zero2["full_grads"] == 0, "full gradients outlived backward"
        assert zero2["grad_bytes"] == 4 * (padded + num_params)  # padded shards and one presence flag each
        assert zero2["grad_bytes"] <= ddp_grads / world_size + 4 * (rows + num_params)  # padding: a row + flag each
        zero1 = per[("memory", "zero1")]
        assert zero1["full_grads"] == num_params
        assert zero1["grad_bytes"] == ddp_grads + 4 * num_params  # full gradients, in buckets with their flags


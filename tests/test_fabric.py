"""The Fabric front end against Fabric's ``"ddp"``: a hand-written loop over a seeded module, each rank drawing its own
random batches, trained on 2 and 3 CPU processes under ``"zero1"``, ``"zero2"`` and ``"zero3"`` (and the offload
names), must end with the losses, parameters and optimizer state (gathered whole) of the same loop under ``"ddp"``,
within the tolerances of tests/oracle.py (by precision flag). Checkpoints move between stages, world sizes and front
ends exactly: what a resume holds after loading is what was saved, bit for bit.

One launch per world size runs everything (tests/workers/fabric.py): the 2-rank launch writes the checkpoints, the
3-rank one loads them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_zero import consolidate_checkpoint
from tests.oracle import BY_PRECISION, FP32, compare_runs
from tests.scenarios import (
    Clip,
    ClipBy,
    Exchange,
    FabricScenario,
    FrontEnd,
    Resume,
    Saver,
    Setup,
    Source,
    StrategySpec,
    run_scenarios,
)
from tests.workers.modules_zero3 import TiedLM

pytestmark = pytest.mark.slow  # every test here launches processes

ZERO1, ZERO2, ZERO3 = (StrategySpec(f"zero{stage}") for stage in (1, 2, 3))
EVERY_STAGE = ("ddp", ZERO1, ZERO2, ZERO3)
SGD = {"optimizer": "sgd"}  # the precision scenarios': as in tests/test_precision.py, for the bf16 tolerance

SCENARIOS = [
    # the classifier's odd shapes (a 0-dim parameter, one with fewer rows than ranks); stage 3 moves the optimizer
    # built before `setup` to the shards
    FabricScenario("setup_together", strategies=EVERY_STAGE),
    # units (the blocks), a tied embedding, a unit called twice; stage 3's optimizer built on the shards
    FabricScenario("setup_separately", module="tied_lm", strategies=EVERY_STAGE, setup=Setup.SEPARATELY),
    # a global norm over the shards; stage 3 keeps each unit's gradients across the micro-batches of `no_backward_sync`
    # with the shards, gradients and optimizer state in files too (`"zero3_infinity"`, under the temporary directory)
    FabricScenario(
        "accumulate_clip_norm",
        module="tied_lm",
        strategies=(*EVERY_STAGE, "zero3_infinity"),
        steps=3,
        accumulate=3,
        clip=Clip(ClipBy.NORM, 0.5),
    ),
    FabricScenario("clip_value", strategies=EVERY_STAGE, clip=Clip(ClipBy.VALUE, 0.01)),
    # stage 3 creates the parameters on the meta device and materialises them shard by shard: the values eager
    # construction gives under the same seed
    FabricScenario("init_module", module="tied_lm", strategies=("ddp", ZERO3, "zero3_infinity"), init_module=True),
    FabricScenario("bf16_mixed", module_kwargs=SGD, strategies=EVERY_STAGE, steps=4, precision="bf16-mixed"),
    FabricScenario("bf16_true", module_kwargs=SGD, strategies=EVERY_STAGE, steps=4, precision="bf16-true"),
    FabricScenario("offload", strategies=("ddp", "zero2_offload", "zero3_offload", "zero3_infinity")),
]
BY_NAME = {s.name: s for s in SCENARIOS}
PAIRS = [(s.name, strategy) for s in SCENARIOS for strategy in s.compared]

FABRIC_ZERO2 = Saver(FrontEnd.FABRIC, ZERO2)
RESUMES = [
    Resume("fabric_zero2_to_fabric_zero3", FABRIC_ZERO2, FrontEnd.FABRIC, ZERO3),
    Resume("fabric_zero2_consolidated_to_fabric_zero3", FABRIC_ZERO2, FrontEnd.FABRIC, ZERO3, Source.CONSOLIDATED),
    Resume("fabric_zero2_to_trainer_zero1", FABRIC_ZERO2, FrontEnd.TRAINER, ZERO1),
    Resume("trainer_zero3_to_fabric_zero1", Saver(FrontEnd.TRAINER, ZERO3), FrontEnd.FABRIC, ZERO1),
]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fabric_checkpoints")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, checkpoints: Path) -> dict[int, list[dict[Any, Any]]]:
    """Each rank's results per world size: 2 ranks train and save, then (the single files consolidated here, without
    a process group) 3 ranks train and load."""
    runs = {}
    for world_size, exchange in ((2, Exchange.SAVE), (3, Exchange.LOAD)):
        if exchange is Exchange.LOAD:
            for saver in {r.saver for r in RESUMES if r.source is Source.CONSOLIDATED}:
                directory = checkpoints / saver.label
                consolidate_checkpoint(directory, directory.with_suffix(".ckpt"))
        out = tmp_path_factory.mktemp(f"fabric{world_size}")
        worker = "tests.workers.fabric"
        runs[world_size] = run_scenarios(
            SCENARIOS, world_size, out, worker, checkpoints=checkpoints, resumes=RESUMES, exchange=exchange
        )
    return runs


@pytest.mark.parametrize(("name", "strategy"), PAIRS, ids=[f"{n}-{s}" for n, s in PAIRS])
@pytest.mark.parametrize("world_size", [2, 3], ids=lambda n: f"{n}procs")
def test_matches_ddp(runs: dict[int, list[dict[Any, Any]]], world_size: int, name: str, strategy: StrategySpec) -> None:
    scenario = BY_NAME[name]
    compare_runs(runs[world_size], scenario, strategy, BY_PRECISION.get(scenario.precision, FP32))


def test_training_moved_the_weights(runs: dict[int, list[dict[Any, Any]]]) -> None:
    """Guards the oracle: the loop really changed the weights, so matching ``"ddp"`` means something."""
    torch.manual_seed(0)
    initial = TiedLM().state_dict()
    final = runs[2][0][("setup_separately", "ddp")]["state_dict"]
    assert (final["blocks.2.up.weight"] - initial["blocks.2.up.weight"]).abs().max() > 1e-3


@pytest.mark.parametrize("world_size", [2, 3], ids=lambda n: f"{n}procs")
def test_init_module_builds_without_memory_and_materialises_eager_values(
    runs: dict[int, list[dict[Any, Any]]], world_size: int
) -> None:
    """Under ``fabric.init_module()`` stage 3 allocates no parameter (every one is a lazy tensor, the tied head
    included); after ``setup`` the weights are those eager construction gives, bit for bit."""
    for per_rank in runs[world_size]:
        eager, meta = per_rank[("init_module", "ddp")], per_rank[("init_module", "zero3")]
        assert eager["built_lazily"] == []
        parameters = {name for name, _ in TiedLM().named_parameters(remove_duplicate=False)}
        assert meta["built_lazily"] == sorted(parameters)
        assert meta["initial"].keys() == eager["initial"].keys()
        for key, value in eager["initial"].items():
            assert torch.equal(meta["initial"][key], value), key


def assert_same_state(actual: dict[str, Any], expected: dict[str, Any], what: str) -> None:
    """Module state and optimizer state equal bit for bit (a checkpoint stores tensors exactly)."""
    assert actual["state_dict"].keys() == expected["state_dict"].keys(), what
    for key, value in expected["state_dict"].items():
        assert torch.equal(actual["state_dict"][key], value), f"{what}: {key}"
    (got,), (want,) = actual["optimizers"], expected["optimizers"]
    assert got["state"].keys() == want["state"].keys(), what
    for index, entries in want["state"].items():
        assert got["state"][index].keys() == entries.keys(), f"{what}: state[{index}]"
        for key, value in entries.items():
            assert torch.equal(got["state"][index][key], value), f"{what}: state[{index}][{key}]"
    assert actual["lrs"] == expected["lrs"], what


@pytest.mark.parametrize("resume", RESUMES, ids=lambda r: r.name)
def test_resume_restores_exactly(runs: dict[int, list[dict[Any, Any]]], resume: Resume) -> None:
    """Saved on 2 ranks by one front end and stage, loaded on 3 by another, into a module with other weights: every
    rank holds exactly what was saved."""
    saved = runs[2][0][("saved", resume.saver.label)]
    for rank, per_rank in enumerate(runs[3]):
        loaded = per_rank[("loaded", resume.name)]
        assert_same_state(loaded, saved, f"{resume.name}/rank{rank}")
        if resume.front_end is FrontEnd.TRAINER:
            continue
        if resume.saver.front_end is FrontEnd.FABRIC:  # the saver's own entry is restored into `state` too
            assert loaded["step"] == saved["step"]
        else:  # what a Trainer checkpoint holds beyond module and optimizer comes back from `fabric.load`
            assert loaded["rest"]["global_step"] == resume.saver.steps


def test_consolidated_fabric_checkpoint(runs: dict[int, list[dict[Any, Any]]], checkpoints: Path) -> None:
    """``consolidate_checkpoint`` of a Fabric checkpoint directory: one file with the whole weights and optimizer
    state as saved, the Fabric state's other entries, and Lightning's version (so a plain ``Trainer`` takes it)."""
    saved = runs[2][0][("saved", FABRIC_ZERO2.label)]
    checkpoint = torch.load((checkpoints / FABRIC_ZERO2.label).with_suffix(".ckpt"), weights_only=False)
    assert checkpoint["step"] == saved["step"] and "pytorch-lightning_version" in checkpoint
    for key, value in saved["state_dict"].items():
        assert torch.equal(checkpoint["state_dict"][key], value), key
    (state,) = checkpoint["optimizer_states"]
    for index, entries in saved["optimizers"][0]["state"].items():
        for key, value in entries.items():
            assert torch.equal(state["state"][index][key], value), (index, key)

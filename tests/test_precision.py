"""Precision flags under every stage against DDP with the same flag, and the ZeRO mixed-precision mode; the tolerance
of each flag, and of master weights against fp32 training, is derived in tests/oracle.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision

from lightning_zero._core.precision import take_over_scaler
from lightning_zero.pytorch.precision import zero_aware
from tests.oracle import BY_PRECISION, MASTER_WEIGHTS, close, shard_numels
from tests.scenarios import Scenario, StrategySpec, run_scenarios
from tests.workers.modules import Classifier

ZERO = ["zero1", "zero2", "zero3"]
MASTER = {"master_weights": True}
MASTERS = {stage: StrategySpec(f"zero{stage}", MASTER) for stage in (1, 2, 3)}
MASTER_FP32_REDUCE = StrategySpec("zero2", {**MASTER, "reduce_dtype": "float32"})
WIDE = {"hidden": 256}


def flag_scenario(flag: str) -> Scenario:
    return Scenario(flag, module_kwargs={"optimizer": "sgd"}, max_steps=4, trainer_kwargs={"precision": flag},
                    strategies=["ddp", *ZERO])  # fmt: skip


SCENARIOS = [flag_scenario(flag) for flag in BY_PRECISION]
SCENARIOS += [
    # ZeRO mixed precision: a bf16 module trained by an fp32 optimizer on fp32 master shards
    Scenario("master_bf16", module_kwargs=WIDE, max_steps=3, trainer_kwargs={"precision": "bf16-true"},
             strategies=[MASTERS[1], MASTERS[2], MASTER_FP32_REDUCE, MASTERS[3]]),
    # the same run saved at step 3 and restored in a fresh Trainer (nothing left to train): the fp32 masters are back
    Scenario("master_restored", module_kwargs=WIDE, max_steps=3, trainer_kwargs={"precision": "bf16-true"},
             strategies=[MASTERS[2]], resume_at=3),
    Scenario("fp32_reference", module_kwargs=WIDE, max_steps=3, strategies=["ddp"]),
    # fp16 with master shards: dynamic loss scaling; an overflow injected on rank 1 only at step 2
    Scenario("fp16_overflow", module="overflow", module_kwargs={"optimizer": "sgd"}, max_steps=4,
             trainer_kwargs={"precision": "16-true"}, strategies=[MASTERS[1], MASTERS[2]]),
    Scenario("fp16_resume", module="overflow", module_kwargs={"optimizer": "sgd"}, max_steps=4,
             trainer_kwargs={"precision": "16-true"}, strategies=[MASTERS[1], MASTERS[2]], resume_at=3),
]  # fmt: skip


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[Any, Any]]:
    return run_scenarios(SCENARIOS, 2, tmp_path_factory.mktemp("precision"))


@pytest.mark.parametrize("flag", list(BY_PRECISION))
@pytest.mark.parametrize("strategy", ZERO)
@pytest.mark.slow
def test_flag_matches_ddp(results: list[dict[Any, Any]], flag: str, strategy: str) -> None:
    tolerance = BY_PRECISION[flag]
    for per_rank in results:
        expected, actual = per_rank[(flag, "ddp")], per_rank[(flag, strategy)]
        for key, value in expected["state_dict"].items():
            assert actual["state_dict"][key].dtype == value.dtype, key
            close(actual["state_dict"][key], value, f"{flag}/{strategy} {key}", tolerance)
        close(torch.tensor(actual["losses"]), torch.tensor(expected["losses"]), f"{flag}/{strategy} losses", tolerance)


@pytest.mark.parametrize("strategy", [MASTERS[1], MASTERS[2], MASTER_FP32_REDUCE, MASTERS[3]], ids=str)
@pytest.mark.slow
def test_master_weights_track_fp32_training(results: list[dict[Any, Any]], strategy: StrategySpec) -> None:
    """bf16 forward/backward with fp32 master shards follows fp32 DDP to within bf16 rounding (the
    ``MASTER_WEIGHTS`` tolerance of tests/oracle.py)."""
    expected, actual = results[0][("fp32_reference", "ddp")], results[0][("master_bf16", strategy.label)]
    # stages 1 and 2 keep the bf16 module and fp32 masters aside; in stage 3 the fp32 shards are the masters
    dtype = torch.float32 if strategy.name == "zero3" else torch.bfloat16
    for key, value in expected["state_dict"].items():
        assert actual["state_dict"][key].dtype == dtype, key
        close(actual["state_dict"][key], value, f"{strategy} {key}", MASTER_WEIGHTS)


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.slow
def test_memory_matches_the_zero_paper(results: list[dict[Any, Any]], stage: int) -> None:
    """Per-rank model-state bytes for Adam with 16-bit parameters: stage 1 4 Psi + 12 Psi/N, stage 2
    2 Psi + 14 Psi/N, stage 3 14 Psi/N (fp32 shards are the masters, gradient shards 16-bit as stage 2's), within 5%
    plus padding (at most one row of each parameter, and one flag each)."""
    world_size = len(results)
    run = ("master_bf16", MASTERS[stage].label)
    for rank, per_rank in enumerate(results):
        state = per_rank[run]["model_state"]
        psi = sum(v.numel() for k, v in per_rank[run]["state_dict"].items() if not k.startswith("norm"))
        num_params, _, _, rows = shard_numels(Classifier(**WIDE), world_size, rank)
        formula = {1: 4 * psi + 12 * psi / world_size, 2: 2 * psi + 14 * psi / world_size, 3: 14 * psi / world_size}
        padding = 16 * (rows + num_params)
        assert abs(state.total - formula[stage]) <= 0.05 * formula[stage] + padding, (state, formula[stage])
        if stage < 3:
            assert state.master_weights > 0 and state.parameters == 2 * psi


@pytest.mark.slow
def test_overflow_on_one_rank_skips_the_step_everywhere(results: list[dict[Any, Any]]) -> None:
    for strategy in (MASTERS[1].label, MASTERS[2].label):
        per_rank = [r[("fp16_overflow", strategy)] for r in results]
        for r in per_rank:
            # Step 0: a loss of 1.4 times 2**16 exceeds fp16's 65504 on every rank, the usual first backoff.
            # Step 2: only rank 1 overflows, and both ranks skip.
            assert r["skipped_steps"] == [0, 2], r["skipped_steps"]
            assert r["loss_scale"] == 2.0**14  # backed off twice from 2**16, everywhere
        first = per_rank[0]["state_dict"]
        for key, value in per_rank[1]["state_dict"].items():
            assert torch.equal(value, first[key]), key


@pytest.mark.slow
def test_loss_scale_survives_a_checkpoint(results: list[dict[Any, Any]]) -> None:
    """fp16_resume saved at step 3 (after two backoffs) and resumed: the scale came back from the checkpoint."""
    for strategy in (MASTERS[1].label, MASTERS[2].label):
        for per_rank in results:
            assert per_rank[("fp16_resume", strategy)]["loss_scale_at_start"] == 2.0**14


@pytest.mark.slow
def test_checkpoint_keeps_the_fp32_masters(results: list[dict[Any, Any]]) -> None:
    label = MASTERS[2].label
    for per_rank in results:
        saved, restored = per_rank[("master_bf16", label)], per_rank[("master_restored", label)]
        assert all(m.dtype == torch.float32 for m in restored["masters"])
        for before, after in zip(saved["masters"], restored["masters"], strict=True):
            assert torch.equal(before, after)
        for key, value in saved["state_dict"].items():
            assert torch.equal(restored["state_dict"][key], value), key


def test_the_engine_of_every_fit_scales_once_it_took_the_grad_scaler() -> None:
    """`"16-mixed"` on a GPU: the first engine takes the plugin's `GradScaler` (it would see only this rank's shards);
    a later `fit` (a resume) builds another engine, which must scale too though the plugin has no scaler left."""
    plugin = zero_aware(MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu")))
    assert take_over_scaler(plugin) and plugin.scaler is None
    assert take_over_scaler(plugin)
    assert not take_over_scaler(zero_aware(MixedPrecision("bf16-mixed", "cpu")))

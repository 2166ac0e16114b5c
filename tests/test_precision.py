"""Precision flags under every stage against DDP with the same flag, and the ZeRO mixed-precision mode.

Tolerances follow the dtype the gradients are reduced in: fp32 (``*-mixed``: autocast compute, fp32 parameters and
gradients) keeps the parity tolerance of tests/test_parity.py; bf16 (8 bits of mantissa, a relative rounding step of
2**-8 = 0.4%) and fp16 (2**-11) reductions summed in another order differ by about one rounding step per element
and step, so four SGD steps stay within 2e-2 (bf16) and 4e-3 (fp16) absolute on weights of order 0.3.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.launch import run_scenarios

ZERO = ["zero1", "zero2", "zero3"]
MASTER = "master_weights=true"
TOLERANCE = {"32-true": (1e-4, 1e-5), "bf16-mixed": (1e-4, 1e-5), "16-mixed": (1e-4, 1e-5),
             "bf16-true": (2e-2, 2e-2), "16-true": (4e-3, 4e-3)}


def flag_scenario(flag: str) -> dict[str, Any]:
    return {"name": flag, "module": "classifier", "module_kwargs": {"optimizer": "sgd"}, "max_steps": 4,
            "trainer_kwargs": {"precision": flag}, "strategies": ["ddp", *ZERO]}


SCENARIOS = [flag_scenario(flag) for flag in TOLERANCE]
SCENARIOS += [
    # ZeRO mixed precision: a bf16 module trained by an fp32 optimizer on fp32 master shards
    {"name": "master_bf16", "module": "classifier", "module_kwargs": {"hidden": 256}, "max_steps": 3,
     "trainer_kwargs": {"precision": "bf16-true"},
     "strategies": [f"zero1:{MASTER}", f"zero2:{MASTER}", f"zero2:{MASTER},reduce_dtype=float32", f"zero3:{MASTER}"]},
    # the same run saved at step 3 and restored in a fresh Trainer (nothing left to train): the fp32 masters are back
    {"name": "master_restored", "module": "classifier", "module_kwargs": {"hidden": 256}, "max_steps": 3,
     "trainer_kwargs": {"precision": "bf16-true"}, "strategies": [f"zero2:{MASTER}"], "resume_at": 3},
    {"name": "fp32_reference", "module": "classifier", "module_kwargs": {"hidden": 256}, "max_steps": 3,
     "strategies": ["ddp"]},
    # fp16 with master shards: dynamic loss scaling; an overflow injected on rank 1 only at step 2
    {"name": "fp16_overflow", "module": "overflow", "module_kwargs": {"optimizer": "sgd"}, "max_steps": 4,
     "trainer_kwargs": {"precision": "16-true"}, "strategies": [f"zero1:{MASTER}", f"zero2:{MASTER}"]},
    {"name": "fp16_resume", "module": "overflow", "module_kwargs": {"optimizer": "sgd"}, "max_steps": 4,
     "trainer_kwargs": {"precision": "16-true"}, "strategies": [f"zero1:{MASTER}", f"zero2:{MASTER}"],
     "resume_at": 3},
]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[Any, Any]]:
    return run_scenarios([dict(s) for s in SCENARIOS], 2, tmp_path_factory.mktemp("precision"))


@pytest.mark.parametrize("flag", list(TOLERANCE))
@pytest.mark.parametrize("strategy", ZERO)
def test_flag_matches_ddp(results: list[dict[Any, Any]], flag: str, strategy: str) -> None:
    rtol, atol = TOLERANCE[flag]
    for per_rank in results:
        expected, actual = per_rank[(flag, "ddp")], per_rank[(flag, strategy)]
        for key, value in expected["state_dict"].items():
            assert actual["state_dict"][key].dtype == value.dtype, key
            torch.testing.assert_close(actual["state_dict"][key].float(), value.float(), rtol=rtol, atol=atol)
        torch.testing.assert_close(torch.tensor(actual["losses"]), torch.tensor(expected["losses"]), rtol=rtol,
                                   atol=atol)


@pytest.mark.parametrize(
    "strategy", [f"zero1:{MASTER}", f"zero2:{MASTER}", f"zero2:{MASTER},reduce_dtype=float32", f"zero3:{MASTER}"]
)
def test_master_weights_track_fp32_training(results: list[dict[Any, Any]], strategy: str) -> None:
    """bf16 forward/backward with fp32 master shards follows fp32 DDP to within bf16 rounding. Adam's normalised step
    moves an element whose gradient is pure rounding noise by up to ``lr`` = 1e-2 either way, so three steps allow
    3.5e-2 absolute; all else stays within 2e-2."""
    expected, actual = results[0][("fp32_reference", "ddp")], results[0][("master_bf16", strategy)]
    # stages 1 and 2 keep the bf16 module and fp32 masters aside; in stage 3 the fp32 shards are the masters
    dtype = torch.float32 if strategy.startswith("zero3") else torch.bfloat16
    for key, value in expected["state_dict"].items():
        assert actual["state_dict"][key].dtype == dtype, key
        torch.testing.assert_close(actual["state_dict"][key].float(), value, rtol=2e-2, atol=3.5e-2)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_memory_matches_the_zero_paper(results: list[dict[Any, Any]], stage: int) -> None:
    """Per-rank model-state bytes for Adam with 16-bit parameters: stage 1 4 Psi + 12 Psi/N, stage 2
    2 Psi + 14 Psi/N, stage 3 16 Psi/N (fp32 shards are the masters), within 5% plus padding (at most one row of
    each parameter, and one flag each)."""
    from tests.test_parity import shard_numels

    world_size = len(results)
    for rank, per_rank in enumerate(results):
        state = per_rank[("master_bf16", f"zero{stage}:{MASTER}")]["model_state"]
        psi = sum(v.numel() for k, v in per_rank[("master_bf16", f"zero{stage}:{MASTER}")]["state_dict"].items()
                  if not k.startswith("norm"))
        num_params, _, _, rows = shard_numels("memory", world_size, rank)
        formula = {1: 4 * psi + 12 * psi / world_size, 2: 2 * psi + 14 * psi / world_size, 3: 16 * psi / world_size}
        padding = 16 * (rows + num_params)
        assert abs(state.total - formula[stage]) <= 0.05 * formula[stage] + padding, (state, formula[stage])
        if stage < 3:
            assert state.master_weights > 0 and state.parameters == 2 * psi


def test_overflow_on_one_rank_skips_the_step_everywhere(results: list[dict[Any, Any]]) -> None:
    for strategy in (f"zero1:{MASTER}", f"zero2:{MASTER}"):
        per_rank = [r[("fp16_overflow", strategy)] for r in results]
        for r in per_rank:
            # Step 0: a loss of 1.4 times 2**16 exceeds fp16's 65504 on every rank, the usual first backoff.
            # Step 2: only rank 1 overflows, and both ranks skip.
            assert r["skipped_steps"] == [0, 2], r["skipped_steps"]
            assert r["loss_scale"] == 2.0**14  # backed off twice from 2**16, everywhere
        first = per_rank[0]["state_dict"]
        for key, value in per_rank[1]["state_dict"].items():
            assert torch.equal(value, first[key]), key


def test_loss_scale_survives_a_checkpoint(results: list[dict[Any, Any]]) -> None:
    """fp16_resume saved at step 3 (after two backoffs) and resumed: the scale came back from the checkpoint."""
    for strategy in (f"zero1:{MASTER}", f"zero2:{MASTER}"):
        for per_rank in results:
            assert per_rank[("fp16_resume", strategy)]["loss_scale_at_start"] == 2.0**14


def test_checkpoint_keeps_the_fp32_masters(results: list[dict[Any, Any]]) -> None:
    for per_rank in results:
        saved, restored = per_rank[("master_bf16", f"zero2:{MASTER}")], per_rank[("master_restored", f"zero2:{MASTER}")]
        assert all(m.dtype == torch.float32 for m in restored["masters"])
        for before, after in zip(saved["masters"], restored["masters"], strict=True):
            assert torch.equal(before, after)
        for key, value in saved["state_dict"].items():
            assert torch.equal(restored["state_dict"][key], value), key

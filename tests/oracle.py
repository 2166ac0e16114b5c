"""The oracle of the multi-process tests: a run under a ZeRO strategy must end as the same run under the reference
strategy (``"ddp"`` with the same seed, data and precision flag) ends, on every rank, within the tolerances below.

Tolerances, by the dtype the gradients are reduced in:

- **fp32** (:data:`FP32`, ``rtol=1e-4, atol=5e-5``): the strategies sum the same per-rank gradients in a different
  order (bucketed all-reduce vs reduce-scatter, division before or after the sum), which moves results by a few ulps
  (~1e-7 relative) per step. Adam normalises each element's update to about ``lr`` (1e-2 here), so for the rare
  element whose gradient sits at the noise floor those ulps can move the update by a relative 1e-3 (1e-5 absolute,
  seen on 3 ranks with a 65k-element weight): hence ``atol=5e-5``, still 200 times below a single step of ``lr``.
  Anything wrong in sharding, gathering or reduction moves parameters by whole steps, orders of magnitude above it.
- **precision flags** (:data:`BY_PRECISION`, SGD runs of four steps): fp32 gradients (``32-true``, and ``*-mixed``:
  autocast compute, fp32 parameters and gradients) keep ``rtol=1e-4, atol=1e-5``; bf16 (8 bits of mantissa, a relative
  rounding step of 2**-8 = 0.4%) and fp16 (2**-11) reductions summed in another order differ by about one rounding
  step per element and step, so four SGD steps stay within 2e-2 (bf16) and 4e-3 (fp16) absolute on weights of order
  0.3.
- **ZeRO mixed precision against fp32 training** (:data:`MASTER_WEIGHTS`): bf16 forward/backward with fp32 master
  shards follows fp32 DDP to within bf16 rounding; Adam's normalised step moves an element whose gradient is pure
  rounding noise by up to ``lr`` = 1e-2 either way, so three steps allow 3.5e-2 absolute; all else stays within 2e-2.

Whatever a checkpoint restores is compared exactly (``torch.equal``): it stores tensors bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from tests.scenarios import Runs, Scenario, StrategySpec


@dataclass(frozen=True)
class Tolerance:
    rtol: float
    atol: float

    def approx(self, expected: Any) -> Any:
        return pytest.approx(expected, rel=self.rtol, abs=self.atol)


FP32 = Tolerance(rtol=1e-4, atol=5e-5)
BY_PRECISION = {
    "32-true": Tolerance(1e-4, 1e-5),
    "bf16-mixed": Tolerance(1e-4, 1e-5),
    "16-mixed": Tolerance(1e-4, 1e-5),
    "bf16-true": Tolerance(2e-2, 2e-2),
    "16-true": Tolerance(4e-3, 4e-3),
}
MASTER_WEIGHTS = Tolerance(rtol=2e-2, atol=3.5e-2)


def close(actual: torch.Tensor, expected: torch.Tensor, what: str, tolerance: Tolerance = FP32) -> None:
    torch.testing.assert_close(
        actual.float(), expected.float(), rtol=tolerance.rtol, atol=tolerance.atol, msg=lambda m: f"{what}: {m}"
    )


def compare_optimizer_states(
    actual: dict[str, Any], expected: dict[str, Any], what: str, tolerance: Tolerance = FP32
) -> None:
    """Two optimizer state dicts with their shards gathered whole: the same entries, values within ``tolerance``,
    the same hyperparameters."""
    assert actual["state"].keys() == expected["state"].keys(), f"{what}: parameters with state differ"
    for index, expected_state in expected["state"].items():
        for key, value in expected_state.items():
            got = actual["state"][index][key]
            if isinstance(value, torch.Tensor):
                close(got, value, f"{what} state[{index}][{key}]", tolerance)
            else:
                assert got == value, f"{what} state[{index}][{key}]"
    for got, want in zip(actual["param_groups"], expected["param_groups"], strict=True):
        assert {k: v for k, v in got.items() if k != "params"} == {k: v for k, v in want.items() if k != "params"}


def compare_runs(
    results: list[dict[Any, Any]], scenario: Runs, strategy: StrategySpec, tolerance: Tolerance = FP32
) -> None:
    """Every rank's run of ``scenario`` under ``strategy`` ended like its run under the scenario's reference: losses,
    the module's state (gathered whole), optimizer states, and what the run recorded beyond them (learning rates,
    logged metrics, the results of evaluation loops after ``fit``)."""
    name = scenario.name
    for rank, per_rank in enumerate(results):
        expected, actual = per_rank[(name, scenario.reference.label)], per_rank[(name, strategy.label)]
        what = f"{name}/{strategy.label}/rank{rank}"
        assert len(actual["losses"]) == len(expected["losses"]) > 0
        close(torch.tensor(actual["losses"]), torch.tensor(expected["losses"]), f"{what} losses", tolerance)
        assert actual["state_dict"].keys() == expected["state_dict"].keys()
        for key, value in expected["state_dict"].items():
            close(actual["state_dict"][key], value, f"{what} {key}", tolerance)
        assert len(actual["optimizers"]) == len(expected["optimizers"])
        for i, (got, want) in enumerate(zip(actual["optimizers"], expected["optimizers"], strict=True)):
            compare_optimizer_states(got, want, f"{what} optimizer{i}", tolerance)
        assert actual["lrs"] == expected["lrs"]
        if not isinstance(scenario, Scenario):  # a Fabric loop records no more
            continue
        for key, value in expected["callback_metrics"].items():
            assert actual["callback_metrics"][key] == tolerance.approx(value), f"{what} {key}"
        for loop in scenario.after_fit:
            if loop == "predict":
                close(actual["predict"], expected["predict"], f"{what} predict", tolerance)
            else:
                # one dict of metrics per dataloader; pytest.approx compares a dict, not a list of them
                assert [tolerance.approx(m) for m in expected[loop]] == actual[loop], f"{what} {loop}"


def shard_numels(module: nn.Module, world_size: int, rank: int) -> tuple[int, int, int, int]:
    """Stages 1 and 2's split of ``module``'s trainable parameters: (parameters, this rank's shard elements, padded
    shard elements, elements in one row of each parameter)."""
    from lightning_zero._engine.layout import ShardSpec

    specs = [ShardSpec(p.shape, world_size) for p in module.parameters() if p.requires_grad]
    local = sum(s.local_numel(rank) for s in specs)
    return len(specs), local, sum(s.padded_numel for s in specs), sum(s.row_numel for s in specs)


# --- whole tensors: what runs are compared by ------------------------------------------------------------------------


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor, gathered if sharded (stage 3 keeps DTensor parameters)."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def full_optimizer_state(optimizer: Any) -> dict[str, Any]:
    """The optimizer's state dict with shards gathered whole, to compare with DDP's."""
    state_dict = optimizer.state_dict()
    whole = {index: {k: full(v) for k, v in entries.items()} for index, entries in state_dict["state"].items()}
    return {**state_dict, "state": whole}


def snapshot(trainer: pl.Trainer) -> dict[str, Any]:
    """What a run ends with: the module's state dict, the first optimizer's state (whole), the step and the lr."""
    module = trainer.lightning_module
    return {
        "state_dict": {k: v.detach().clone() for k, v in module.state_dict().items()},
        "optimizer": full_optimizer_state(trainer.optimizers[0]),
        "global_step": trainer.global_step,
        "lr": trainer.optimizers[0].param_groups[0]["lr"],
    }


def full_snapshot(trainer: pl.Trainer) -> dict[str, Any]:
    """:func:`snapshot` with stage 3's sharded parameters gathered whole, and this rank's losses."""
    module = trainer.lightning_module
    return {
        **snapshot(trainer),
        "state_dict": {k: full(v).detach().clone() for k, v in module.state_dict().items()},
        "losses": list(module.losses),
    }

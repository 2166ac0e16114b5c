"""``zero_auto``'s choice, in process: the candidate picked for fake budgets and model sizes (each candidate's bytes
derived by hand from the ZeRO paper's formulas below), its named errors, its registration and the CLI's string form.
The 2-rank parity with the strategy named by hand is tests/test_auto_parity.py."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGIES
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.strategies import StrategyRegistry

import lightning_zero
from lightning_zero._auto.budget import Budget
from lightning_zero._auto.candidates import TENSOR_OBJECTS, Candidate, Working, Workload, needs
from lightning_zero._auto.choice import (
    RESERVE_FLOOR,
    AutoChoiceError,
    AutoOptions,
    Verdict,
    check_optimizer,
    decide,
)
from lightning_zero._config import ZeroConfig
from lightning_zero._core.auto import _counted, _parameters, _working
from tests.workers.modules import Classifier

MILLION = 1_000_000
# fp32 Adam on 2 ranks, per parameter: zero1 4 + 4 + 8/2 = 12 B; zero2 4 + 4/2 + 8/2 = 10 B; zero3 16/2 = 8 B;
# zero2_offload 4 + 4/2 on the device, 8/2 on the host; zero3_offload all 8 B on the host; infinity 8 B on disk
WORKLOAD = Workload(MILLION, MILLION, "32-true", False, "adam", num_ranks=2)
NO_RESERVE = AutoOptions.from_options(activation_reserve=0)


def cpu(memory: float, disk: float | None = 1e9) -> Budget:
    return Budget(memory=int(memory), host=None, disk=None if disk is None else int(disk), source="test")


def gpu(device: float, host: float, disk: float = 1e9) -> Budget:
    return Budget(memory=int(device), host=int(host), disk=int(disk), source="test")


def test_needs_follow_the_papers_formulas() -> None:
    by_name = {c.label: (n.device, n.host, n.disk) for c, n in needs(WORKLOAD).items()}
    assert by_name == {
        "zero1": (12 * MILLION, 0, 0),
        "zero2": (10 * MILLION, 0, 0),
        "zero3": (8 * MILLION, 0, 0),
        "zero2_offload": (6 * MILLION, 4 * MILLION, 0),
        "zero3_offload": (0, 8 * MILLION, 0),
        "zero3_infinity": (0, 0, 8 * MILLION),
    }


# SGD with momentum, per parameter on 2 ranks: zero1 4 + 4 + 4/2 = 10 B; zero2 4 + 4/2 + 4/2 = 8 B; zero3 12/2 = 6 B
SGD = replace(WORKLOAD, optimizer="sgd-momentum")


@pytest.mark.parametrize(
    ("workload", "budget", "expected"),
    [
        (WORKLOAD, gpu(12e6, 1e9), "zero1"),  # exactly fits
        (WORKLOAD, gpu(12e6 - 1, 1e9), "zero2"),
        (WORKLOAD, gpu(9e6, 1e9), "zero3"),
        (WORKLOAD, gpu(7e6, 1e9), "zero2_offload"),
        (WORKLOAD, gpu(5e6, 1e9), "zero3_offload"),
        (WORKLOAD, gpu(5e6, 7e6), "zero3_infinity"),  # host memory too small for zero3_offload's 8 MB
        # on CPU ranks stepping Adam the host step (torch's fused kernel) comes first: the host is the device
        (WORKLOAD, cpu(20e6), "zero2_offload"),
        (WORKLOAD, cpu(10e6 - 1), "zero3_offload"),
        (WORKLOAD, cpu(7e6), "zero3_infinity"),  # offload to host memory does not help on the CPU: the same memory
        # stepping SGD, every candidate runs the multi-tensor kernels: the order of traffic
        (SGD, cpu(10e6), "zero1"),
        (SGD, cpu(10e6 - 1), "zero2"),
        (SGD, cpu(7e6), "zero3"),
    ],
)
def test_the_first_candidate_that_fits_is_chosen(workload: Workload, budget: Budget, expected: str) -> None:
    choice = decide(workload, budget, NO_RESERVE)
    assert choice.name == expected
    verdicts = [row.verdict for row in choice.rows]
    assert verdicts.count(Verdict.CHOSEN) == 1
    assert all(v not in (Verdict.FITS, Verdict.CHOSEN) for v in verdicts[: verdicts.index(Verdict.CHOSEN)])


def test_the_default_reserve_is_a_quarter_and_at_least_the_floor() -> None:
    default = AutoOptions.from_options()
    assert default.reserve_of(4 * RESERVE_FLOOR) == RESERVE_FLOOR  # a quarter
    assert default.reserve_of(8 * RESERVE_FLOOR) == 2 * RESERVE_FLOOR
    assert default.reserve_of(2 * RESERVE_FLOOR) == RESERVE_FLOOR  # the floor, not half as much
    assert default.reserve_of(RESERVE_FLOOR) == RESERVE_FLOOR // 2  # at most half: the rest must hold the model
    assert AutoOptions.from_options(activation_reserve=0.25).reserve_of(2 * RESERVE_FLOOR) == RESERVE_FLOOR // 2


def test_the_reserve_is_kept_out_of_the_budget() -> None:
    budget = gpu(16e6, 1e9)
    assert decide(WORKLOAD, budget, AutoOptions.from_options(activation_reserve=0.25)).name == "zero1"
    assert decide(WORKLOAD, budget, AutoOptions.from_options(activation_reserve=0.3)).name == "zero2"
    assert decide(WORKLOAD, budget, AutoOptions.from_options(activation_reserve=int(6e6))).name == "zero2"
    assert decide(WORKLOAD, budget, AutoOptions.from_options(activation_reserve=int(6e6))).reserve == int(6e6)


@pytest.mark.parametrize(
    ("options", "budget", "expected"),
    [
        ({"max_stage": 2}, gpu(9e6, 1e9), "zero2_offload"),  # zero3 would fit
        ({"max_stage": 1, "offload": False}, cpu(20e6), "zero1"),
        ({"offload": "cpu"}, gpu(5e6, 1e9), "zero3_offload"),
    ],
)
def test_caps_limit_the_candidates(options: dict, budget: Budget, expected: str) -> None:
    choice = decide(WORKLOAD, budget, AutoOptions.from_options(activation_reserve=0, **options))
    assert choice.name == expected


@pytest.mark.parametrize(
    ("options", "budget"),
    [
        ({"offload": False}, cpu(7e6)),
        ({"offload": False}, gpu(7e6, 1e9)),  # zero2_offload would fit
        ({"offload": "cpu"}, gpu(5e6, 7e6)),
        ({"max_stage": 2}, cpu(9e6)),
        ({}, cpu(7e6, disk=7e6)),  # infinity's 8 MB of files do not fit on the disk either
    ],
)
def test_nothing_fits_names_the_need_and_the_options(options: dict, budget: Budget) -> None:
    with pytest.raises(AutoChoiceError, match=r"no candidate that fits.*needs .* HINT: .*`activation_reserve`"):
        decide(WORKLOAD, budget, AutoOptions.from_options(activation_reserve=0, **options))


def test_the_table_says_what_was_chosen_and_why() -> None:
    choice = decide(SGD, cpu(7e6), NO_RESERVE)
    table = choice.table()
    assert "| `zero3` | 5.7 MiB | 0 B | chosen |" in table
    assert "| `zero1` | 9.5 MiB | 0 B | too large for memory |" in table
    assert "in order of traffic, that fits" in choice.reason
    assert "before it: zero1 (too large for memory), zero2 (too large for memory)" in choice.reason
    adam = decide(WORKLOAD, cpu(9e6), NO_RESERVE)
    assert "| `zero3_offload` | 7.6 MiB | 0 B | chosen |" in adam.table()
    assert "those stepping on the host first" in adam.reason
    assert "before it: zero2_offload (too large for memory)" in adam.reason


def test_a_configured_optimizer_with_more_state_fails_naming_the_candidate_that_fits() -> None:
    sgd = Workload(MILLION, MILLION, "32-true", False, "sgd", num_ranks=2)  # zero1: 4 + 4 = 8 B per parameter
    choice = decide(sgd, cpu(9e6), NO_RESERVE)
    assert choice.name == "zero1"
    named = r"chose zero1 .* is adam, .* zero3_offload would. HINT: pass `optimizer='adam'`"
    with pytest.raises(AutoChoiceError, match=named):
        check_optimizer(choice, "adam", NO_RESERVE)
    check_optimizer(choice, "sgd", NO_RESERVE)  # the one assumed: nothing to say


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("max_stage", 4),
        ("max_stage", True),
        ("offload", "nvme"),
        ("activation_reserve", 1.0),
        ("activation_reserve", -1),
        ("optimizer", "lion"),
        ("memory_per_rank", 0),
    ],
)
def test_bad_options_are_named(option: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"`{option}={value!r}`.* HINT:"):
        lightning_zero.ZeroAutoStrategy(**{option: value})


@pytest.mark.parametrize("option", ["stage", "offload_optimizer", "offload_parameters", "page_cache"])
def test_options_the_choice_sets_are_refused(option: str) -> None:
    with pytest.raises(ValueError, match=rf"takes no `{option}`. HINT: cap the choice"):
        lightning_zero.ZeroAutoStrategy(**{option: 3 if option == "stage" else True})


def test_zero_auto_is_registered_in_both_front_ends() -> None:
    assert StrategyRegistry["zero_auto"]["strategy"] is lightning_zero.ZeroAutoStrategy
    assert FABRIC_STRATEGIES["zero_auto"]["strategy"] is lightning_zero.fabric.ZeroAutoStrategy


@pytest.mark.parametrize(
    "args",
    [
        ["--trainer.strategy=zero_auto"],
        ["--trainer.strategy=lightning_zero.ZeroAutoStrategy", "--trainer.strategy.max_stage=2"],
    ],
)
def test_the_cli_resolves_zero_auto(args: list[str]) -> None:
    cli = LightningCLI(Classifier, run=False, args=["--trainer.accelerator=cpu", *args])
    strategy = cli.trainer.strategy
    assert isinstance(strategy, lightning_zero.ZeroAutoStrategy)
    assert strategy.auto_options.max_stage == (2 if len(args) == 2 else 3)


class BuiltLater(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.head = torch.nn.Linear(10, 2)
        self.body: torch.nn.Module | None = None

    def configure_model(self) -> None:
        if self.body is None:
            self.body = torch.nn.Linear(1000, 1000)


def test_a_configure_model_module_is_counted_on_meta() -> None:
    module = BuiltLater()
    counted, held = _counted(module, builds_later=True)
    assert _parameters(counted) == (1_001_000 + 22, 1_001_000 + 22)
    assert held == {"cpu": 22 * 4}  # only the head exists on this rank
    assert module.body is None  # the module itself was not built


class Blocks(torch.nn.Module):
    """A root of 1,000 + 10 parameters and three repeated blocks (stage 3's units) of 10,100 each."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(10, 100, bias=False)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(100, 100) for _ in range(3))
        self.head = torch.nn.Linear(100, 10, bias=False)
        self.scale = torch.nn.Parameter(torch.ones(10))


def test_the_working_buffers_follow_the_units_and_buckets() -> None:
    """Beside the model state on a GPU: one fp32 temporary per element the device steps (none where the optimizer
    steps on the host), two buckets, and in stage 3 the gathered root and units (the running one and those kept,
    zero3_offload's prefetched one, ZeRO-Infinity's read ahead) with the gather ring on a host of several ranks."""
    config = ZeroConfig.from_options(stage=3, bucket_cap_mb=1 / 1024, keep_for_backward_mb=10 / 1024)
    working = _working(Blocks(), config)
    assert working == Working(
        largest_unit=10_100, root_params=2_010, bucket_bytes=1024, keep_bytes=10 * 1024, parameter_tensors=9
    )
    params = 3 * 10_100 + 2_010
    workload = Workload(params, params, "32-true", False, "adam", num_ranks=2, working=working)
    stepped, staging, unit, root = 4 * params // 2, 2 * 1024, 4 * 10_100, 4 * 2_010
    ring = 3 * unit
    by_name = {c.label: n.working for c, n in needs(workload).items()}
    assert by_name == {
        "zero1": stepped + staging,
        "zero2": stepped + staging,
        "zero2_offload": staging,
        "zero3": stepped + staging + root + unit + 10 * 1024 + ring,
        "zero3_offload": staging + root + 2 * unit + ring,
        "zero3_infinity": staging + root + 4 * unit + ring,
    }
    one_rank = replace(workload, num_ranks=1)
    assert needs(one_rank)[Candidate.ZERO3].working == 4 * params + staging + root + unit + 10 * 1024  # no ring
    keeps_all = replace(workload, working=replace(working, keep_bytes=2**30))  # no more than the units hold
    assert needs(keeps_all)[Candidate.ZERO3].working == stepped + staging + root + unit + 4 * 3 * 10_100 + ring
    # the working buffers count where the computation runs: they can make a candidate too large
    state_only = replace(workload, working=None)
    zero1 = needs(state_only)[Candidate.ZERO1].memory(on_cpu=False)
    budget = gpu(zero1 + staging, 1e9)
    assert decide(state_only, budget, NO_RESERVE).name == "zero1"
    assert decide(workload, budget, NO_RESERVE).name != "zero1"


@pytest.mark.parametrize(("optimizer", "on_host"), [("adamw", 0), ("sgd-momentum", 4)])
def test_on_cpu_ranks_only_a_fused_host_step_needs_no_temporaries(optimizer: str, on_host: int) -> None:
    """On CPU ranks the in-memory stages step with the multi-tensor kernels (one fp32 temporary per element stepped),
    which match ``ddp``'s numbers bit for bit; a step on the host runs torch's fused kernel in place for Adam and AdamW
    (no temporaries), the multi-tensor kernels for other optimizers."""
    config = ZeroConfig.from_options(stage=3, bucket_cap_mb=1 / 1024, keep_for_backward_mb=0)
    params = 3 * 10_100 + 2_010
    workload = Workload(params, params, "32-true", False, optimizer, num_ranks=2, working=_working(Blocks(), config))
    staging, unit, root, ring = 2 * 1024, 4 * 10_100, 4 * 2_010, 3 * 4 * 10_100
    stepped, host_stepped = 4 * params // 2, on_host * params // 2
    objects = 9 * TENSOR_OBJECTS  # stage 3's, beside each of Blocks' parameter tensors
    by_name = {c.label: n.working for c, n in needs(workload, on_cpu=True).items()}
    assert by_name == {
        "zero1": stepped + staging,
        "zero2": stepped + staging,
        "zero2_offload": host_stepped + staging,
        "zero3": stepped + staging + root + unit + ring + objects,
        "zero3_offload": host_stepped + staging + root + 2 * unit + ring + objects,
        "zero3_infinity": on_host * 10_100 // 2 + staging + root + 4 * unit + ring + objects,
    }


def test_stage_3_counts_its_objects_beside_each_parameter_tensor_on_cpu_ranks() -> None:
    """A model of many small parameter tensors (5,000 of 200 elements): on CPU ranks stage 3's objects beside each
    (``TENSOR_OBJECTS``, 312 MiB here) are what its ZeRO-Infinity needs in memory, far beyond its state, and the choice
    refuses a budget its state alone fits; beside a GPU they are host memory, not the device's."""
    params = 5_000 * 200
    working = Working(largest_unit=200, root_params=0, bucket_bytes=1024, keep_bytes=0, parameter_tensors=5_000)
    workload = Workload(params, params, "32-true", False, "adam", num_ranks=2, working=working)
    infinity = needs(workload, on_cpu=True)[Candidate.ZERO3_INFINITY]
    assert infinity.memory(on_cpu=True) > 5_000 * TENSOR_OBJECTS > 300 * 2**20
    state_only = replace(workload, working=replace(working, parameter_tensors=0))
    budget = cpu(needs(state_only, on_cpu=True)[Candidate.ZERO3_INFINITY].memory(on_cpu=True))
    assert decide(state_only, budget, NO_RESERVE).name == "zero3_infinity"
    with pytest.raises(AutoChoiceError, match="no candidate that fits"):
        decide(workload, budget, NO_RESERVE)
    on_gpu = needs(workload)[Candidate.ZERO3_INFINITY]
    assert on_gpu.memory(on_cpu=False) == needs(state_only)[Candidate.ZERO3_INFINITY].memory(on_cpu=False)

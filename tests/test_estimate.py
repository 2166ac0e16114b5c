"""The memory estimator against the ZeRO paper's numbers and against bytes measured in a real 2-process run, its
command line, and the model-state report that puts the two side by side."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from torch import nn

from lightning_zero.__main__ import main
from lightning_zero._core.report import format_report, memory_report, optimizer_kind
from lightning_zero.estimate import count_parameters, estimate, format_bytes, format_table
from lightning_zero.memory import ModelStateBytes
from tests.scenarios import Scenario, StrategySpec, run_scenarios

GB = 1e9  # the paper's unit
STRATEGIES = ["ddp", "zero1", "zero2", "zero3"]


def totals(estimates: dict[str, Any]) -> dict[str, int]:
    return {name: e.per_rank.total for name, e in estimates.items()}


def test_the_papers_example() -> None:
    """Figure 1 of the ZeRO paper: Psi = 7.5 B, N = 64, 16-bit parameters and gradients with fp32 master weights and
    Adam state (K = 12): 120 GB, 31.4 GB, 16.6 GB and 1.9 GB per device. Stage 3 keeps its fp32 shards as the masters
    and 16-bit gradient shards: 14 Psi / N, 1.6 GB; offloaded (``fully_shard``, fp32 gradient shards) the paper's 16."""
    got = estimate(7_500_000_000, num_ranks=64, precision="bf16-true", master_weights=True)
    assert totals(got) == {"ddp": 120 * GB, "zero1": 31.40625 * GB, "zero2": 16.640625 * GB, "zero3": 1.640625 * GB}
    assert [round(t / GB, 1) for t in totals(got).values()] == [120.0, 31.4, 16.6, 1.6]
    stage1 = got["zero1"].per_rank
    assert (stage1.parameters, stage1.gradients) == (2 * 7.5 * GB, 2 * 7.5 * GB)
    assert (stage1.master_weights, stage1.optimizer_state) == (4 * 7.5 * GB / 64, 8 * 7.5 * GB / 64)
    stage3 = got["zero3"].per_rank  # the fp32 shards are the masters: 4 + 2 + 8, not 2 + 2 + 4 + 8
    assert (stage3.parameters, stage3.gradients, stage3.master_weights) == (4 * 7.5 * GB / 64, 2 * 7.5 * GB / 64, 0)
    offloaded = estimate(7_500_000_000, num_ranks=64, precision="bf16-true", master_weights=True, offload=True)
    assert offloaded["zero3"].per_rank.total == 1.875 * GB


def test_fp32_adam() -> None:
    """Params 4 + grads 4 + two fp32 moments 8 bytes per parameter: 16 Psi, 8 Psi + 8 Psi/N, 4 Psi + 12 Psi/N, 16 Psi/N;
    the '*-mixed' flags autocast the compute but keep fp32 state, so they cost the same."""
    psi, n = 1_000_000_000, 8
    expected = {"ddp": 16 * psi, "zero1": 8 * psi + 8 * psi // n, "zero2": 4 * psi + 12 * psi // n, "zero3": 2 * psi}
    for precision in ("32-true", "bf16-mixed", "16-mixed"):
        assert totals(estimate(psi, num_ranks=n, precision=precision)) == expected


def test_pure_16_bit() -> None:
    """bf16-true without master weights: params 2, grads 2 and Adam's two moments in bf16, 4 bytes per parameter."""
    psi, n = 1_000_000_000, 4
    got = estimate(psi, num_ranks=n, precision="bf16-true")
    assert totals(got) == {"ddp": 8 * psi, "zero1": 4 * psi + psi, "zero2": 2 * psi + 6 * psi // n, "zero3": 2 * psi}
    assert all(e.per_rank.master_weights == 0 for e in got.values())


def test_other_optimizers_and_frozen_parameters() -> None:
    psi = 1_000_000
    assert estimate(psi, num_ranks=1, optimizer="sgd")["ddp"].per_rank.optimizer_state == 0
    assert estimate(psi, num_ranks=1, optimizer="sgd-momentum")["ddp"].per_rank.optimizer_state == 4 * psi
    frozen = estimate(psi, num_ranks=2, trainable_params=psi // 4)["zero1"].per_rank
    assert frozen == ModelStateBytes(parameters=4 * psi, gradients=psi, master_weights=0, optimizer_state=psi)


def test_nodes_and_offload() -> None:
    """Per node: per rank times ranks per node. Offload moves master weights and optimizer state to host memory."""
    psi = 1_000_000_000
    got = estimate(psi, num_ranks=16, num_nodes=2, precision="bf16-true", master_weights=True, offload=True)["zero2"]
    assert got.ranks_per_node == 8
    assert got.device_per_rank == 2 * psi + 2 * psi // 16
    assert got.host_per_rank == 12 * psi // 16
    assert (got.device_per_node, got.host_per_node) == (8 * got.device_per_rank, 8 * got.host_per_rank)
    kept = estimate(psi, num_ranks=16, num_nodes=2)["zero2"]
    assert (kept.host_per_rank, kept.device_per_node) == (0, 8 * kept.per_rank.total)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"precision": "bf16-mixed", "master_weights": True}, "HINT: use precision 'bf16-true'"),
        ({"precision": "transformer-engine"}, "HINT: use one of '32-true'"),
        ({"num_nodes": 3}, "HINT: `num_ranks` counts the ranks of all nodes"),
        ({"optimizer": "lamb"}, "HINT: use one of ['adam', 'adamw', 'sgd-momentum', 'sgd']"),
        ({"trainable_params": 2_000}, "must be an integer from 0 to `num_params=1000`"),
        ({"num_ranks": 0}, "`num_ranks=0` must be a positive integer"),
    ],
)
def test_refuses_what_it_cannot_estimate(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(")):
        estimate(1_000, **{"num_ranks": 8, **kwargs})


def test_format_bytes() -> None:
    assert [format_bytes(n) for n in (0, 1023, 1536, 120 * GB, 3 * 2**40)] == [
        "0 B", "1023 B", "1.5 KiB", "111.8 GiB", "3.0 TiB",
    ]  # fmt: skip


def test_table() -> None:
    table = format_table(estimate(7_500_000_000, num_ranks=64, precision="bf16-true", master_weights=True))
    assert table.splitlines() == [
        "| strategy | params | grads | optimizer+master | total per rank | total per node |",
        "|---|---|---|---|---|---|",
        "| `ddp` | 14.0 GiB | 14.0 GiB | 83.8 GiB | 111.8 GiB | 7.0 TiB |",
        "| `zero1` | 14.0 GiB | 14.0 GiB | 1.3 GiB | 29.2 GiB | 1.8 TiB |",
        "| `zero2` | 14.0 GiB | 223.5 MiB | 1.3 GiB | 15.5 GiB | 991.9 GiB |",
        "| `zero3` | 447.0 MiB | 223.5 MiB | 894.1 MiB | 1.5 GiB | 97.8 GiB |",
    ]
    offloaded = format_table(estimate(2**30, num_ranks=8, num_nodes=2, offload=True)).splitlines()
    assert offloaded[0] == (
        "| strategy | params | grads | optimizer+master (host) | device per rank | host per rank | device per node"
        " | host per node |"
    )
    assert offloaded[4] == "| `zero2` | 4.0 GiB | 512.0 MiB | 1.0 GiB | 4.5 GiB | 1.0 GiB | 18.0 GiB | 4.0 GiB |"


def test_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "--params", "7.5e9", "--ranks", "64", "--precision", "bf16-true", "--master-weights"]) == 0
    out = capsys.readouterr().out
    assert "Model state of 7,500,000,000 parameters on 64 ranks (1 node), precision bf16-true" in out
    assert "| `zero3` | 447.0 MiB | 223.5 MiB | 894.1 MiB | 1.5 GiB | 97.8 GiB |" in out
    assert main(["estimate", "--params", "1e6", "--ranks", "6", "--nodes", "4"]) == 2
    assert "does not spread evenly over `num_nodes=4`" in capsys.readouterr().err


def gpt_parameters(n_layer: int, d_model: int, vocab_size: int, seq_len: int) -> int:
    """Token and position embeddings (the head is tied to the first), per block two LayerNorms (2d each), qkv
    (3d^2 + 3d), the projection (d^2 + d) and the 4x MLP (4d^2 + 4d, 4d^2 + d), then the final LayerNorm."""
    d = d_model
    return vocab_size * d + seq_len * d + n_layer * (12 * d * d + 13 * d) + 2 * d


def test_module_counted_on_the_meta_device(capsys: pytest.CaptureFixture[str]) -> None:
    """The 1b GPT (4.3 GB of fp32 parameters) is counted without allocating it."""
    expected = gpt_parameters(n_layer=20, d_model=2048, vocab_size=32000, seq_len=1024)
    assert count_parameters("example_modules.gpt.GPTLanguageModel", {"size": "1b"}) == (expected, expected)
    argv = ["estimate", "--module", "example_modules.gpt.GPTLanguageModel", "--size", "1b", "--ranks", "8"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"Model state of {expected:,} parameters of example_modules.gpt.GPTLanguageModel(size='1b')" in out
    per_rank = format_bytes(16 * expected / 8)
    assert f"| `zero3` | {format_bytes(4 * expected / 8)} |" in out and f"| {per_rank} |" in out
    with pytest.raises(SystemExit):
        main(["estimate", "--params", "1e9", "--ranks", "8", "--size", "1b"])  # init arguments need --module
    assert main(["estimate", "--module", "example_modules.gpt.GPTLanguageModel", "--sise", "1b", "--ranks", "8"]) == 2
    assert "unexpected keyword argument 'sise'" in capsys.readouterr().err


# Measured: the parity tests' classifier (10 parameters of odd shapes, a 0-dim one among them) widened to 136 k
# parameters, trained with Adam for two steps on 2 processes under each strategy: in fp32, and as bf16 with fp32
# master weights (in stage 3 the fp32 shards are the masters, so parameters and gradients are fp32 there). Every
# ZeRO run logs its memory report too, but the one with `memory_report=false`.
MODULE_KWARGS = {"hidden": 256}
SILENT = StrategySpec("zero2", {"memory_report": False})
MEASURED = [
    Scenario("fp32", module_kwargs=MODULE_KWARGS, max_steps=2, strategies=[*STRATEGIES, SILENT]),
    Scenario("master", module_kwargs=MODULE_KWARGS, max_steps=2, trainer_kwargs={"precision": "bf16-true"},
             strategies=[StrategySpec(s, {"master_weights": True}) for s in STRATEGIES[1:]]),
]  # fmt: skip
CATEGORIES = ("parameters", "gradients", "master_weights", "optimizer_state")


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> list[dict[Any, Any]]:
    return run_scenarios(MEASURED, 2, tmp_path_factory.mktemp("estimate"))


def expected_bytes(scenario: str, strategy: StrategySpec, num_ranks: int) -> tuple[ModelStateBytes, int]:
    """The estimate for a measured run, and by how much each category may differ from it: shards are split by rows,
    so a rank holds at most one row of each parameter more or less than 1/N (per tensor kept: up to two Adam moments
    of 4 bytes), plus one 4-byte step counter and one 4-byte gradient-presence flag per parameter."""
    from tests.workers.modules import Classifier

    params = list(Classifier(**MODULE_KWARGS).parameters())
    num_params, count = sum(p.numel() for p in params), len(params)
    rows = sum(p[0].numel() if p.ndim else 1 for p in params)
    master = scenario == "master"
    precision = "bf16-true" if master else "32-true"
    estimates = estimate(num_params, num_ranks=num_ranks, precision=precision, master_weights=master)
    expected = estimates[strategy.name].per_rank
    return expected, 8 * rows + 4 * count


RUNS = [(s.name, strategy) for s in MEASURED for strategy in s.strategies]


@pytest.mark.parametrize(("scenario", "strategy"), RUNS, ids=[f"{n}-{s}" for n, s in RUNS])
@pytest.mark.slow
def test_estimate_matches_measured_bytes(
    measured: list[dict[Any, Any]], scenario: str, strategy: StrategySpec
) -> None:
    """Every category on every rank within padding of the estimate."""
    expected, slack = expected_bytes(scenario, strategy, len(measured))
    for rank, per_rank in enumerate(measured):
        got: ModelStateBytes = per_rank[(scenario, strategy.label)]["model_state"]
        for category in CATEGORIES:
            diff = getattr(got, category) - getattr(expected, category)
            assert abs(diff) <= slack, f"rank {rank} {strategy} {category}: {got} vs {expected}"
        assert abs(got.total - expected.total) <= 4 * slack


_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


def report_rows(report: str, names: tuple[str, ...] = CATEGORIES) -> dict[str, tuple[float, float, str]]:
    """``| optimizer state | 533.1 KiB | 532.0 KiB |`` -> ``{"optimizer_state": (545894.4, 51.2, "532.0 KiB")}``: the
    measured bytes as printed, how far printing to one decimal may have moved them, and the estimate as printed, for
    the rows of ``names``."""
    rows = {}
    for line in report.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 3 and cells[0].replace(" ", "_") in names:
            value, unit = cells[1].split()
            rounding = 0 if unit == "B" else 0.05 * _UNITS[unit]
            rows[cells[0].replace(" ", "_")] = (float(value) * _UNITS[unit], rounding, cells[2])
    return rows


REPORTED = [(name, strategy) for name, strategy in RUNS if strategy.name.startswith("zero") and strategy != SILENT]


@pytest.mark.parametrize(("scenario", "strategy"), REPORTED, ids=[f"{n}-{s}" for n, s in REPORTED])
@pytest.mark.slow
def test_memory_report_logged_after_the_first_step(
    measured: list[dict[Any, Any]], scenario: str, strategy: StrategySpec
) -> None:
    """Rank 0 logs one report per `fit`, after the first optimizer step: every category exists by then, its measured
    column is within padding of the estimator's bytes and its estimate column prints them. Other ranks log none."""
    expected, slack = expected_bytes(scenario, strategy, len(measured))
    (report,) = measured[0][(scenario, strategy.label)]["memory_reports"]
    assert report.startswith(f"Model state per rank of 136,197 parameters under `{strategy.name}` on 2 ranks:")
    assert "created" not in report, report
    rows = report_rows(report)
    assert set(rows) == set(CATEGORIES), report
    for category, (got, rounding, printed_estimate) in rows.items():
        want = getattr(expected, category)
        assert printed_estimate == format_bytes(want), report
        assert abs(got - want) <= slack + rounding, f"{strategy} {category}: {got} vs {want}\n{report}"
    assert [per_rank[(scenario, strategy.label)]["memory_reports"] for per_rank in measured[1:]] == [[]]
    # what the process holds for communication (shared-memory segments of 2 CPU ranks, the engine's buffers) is a
    # row of its own, not model state, and the last row adds it to the model state
    held_rows = report_rows(report, ("total", "communication_buffers", "held_in_all"))
    assert held_rows.keys() == {"total", "communication_buffers", "held_in_all"}, report
    (total, total_rounding, _), (communication, communication_rounding, _), (held, held_rounding, _) = (
        held_rows[row] for row in ("total", "communication_buffers", "held_in_all")
    )
    assert communication > 0, report
    assert abs(held - total - communication) <= held_rounding + total_rounding + communication_rounding, report


@pytest.mark.slow
def test_memory_report_false_logs_nothing(measured: list[dict[Any, Any]]) -> None:
    """Silent on every rank, and the training is the one the report does not disturb: the weights are zero2's."""
    assert [per_rank[("fp32", SILENT.label)]["memory_reports"] for per_rank in measured] == [[], []]
    silent, reported = measured[0][("fp32", SILENT.label)]["state_dict"], measured[0][("fp32", "zero2")]["state_dict"]
    for key, value in reported.items():
        torch.testing.assert_close(silent[key], value, rtol=0, atol=0)


@pytest.mark.slow
def test_report_of_a_measured_run(measured: list[dict[Any, Any]]) -> None:
    got = measured[0][("fp32", "zero2")]["model_state"]
    report = format_report(got, estimate(136_197, num_ranks=2)["zero2"], title="zero2, rank 0:")
    assert report.splitlines() == [
        "zero2, rank 0:",
        "",
        "| model state per rank | measured | estimate |",
        "|---|---|---|",
        "| parameters | 532.0 KiB | 532.0 KiB |",
        "| gradients | 266.6 KiB | 266.0 KiB |",
        "| master weights | 0 B | 0 B |",
        "| optimizer state | 533.1 KiB | 532.0 KiB |",
        "| total | 1.3 MiB | 1.3 MiB |",
    ]


def test_report_before_and_after_the_first_step() -> None:
    """One process (every strategy trains plainly there): before the first step only the parameters exist, and the
    report says why the rest is empty; after it, Adam's state is the estimate plus one step counter per tensor."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 4))  # 66,820 parameters in 4 tensors
    optimizer = torch.optim.Adam(module.parameters())
    before = memory_report(module, [optimizer], strategy="zero2", num_ranks=1)
    assert before.splitlines() == [
        "Model state per rank of 66,820 parameters under `zero2` on 1 rank:",
        "",
        "| model state per rank | measured | estimate |",
        "|---|---|---|",
        "| parameters | 261.0 KiB | 261.0 KiB |",
        "| gradients | 0 B | 261.0 KiB |",
        "| master weights | 0 B | 0 B |",
        "| optimizer state | 0 B | 522.0 KiB |",
        "| total | 261.0 KiB | 1.0 MiB |",
        "",
        "Gradients are created in the first backward.",
        "Optimizer state is created at the first step.",
    ]
    module(torch.randn(2, 256)).sum().backward()
    optimizer.step()
    after = memory_report(module, [optimizer], strategy="zero2", num_ranks=1)
    assert "| optimizer state | 522.0 KiB | 522.0 KiB |" in after  # + 16 bytes of step counters
    assert "created" not in after


def test_optimizer_kind() -> None:
    params = [nn.Parameter(torch.zeros(2))]
    assert optimizer_kind([torch.optim.AdamW(params)]) == "adam"
    assert optimizer_kind([torch.optim.SGD(params, lr=0.1, momentum=0.9)]) == "sgd-momentum"
    assert optimizer_kind([torch.optim.SGD(params, lr=0.1)]) == "sgd"
    assert optimizer_kind([torch.optim.Adam(params, amsgrad=True)]) is None  # a third state tensor
    assert optimizer_kind([torch.optim.Adam(params), torch.optim.SGD(params, lr=0.1)]) is None
    linear = nn.Linear(4, 4)
    rmsprop = memory_report(linear, [torch.optim.RMSprop(linear.parameters())], strategy="ddp", num_ranks=1)
    assert "optimizer state estimated as Adam's" in rmsprop.splitlines()[0]


def test_meta_count_of_every_gpt_size() -> None:
    from example_modules.gpt import SIZES

    for size, shape in SIZES.items():
        count, _ = count_parameters("example_modules.gpt.GPTLanguageModel", {"size": size})
        assert count == gpt_parameters(shape.n_layer, shape.d_model, shape.vocab_size, shape.seq_len), size


def test_memory_report_on_one_device() -> None:
    """One process, stage 3, with the progress bar drawn: the strategy trains plainly and logs the report once; Adam's
    state is the estimate plus one 4-byte step counter per parameter tensor, printed to one decimal."""
    import lightning.pytorch as pl

    from lightning_zero import Zero3Strategy
    from tests.workers.modules import Classifier
    from tests.workers.parity import LogRecorder

    recorder, lightning_logger = LogRecorder(), logging.getLogger("lightning.pytorch")
    lightning_logger.addHandler(recorder)
    try:
        trainer = pl.Trainer(
            strategy=Zero3Strategy(), accelerator="cpu", devices=1, max_steps=3, logger=False,
            enable_checkpointing=False, enable_model_summary=False, limit_val_batches=0,
        )  # fmt: skip
        trainer.fit(Classifier(**MODULE_KWARGS))
    finally:
        lightning_logger.removeHandler(recorder)
    reports = [m for m in recorder.messages if m.startswith("Model state per rank")]
    assert len(reports) == 1, reports
    expected = estimate(136_197, num_ranks=1)["zero3"].per_rank
    rows = report_rows(reports[0])
    assert reports[0].splitlines()[0] == "Model state per rank of 136,197 parameters under `zero3` on 1 rank:"
    for category, (got, rounding, printed_estimate) in rows.items():
        want = getattr(expected, category)
        assert printed_estimate == format_bytes(want)
        assert abs(got - want) <= 4 * 10 + rounding, f"{category}: {got} vs {want}\n{reports[0]}"


def test_zero_infinity_row_holds_stage_3_on_disk() -> None:
    """With ``disk``, ZeRO-Infinity's row holds stage 3's model state (16 Psi / N in fp32 Adam) on disk, none of it in
    device or host memory; the other rows hold nothing on disk; the table gains the disk columns."""
    psi, n = 1_700_000_000, 2
    got = estimate(psi, num_ranks=n, disk=True)
    infinity, zero3 = got["zero3_infinity"], got["zero3"]
    assert infinity.disk_per_rank == zero3.device_per_rank == 16 * psi // n
    assert infinity.device_per_rank == infinity.host_per_rank == 0 and infinity.disk_per_node == 16 * psi
    assert all(e.disk_per_rank == 0 for name, e in got.items() if name != "zero3_infinity")
    table = format_table(got)
    assert "| disk per rank | disk per node |" in table
    assert "| `zero3_infinity` | 3.2 GiB | 3.2 GiB | 6.3 GiB | 0 B | 0 B | 12.7 GiB | 25.3 GiB |" in table
    assert "disk per rank" not in format_table(estimate(psi, num_ranks=n))

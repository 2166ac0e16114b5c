"""Offload against the oracles: the same seeded module, written for DDP, trained on CPU processes with the optimizer
(and in stage 3 the parameter shards) in host memory or its state on disk, must end like ``"ddp"`` and like the same
stage without offload. On a CPU machine the offloaded path still runs its own code: separate host masters, the fused
host step, memory-mapped state files.

Tolerance: the offloaded step runs torch's fused CPU kernels where the in-memory one runs the multi-tensor kernels,
the same formulas evaluated in another order (about 1 ulp per step, 6e-8 seen), far inside the fp32 tolerance of
tests/oracle.py, which covers the gradient reductions' own ulps.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import textwrap
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric.strategies.registry import _StrategyRegistry

from lightning_zero import (
    OffloadError,
    Zero1Strategy,
    Zero2Strategy,
    Zero3Strategy,
    ZeroStrategy,
    consolidate_checkpoint,
)
from lightning_zero._core.front_end import register_names
from lightning_zero._offload.target import OffloadTarget, memory_filesystem
from tests.launch import REPO, launch
from tests.oracle import BY_PRECISION, FP32, close, compare_optimizer_states, compare_runs, full
from tests.scenarios import Scenario, StrategySpec, read_results, run_scenarios, write_payload

HOST1 = StrategySpec("zero1", {"offload_optimizer": True})
HOST3 = StrategySpec("zero3", {"offload_optimizer": True})
# the state files' directory is the test's own, given at run time (`on_disk`); the label stays
DISK2 = StrategySpec("zero2", {"offload_optimizer": "disk"}, label="zero2_disk")
DISK3 = StrategySpec("zero3", {"offload_optimizer": "disk"}, label="zero3_disk")
# ZeRO-Infinity: shards, gradients and optimizer state in files, every Linear a unit (several units read ahead,
# stepped one at a time); with the state in host memory; with `max_in_cpu` keeping the first units' shards (on each of
# 2 ranks: the root's gate, 37 elements, and `inp`, 19 x 12 + 19 padded, 284 in all; `mid` would pass 1000) in memory
UNITS = {"offload_parameters": "disk", "auto_wrap_policy": {"torch.nn.Linear"}}
INFINITY = StrategySpec("zero3", UNITS, label="zero3_infinity")
INFINITY_HOST = StrategySpec("zero3", {**UNITS, "offload_optimizer": True}, label="zero3_inf_host")
INFINITY_KEPT = StrategySpec("zero3", {**UNITS, "max_in_cpu": 1000}, label="zero3_inf_kept")
STAGES = ("zero3", "zero2", "zero1")
ZERO2 = StrategySpec("zero2")
MASTERS2, MASTERS3 = (StrategySpec(f"zero{s}", {"master_weights": True}) for s in (2, 3))
HOST_MASTERS2, HOST_MASTERS3 = (StrategySpec(f"zero{s}", {"master_weights": True, **HOST1.options}) for s in (2, 3))

SCENARIOS = [
    Scenario(
        "adam",
        strategies=[
            *("ddp", HOST1, "zero2_offload", DISK2, HOST3, "zero3_offload", DISK3),
            *(INFINITY, INFINITY_HOST, INFINITY_KEPT),
        ],
    ),
    Scenario(
        "clip_accumulate",
        trainer_kwargs={"gradient_clip_val": 0.05, "accumulate_grad_batches": 2},
        max_steps=4,
        strategies=["ddp", HOST1, "zero2_offload", "zero3_offload", INFINITY],
    ),
    Scenario(  # momentum state and the scheduler go through a checkpoint; resumed in a fresh Trainer and module
        "sgd_scheduler_resume",
        module_kwargs={"optimizer": "sgd", "scheduler": "step", "config_style": "dict"},
        resume_at=12,
        max_steps=14,
        strategies=["ddp", "zero2_offload", DISK2, "zero3_offload", INFINITY],
    ),
    Scenario("manual", module="manual", strategies=["ddp", "zero2_offload", "zero3_offload", INFINITY]),
    # ZeRO-Infinity's checkpoint directories are any stage 3 run's: saved at step 4 under it and resumed under other
    # stages (against the run resumed under it), and saved under stage 2 and resumed under it; `ckpt_ddp` also saves
    # under "ddp" at step 4, the file the consolidated directory is compared with
    Scenario("infinity_to_stages", resume_at=4, max_steps=6, save_with=INFINITY, strategies=[INFINITY, *STAGES]),
    Scenario("stage2_to_infinity", resume_at=4, max_steps=6, save_with=ZERO2, strategies=[ZERO2, INFINITY]),
    Scenario("ckpt_ddp", resume_at=4, max_steps=5, strategies=["ddp", INFINITY]),
    # two parameter groups of their own settings, each stepped one unit at a time
    Scenario("adamw_groups", module_kwargs={"optimizer": "adamw_groups"}, strategies=["ddp", INFINITY]),
    # ZeRO mixed precision: fp32 masters of a bf16 module on the host; the reference keeps them on the device
    Scenario("bf16_masters_zero2", trainer_kwargs={"precision": "bf16-true"}, strategies=[MASTERS2, HOST_MASTERS2]),
    Scenario("bf16_masters_zero3", trainer_kwargs={"precision": "bf16-true"}, strategies=[MASTERS3, HOST_MASTERS3]),
]
BY_NAME = {s.name: s for s in SCENARIOS}


def with_files(scenario: Scenario, state_dir: Path) -> Scenario:
    """``scenario`` with the files of its strategies (and of the one it saves with) in ``state_dir``."""
    saver = scenario.save_with and on_disk(scenario.save_with, state_dir)
    return replace(scenario, strategies=tuple(on_disk(x, state_dir) for x in scenario.strategies), save_with=saver)


def on_disk(spec: StrategySpec, state_dir: Path) -> StrategySpec:
    """``spec`` with its files in ``state_dir`` if it keeps anything on disk; its label unchanged."""
    if "disk" not in (spec.options.get("offload_optimizer"), spec.options.get("offload_parameters")):
        return spec
    return replace(spec, options={**spec.options, "offload_dir": state_dir})


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("offload")


@pytest.fixture(scope="module")
def offload_runs(runs_dir: Path) -> list[dict[Any, Any]]:
    """Each rank's results, keyed by scenario name and strategy label."""
    state_dir = runs_dir / "state"
    state_dir.mkdir()
    results = run_scenarios([with_files(s, state_dir) for s in SCENARIOS], 2, runs_dir)
    assert not any(state_dir.iterdir()), "state files outlived training"
    return results


PAIRS = [(s.name, strategy) for s in SCENARIOS for strategy in s.compared]


@pytest.mark.parametrize(("name", "strategy"), PAIRS, ids=[f"{n}-{s}" for n, s in PAIRS])
@pytest.mark.slow
def test_matches_reference(offload_runs: list[dict[Any, Any]], name: str, strategy: StrategySpec) -> None:
    results = offload_runs
    spec = BY_NAME[name]
    if "bf16" not in name:
        compare_runs(results, spec, strategy)
        return
    # Stages 1 and 2: the 16-bit module weights round the (equal within ulps) fp32 masters, kept apart, so they compare
    # at bf16's tolerance and the masters in fp32, and the optimizer state, of the masters, in fp32. Stage 3: the
    # module's parameters are the fp32 masters; its reference on the device runs on the package's engine and the
    # offloaded run on `fully_shard`, whose bf16 gradient reductions round in another order: one bf16 rounding step
    # per element and step, which Adam's normalised update carries into the masters, the moments and the losses, so
    # its run compares at the tolerance of bf16 reductions in another order (tests/oracle.py).
    apart = strategy.name != "zero3"
    other_order = BY_PRECISION["bf16-true"]  # stage 3's two runs: bf16 reductions in another order
    for rank, per_rank in enumerate(results):
        expected, actual = per_rank[(name, spec.reference.label)], per_rank[(name, strategy.label)]
        what = f"{name}/rank{rank}"
        losses = FP32 if apart else other_order
        close(torch.tensor(actual["losses"]), torch.tensor(expected["losses"]), f"{what} losses", losses)
        assert ("masters" in actual) == ("masters" in expected) == apart, what
        assert actual["state_dict"].keys() == expected["state_dict"].keys(), what
        for key, value in expected["state_dict"].items():
            weights = BY_PRECISION["bf16-true"] if apart else other_order
            close(actual["state_dict"][key], value, f"{what} {key}", weights)
        for got, want in zip(actual.get("masters", []), expected.get("masters", []), strict=True):
            close(got, want, f"{what} master")
        for i, (got, want) in enumerate(zip(actual["optimizers"], expected["optimizers"], strict=True)):
            compare_optimizer_states(got, want, f"{what} optimizer{i}", FP32 if apart else other_order)


@pytest.mark.slow
def test_infinity_checkpoint_consolidates_to_ddps(offload_runs: list[dict[Any, Any]], runs_dir: Path) -> None:
    """The checkpoint directory ZeRO-Infinity saved at step 4 consolidates into one file that holds what "ddp" saved at
    step 4 of the same run: the same keys, the weights and Adam's moments within the fp32 tolerance."""
    (directory,) = runs_dir.rglob(f"ckpt_ddp-{INFINITY.file_name}.ckpt")
    (ddp_file,) = runs_dir.rglob("ckpt_ddp-ddp.ckpt")
    consolidated = torch.load(consolidate_checkpoint(directory, runs_dir / "whole.ckpt", progress=False))
    expected = torch.load(ddp_file, weights_only=False)
    assert consolidated["global_step"] == expected["global_step"] == 4
    assert consolidated["state_dict"].keys() == expected["state_dict"].keys()
    for key, value in expected["state_dict"].items():
        close(consolidated["state_dict"][key], value, key)
    (got,), (want,) = consolidated["optimizer_states"], expected["optimizer_states"]
    for index, entries in want["state"].items():
        for key, value in entries.items():
            close(torch.as_tensor(got["state"][index][key]), torch.as_tensor(value), f"state {index} {key}")


@pytest.mark.slow
def test_stage_1_2_step_on_separate_host_masters(offload_runs: list[dict[Any, Any]]) -> None:
    """Guards the oracle on a CPU machine: the offloaded runs kept master copies apart from the module's weights
    (an fp32 module, so only offloading makes them), and the module's weights are those masters, gathered."""
    from tests.workers.modules import Classifier

    results = offload_runs
    names = [name for name, _ in Classifier().named_parameters()]
    for strategy in (HOST1.label, "zero2_offload"):
        run = results[0][("adam", strategy)]
        assert run["model_state"].master_weights > 0, strategy
        for name, master in zip(names, run["masters"], strict=True):
            assert torch.equal(master, run["state_dict"][name]), f"{strategy}: {name}"


@pytest.mark.slow
def test_one_device_offloads(tmp_path: Path) -> None:
    """On one device offload still runs (that is what it is for): same result as plain training, host masters."""
    spec = Scenario("adam", strategies=["ddp", HOST1, "zero2_offload", "zero3_offload"])
    results = run_scenarios([spec], 1, tmp_path)
    for strategy in spec.compared:
        compare_runs(results, spec, strategy)
    assert results[0][("adam", "zero2_offload")]["model_state"].master_weights > 0


def resident(strategy: StrategySpec, tmp_path: Path, offload_dir: Path, resume: bool = False) -> list[dict[str, Any]]:
    out = tmp_path / strategy.name / str(len(list(tmp_path.iterdir())))
    out.mkdir(parents=True)
    write_payload(out, strategy=strategy, world_size=2, hidden=2048, offload_dir=offload_dir, resume=resume)
    launch("tests.workers.offload_memory", [str(out)], 2)
    return read_results(out, 2)


@pytest.mark.slow
def test_disk_state_is_not_resident(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """After training, a rank that keeps its optimizer state on disk holds measurably less resident memory than the
    same run with the state in host memory: the state's pages are dropped after each step. (The first step creates
    the state in memory before it moves to its files; glibc is told to return such freed blocks to the system, as it
    does by itself for blocks above 32 MB, so that resident memory shows what is live.)"""
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(1 << 16))
    offload_dir = tmp_path / "state"
    offload_dir.mkdir()
    in_memory = resident(StrategySpec("zero2", {"offload_optimizer": True}), tmp_path, offload_dir)
    in_files = resident(on_disk(DISK2, offload_dir), tmp_path, offload_dir)
    for rank, (memory, disk) in enumerate(zip(in_memory, in_files, strict=True)):
        state = memory["state_bytes"]
        assert state == disk["state_bytes"] > 30 * 2**20  # Adam's moments of this rank's 4.2 M elements
        assert disk["file_rss"] == 0, f"rank {rank}: {disk['file_rss']} bytes of state files still resident"
        assert disk["rss"] < memory["rss"] - state // 2, (rank, disk["rss"], memory["rss"], state)
        torch.testing.assert_close(disk["weight"], memory["weight"], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_infinity_keeps_shards_and_gradients_in_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Once a step's gradients are all there, every parameter and gradient shard (not the replicated 0-dim one) under
    ``offload_parameters="disk"`` lies in a file under ``offload_dir``, none of their pages is resident, and the rank
    holds less memory than the same run with the shards in host memory, by at least half of those bytes (glibc
    returns freed blocks to the system, as in the test above); training ends with the same weights."""
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(1 << 16))
    offload_dir = tmp_path / "files"
    offload_dir.mkdir()
    in_memory = resident(on_disk(StrategySpec("zero3", {**UNITS, "offload_parameters": True, "offload_optimizer":
                                                        "disk"}), offload_dir), tmp_path, offload_dir)  # fmt: skip
    in_files = resident(on_disk(INFINITY, offload_dir), tmp_path, offload_dir)
    for rank, (memory, disk) in enumerate(zip(in_memory, in_files, strict=True)):
        shards = disk["param_bytes"] + disk["grad_bytes"]
        assert disk["param_bytes"] == memory["param_bytes"] > 15 * 2**20, rank  # 4.2 M of 8.4 M fp32 elements
        assert disk["grad_bytes"] == memory["grad_bytes"] == disk["param_bytes"], rank
        # all but the 0-dim temperature (4 bytes), which every rank keeps whole (replicated), as in every stage 3
        assert disk["param_file_bytes"] == disk["param_bytes"] - 4, rank
        assert disk["grad_file_bytes"] == disk["grad_bytes"] - 4, rank
        assert memory["param_file_bytes"] == memory["grad_file_bytes"] == 0, rank
        assert disk["step_file_rss"] == 0, f"rank {rank}: {disk['step_file_rss']} bytes of shard files resident"
        assert disk["step_rss"] < memory["step_rss"] - shards // 2, (rank, disk["step_rss"], memory["step_rss"])
        torch.testing.assert_close(disk["weight"], memory["weight"], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", [DISK2, INFINITY], ids=lambda spec: spec.label)
def test_resume_loads_state_straight_into_files(
    strategy: StrategySpec, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A resume from a checkpoint directory loads the optimizer state into its files, not into memory first: as the
    resumed run starts, every state tensor (not the step counters) lies in a file under ``offload_dir``, none of
    their pages is resident, and the rank holds less memory than the same resume with the state in host memory, by
    at least half of the state's bytes (glibc returns freed blocks to the system, as above)."""
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(1 << 16))
    offload_dir = tmp_path / "files"
    offload_dir.mkdir()
    host = StrategySpec(strategy.name, {**strategy.options, "offload_optimizer": True})
    in_memory = resident(on_disk(host, offload_dir), tmp_path, offload_dir, resume=True)
    in_files = resident(on_disk(strategy, offload_dir), tmp_path, offload_dir, resume=True)
    for rank, (memory, disk) in enumerate(zip(in_memory, in_files, strict=True)):
        state = disk["loaded_state_bytes"]
        assert state == memory["loaded_state_bytes"] > 30 * 2**20, rank  # Adam's moments of 4.2 M elements
        assert disk["loaded_state_file_bytes"] == state and memory["loaded_state_file_bytes"] == 0, rank
        assert disk["loaded_file_rss"] == 0, f"rank {rank}: {disk['loaded_file_rss']} bytes of state files resident"
        assert disk["loaded_rss"] < memory["loaded_rss"] - state // 2, (rank, disk["loaded_rss"], memory["loaded_rss"])
        torch.testing.assert_close(disk["weight"], memory["weight"], rtol=1e-5, atol=1e-6)


# --- options and bad input ------------------------------------------------------------------------------------------


def test_registered_names() -> None:
    zero2 = pl.Trainer(accelerator="cpu", devices=2, strategy="zero2_offload", logger=False).strategy
    zero3 = pl.Trainer(accelerator="cpu", devices=2, strategy="zero3_offload", logger=False).strategy
    assert isinstance(zero2, Zero2Strategy) and zero2.config.offload is OffloadTarget.CPU
    assert isinstance(zero3, Zero3Strategy) and zero3.config.offload_parameters is OffloadTarget.CPU
    assert zero3.config.offload is OffloadTarget.CPU


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"stage": 2, "offload_parameters": True}, "offload_parameters=True` moves the parameter shards of stage 3"),
        ({"stage": 2, "offload_optimizer": "gpu"}, "`offload_optimizer='gpu'` is not a place"),
        ({"stage": 2, "offload_optimizer": "disk"}, "`offload_dir=None`"),
        ({"stage": 2, "offload_dir": "/tmp"}, "is used only by `offload_optimizer='disk'`"),
        ({"stage": 3, "pin_memory": "yes"}, "`pin_memory='yes'` must be True or False"),
        ({"stage": 2, "offload_parameters": "disk"}, "`offload_parameters='disk'` moves the parameter shards of"),
        ({"stage": 3, "offload_parameters": "ssd"}, "`offload_parameters='ssd'` is not a place for the parameter"),
        ({"stage": 3, "offload_parameters": "disk"}, "`offload_parameters='disk'` keeps state in files, but `offload"),
        ({"stage": 3, "max_in_cpu": 10}, "`max_in_cpu=10` shapes how parameter shards on disk are read"),
        ({"stage": 3, "offload_parameters": True, "prefetch_units": 4}, "HINT: pass `offload_parameters='disk'`"),
        ({"stage": 3, "offload_parameters": "disk", "prefetch_units": -1}, "`prefetch_units=-1` must be a whole"),
        ({"stage": 3, "max_in_cpu": 1.5}, "`max_in_cpu=1.5` must be a whole number"),
    ],
)
def test_bad_options(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as error:
        ZeroStrategy(**options)
    assert message in str(error.value)


def test_unusable_directories(tmp_path: Path) -> None:
    missing = tmp_path / "missing"
    with pytest.raises(OffloadError, match=f"`offload_dir='{missing}'` is not an existing directory"):
        Zero2Strategy(offload_optimizer="disk", offload_dir=missing)
    a_file = tmp_path / "file"
    a_file.write_text("")
    with pytest.raises(OffloadError, match="is a file, not a directory"):
        Zero2Strategy(offload_optimizer="disk", offload_dir=a_file)
    read_only = tmp_path / "read-only"
    read_only.mkdir(mode=0o500)
    if os.geteuid() == 0:  # root writes through permission bits; sysfs takes no new files from anyone
        read_only = Path("/sys")
    with pytest.raises(OffloadError, match=f"`offload_dir='{read_only}'` is not writable"):
        Zero2Strategy(offload_optimizer="disk", offload_dir=read_only)


@pytest.mark.slow  # trains in this process on a small full filesystem
def test_full_disk_fails_at_the_write_and_keeps_the_state(tmp_path: Path) -> None:
    """A file-size limit stands in for a full disk: reserving the state's file fails, the error names the directory,
    and the optimizer keeps its state (the step's update) in memory."""
    script = textwrap.dedent(
        f"""
        import resource, signal
        from pathlib import Path
        import torch
        from lightning_zero._offload.disk import DiskState
        from lightning_zero._offload.writeback import Writeback
        from lightning_zero._offload.target import OffloadError

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        param = torch.nn.Parameter(torch.randn(1 << 19))
        param.grad = torch.randn(1 << 19)
        optimizer = torch.optim.Adam([param])
        optimizer.step()
        before = {{k: v.clone() for k, v in optimizer.state[param].items()}}
        try:
            DiskState(Path({str(tmp_path)!r}), Writeback(None)).adopt(optimizer)
        except OffloadError as error:
            print("ERROR:", error)
        kept = all(torch.equal(optimizer.state[param][k], v) for k, v in before.items())
        print("KEPT:", kept)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert done.returncode == 0, done.stderr
    assert f"ERROR: Could not reserve 2097152 bytes for optimizer state in `{tmp_path}`" in done.stdout
    assert "HINT: free space on that disk" in done.stdout
    assert "KEPT: True" in done.stdout


@pytest.mark.slow  # trains in this process
@pytest.mark.parametrize(
    ("optimizer", "message"),
    [
        ("lars", "`tests.workers.modules.Lars` is not known to. HINT: use a `torch.optim` optimizer"),
        ("hooked", "Adam has step hooks, and `offload_parameters='disk'` steps it once per unit"),
    ],
)
def test_infinity_refuses_what_stepping_by_unit_could_change(tmp_path: Path, optimizer: str, message: str) -> None:
    """An optimizer not known to update each parameter from its own gradient and state, or one with step hooks, is
    refused at its first step, before anything is updated."""
    from tests.workers.modules import Classifier

    class Hooked(Classifier):
        def configure_optimizers(self) -> Any:
            adam = torch.optim.Adam(self.parameters())
            adam.register_step_pre_hook(lambda *_: None)
            return adam

    module = Hooked() if optimizer == "hooked" else Classifier(optimizer=optimizer)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    strategy = Zero3Strategy(offload_parameters="disk", offload_dir=tmp_path)
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
        enable_model_summary=False, enable_progress_bar=False,
    )  # fmt: skip
    with pytest.raises(ValueError, match=re.escape(message)):
        trainer.fit(module)
    after = trainer.lightning_module.state_dict()
    for key, value in before.items():
        assert torch.equal(full(after[key]), value), key


def test_infinity_full_disk_is_reported(tmp_path: Path) -> None:
    """A file-size limit stands in for a full disk: reserving a unit's file fails with an error naming the directory
    and the bytes already there, as for optimizer state on disk."""
    script = textwrap.dedent(
        f"""
        import resource, signal
        from pathlib import Path
        from lightning_zero._offload.param_files import ParameterFiles
        from lightning_zero._offload.writeback import Writeback
        from lightning_zero._offload.target import OffloadError

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        files = ParameterFiles(Path({str(tmp_path)!r}), max_in_cpu=0, prefetch=2, writeback=Writeback(None))
        files._map(1 << 19, "parameter shards")
        try:
            files._map(2 << 20, "gradient shards")
        except OffloadError as error:
            print("ERROR:", error)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert f"ERROR: Could not reserve 2097152 bytes for gradient shards in `{tmp_path}`" in done.stdout
    assert "524288 bytes of parameter shards and gradients are already there. HINT: free space" in done.stdout


def test_memory_filesystem_is_named() -> None:
    """An offload directory on a filesystem that lives in memory works, with a warning that it saves no memory."""
    if memory_filesystem(Path("/dev/shm")) is None:
        pytest.skip("/dev/shm is not a memory filesystem on this machine")
    with pytest.warns(UserWarning, match="`offload_dir='/dev/shm'` is on a tmpfs filesystem, which lives in memory"):
        Zero3Strategy(offload_parameters="disk", offload_dir="/dev/shm")


@pytest.mark.parametrize("temporary", ["/dev/shm", "a directory on disk"])
def test_zero3_infinity_names_a_temporary_directory_in_memory(
    temporary: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`"zero3_infinity"` puts its files under the temporary directory (`tempfile.gettempdir()`, at registration): on a
    tmpfs it warns, naming the directory, the registered name and `offload_dir`; on disk it is silent."""
    directory = Path(temporary) if temporary.startswith("/") else tmp_path
    in_memory = memory_filesystem(directory) is not None
    if in_memory != (temporary == "/dev/shm"):
        pytest.skip(f"{directory} is {'' if in_memory else 'not '}a memory filesystem on this machine")
    monkeypatch.setattr(tempfile, "tempdir", str(directory))
    registry = _StrategyRegistry()
    register_names(registry, (Zero1Strategy, Zero2Strategy, Zero3Strategy))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        strategy = registry.get("zero3_infinity")
    assert strategy.config.offload_dir == directory
    messages = [str(w.message) for w in caught if "filesystem" in str(w.message)]
    if not in_memory:
        assert messages == []
        return
    assert messages == [
        f"`offload_dir='{directory}'`, the temporary directory where `\"zero3_infinity\"` puts its files unless told"
        " otherwise, is on a tmpfs filesystem, which lives in memory: what is offloaded there takes host memory as"
        " before. HINT: point `offload_dir` at a directory on a local disk, e.g. `Zero3Strategy(offload_parameters="
        "'disk', offload_dir='/path/on/disk')` in place of `\"zero3_infinity\"`, or start Python with `TMPDIR` set to"
        " a directory on a local disk."
    ]


def test_memory_report_says_what_is_offloaded() -> None:
    """One process under ``"zero2_offload"``: the report's masters are this rank's host copies of its shards (as many
    bytes as the fp32 parameters), and a note names what lives in host memory."""
    import logging

    from tests.workers.modules import Classifier
    from tests.workers.parity import LogRecorder

    recorder, lightning_logger = LogRecorder(), logging.getLogger("lightning.pytorch")
    lightning_logger.addHandler(recorder)
    try:
        trainer = pl.Trainer(
            strategy="zero2_offload", accelerator="cpu", devices=1, max_steps=2, logger=False,
            enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False,
        )  # fmt: skip
        trainer.fit(Classifier())
    finally:
        lightning_logger.removeHandler(recorder)
    (report,) = [m for m in recorder.messages if m.startswith("Model state per rank")]
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ")[1] for line in report.splitlines() if " | " in line}
    assert rows["master weights"] == rows["parameters"] != "0 B"
    assert "Offloaded to host memory: optimizer state and master weights" in report

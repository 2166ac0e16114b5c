"""What users of Lightning's ``FSDPStrategy``, ``ModelParallelStrategy`` and ``DeepSpeedStrategy`` rely on, on 2
processes against ``"ddp"``: full state dicts whole on rank 0 and empty elsewhere, ``trainer.test`` inside
``torch.inference_mode()``, Fabric's single file holding ``"ddp"``'s optimizer entries, ``local://`` paths, optimizers
on tensors outside the module, a model's own checkpoint wrappers, and a DeepSpeed config's optimizer and scheduler.

Parameters and optimizer states are compared with ``"ddp"``'s within the fp32 parity tolerance of tests/oracle.py.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from lightning_zero._checkpoint.keys import SHARDED_KEYS
from tests.launch import launch
from tests.oracle import FP32, close, compare_optimizer_states
from tests.scenarios import read_results, write_payload
from tests.workers.peer_habits import DS_CONFIG, STEPS, warmup_decay_lr

pytestmark = pytest.mark.slow  # every test here launches processes

WORLD_SIZE = 2
ZERO = ["zero1", "zero2", "zero3"]
RUNS = {
    "full_state_dicts": ["ddp", *ZERO],
    "sharded_state_dicts": ["zero1", "zero3"],
    "test_in_inference_mode": ["ddp", "zero2", "zero3"],
    "foreign_parameters": ["ddp", *ZERO],
    "own_checkpoint_wrappers": ["ddp", "zero2", "zero3"],
    "deepspeed_optimizer": ["ddp", "zero2"],
    "fabric_full_file": ["ddp", "zero2", "zero3"],
    "earlier_full_file": ["zero3"],
    "local_scheme": ["zero2"],
    "recurrent": ["ddp", *ZERO],
    "skipped_steps": ["ddp", *ZERO],
    "storage_options": ["zero3"],
    "save_filter": ["ddp", "zero3"],
    "configure_model_dtype": ["ddp", "zero2", "zero3"],
    "optimizer_count": ["zero2"],
    "compiled_fabric": ["ddp", "zero2", "zero3"],
}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("peer_habits")
    (out / "ds_config.json").write_text(json.dumps(DS_CONFIG))
    write_payload(out, runs=RUNS)
    launch("tests.workers.peer_habits", [str(out)], WORLD_SIZE)
    return read_results(out, WORLD_SIZE)


def close_states(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str) -> None:
    assert actual.keys() == expected.keys(), what
    for key, value in expected.items():
        close(actual[key], value, f"{what} {key}")


@pytest.mark.parametrize("strategy", ZERO)
def test_full_state_dicts_are_whole_on_rank_zero_and_empty_elsewhere(results: list[dict], strategy: str) -> None:
    """``state_dict_type="full"``: ``lightning_module_state_dict()`` and ``optimizer_state()`` give rank 0 what
    ``"ddp"`` gives it (host tensors, the optimizer state indexed by position with ``state`` and ``param_groups``
    alone), the other ranks ``{}``, as ``FSDPStrategy`` does; the file holds ``"ddp"``'s keys."""
    ddp, got = results[0]["full_state_dicts"]["ddp"], results[0]["full_state_dicts"][strategy]
    close_states(got["module"], ddp["module"], strategy)
    assert all(v.device.type == "cpu" for v in got["module"].values())
    assert sorted(got["optimizer"]) == ["param_groups", "state"]
    compare_optimizer_states(got["optimizer"], ddp["optimizer"], strategy)
    assert got["file_keys"] == ddp["file_keys"] and SHARDED_KEYS not in got["file_keys"]
    assert got["file_optimizer_keys"] == ddp["file_optimizer_keys"] == ["param_groups", "state"]
    assert results[1]["full_state_dicts"][strategy] == {"module": {}, "optimizer": {}}


def test_sharded_state_dicts_are_each_ranks_own(results: list[dict]) -> None:
    """``state_dict_type="sharded"`` (the default), as ``FSDPStrategy``'s: on every rank, each parameter is the
    DTensor of this rank's rows of what the optimizer updates (stages 1 and 2 too: their sharded masters), and the
    optimizer state is named by parameter, shards as DTensors."""
    for rank in range(WORLD_SIZE):
        for run in results[rank]["sharded_state_dicts"].values():
            assert run["module_types"]["mid.weight"] == "DTensor"
            assert run["optimizer_keys"] == ["param_groups", "state"]


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_trainer_test_inside_inference_mode(results: list[dict], strategy: str) -> None:
    """``with torch.inference_mode(): trainer.test(model)`` after ``fit`` ends as under ``"ddp"``: the same metrics,
    and the module whole and intact after Lightning's teardown moved it to the host."""
    for rank in range(WORLD_SIZE):
        ddp, got = results[rank]["test_in_inference_mode"]["ddp"], results[rank]["test_in_inference_mode"][strategy]
        assert got["metrics"][0].keys() == ddp["metrics"][0].keys()
        for key, value in ddp["metrics"][0].items():
            assert got["metrics"][0][key] == FP32.approx(value), key
        close_states(got["weights"], ddp["weights"], strategy)


@pytest.mark.parametrize("strategy", ZERO)
def test_an_optimizer_on_tensors_outside_the_module_is_refused(results: list[dict], strategy: str) -> None:
    """``"ddp"`` (and ``FSDPStrategy`` with ``use_orig_params=True``) step such tensors with each rank's own
    gradients, unsynchronised; ZeRO shards what it steps along the module's parameters, and refuses the rest,
    naming the tensor and the fix."""
    for rank in range(WORLD_SIZE):
        assert results[rank]["foreign_parameters"]["ddp"]["error"] is None
        error = results[rank]["foreign_parameters"][strategy]["error"]
        assert "holds a tensor of shape (5, 4) that is not a" in error and "HINT: build" in error


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_a_models_own_checkpoint_wrappers_are_kept_with_a_warning(results: list[dict], strategy: str) -> None:
    """``activation_checkpointing`` on a model that wraps layers in torch's ``CheckpointWrapper`` itself: a warning
    on rank 0, the model's wrapping alone (none added), and training as under ``"ddp"``."""
    for rank in range(WORLD_SIZE):
        ddp, got = results[rank]["own_checkpoint_wrappers"]["ddp"], results[rank]["own_checkpoint_wrappers"][strategy]
        assert got["checkpointed"] == []
        assert len(got["warnings"]) == (1 if rank == 0 else 0)
        if rank == 0:
            assert "`CheckpointWrapper` at `mid`" in got["warnings"][0] and "HINT" in got["warnings"][0]
        assert got["losses"] == FP32.approx(ddp["losses"])
        close_states(got["weights"], ddp["weights"], strategy)


def test_a_deepspeed_configs_optimizer_and_scheduler_train_as_deepspeed_would(results: list[dict]) -> None:
    """The config's ``Adam`` (DeepSpeed's AdamW) and ``WarmupDecayLR`` take the place of ``configure_optimizers``
    (with a warning, as ``DeepSpeedStrategy`` ignores it too): every step runs at DeepSpeed's learning rate, and the
    run ends as ``"ddp"`` with those objects written by hand."""
    expected_lrs = [warmup_decay_lr(step - 1) for step in range(STEPS + 2)]
    for rank in range(WORLD_SIZE):
        ddp, got = results[rank]["deepspeed_optimizer"]["ddp"], results[rank]["deepspeed_optimizer"]["zero2"]
        assert ddp["lrs"] == pytest.approx(expected_lrs, rel=1e-12)
        assert got["lrs"] == pytest.approx(expected_lrs, rel=1e-12)
        assert got["optimizer_class"] == "AdamW" and not ddp["warned"]
        assert got["warned"] == (rank == 0)  # Lightning warns on rank 0 alone
        assert got["losses"] == FP32.approx(ddp["losses"])
        close_states(got["weights"], ddp["weights"], "zero2")


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_fabrics_single_file_holds_ddps_optimizer_entries(results: list[dict], strategy: str) -> None:
    """Fabric's file (``state_dict_type="full"``) has ``"ddp"``'s keys, its optimizer entry ``state`` and
    ``param_groups`` alone; ``fabric.load`` returns the same remainder; torch's ``get_optimizer_state_dict`` works on
    Fabric's objects before the save and after the load, and gives ``"ddp"``'s state; ``optimizer.state_dict()`` loads
    back into the optimizer, indexed by position as torch's."""
    ddp0, got0 = results[0]["fabric_full_file"]["ddp"], results[0]["fabric_full_file"][strategy]
    assert got0["file_keys"] == ddp0["file_keys"] == ["model", "optimizer", "steps"]
    assert got0["file_optimizer_keys"] == ddp0["file_optimizer_keys"] == ["param_groups", "state"]
    for rank in range(WORLD_SIZE):
        ddp, got = results[rank]["fabric_full_file"]["ddp"], results[rank]["fabric_full_file"][strategy]
        assert got["remainder"] == ddp["remainder"] == {"steps": 1}
        assert got["round_trip"] and ddp["round_trip"]
    for moment in ("before", "after"):  # whole on rank 0 (`cpu_offload=True`), as under "ddp"
        compare_optimizer_states(got0[moment], ddp0[moment], f"{strategy} {moment}")
        assert results[1]["fabric_full_file"][strategy][moment] == {}


def test_a_full_file_of_an_earlier_release_still_loads(results: list[dict]) -> None:
    """Earlier releases kept the record of sharded entries inside the optimizer state: it loads as before."""
    for rank in range(WORLD_SIZE):
        loaded = results[rank]["earlier_full_file"]["zero3"]
        compare_optimizer_states(loaded["earlier"], loaded["new"], "earlier file", FP32)


def test_local_urls_are_local_paths_and_other_schemes_are_refused(results: list[dict]) -> None:
    """``fabric.save("local://<absolute path>")`` writes there (sharded and full) and ``fabric.load`` reads it back, as
    fsspec reads the URL; no ``local:`` directory appears in the working directory; ``s3://`` is refused by name."""
    for rank in range(WORLD_SIZE):
        got = results[rank]["local_scheme"]["zero2"]
        for kind in ("sharded", "full"):
            assert got[kind] == {"steps": 5, "exists": True}, kind
        assert got["stray"] == []
        assert "names the `s3://` filesystem" in got["remote"] and "HINT" in got["remote"]


@pytest.mark.parametrize("strategy", ZERO)
def test_an_lstm_trains_as_under_ddp(results: list[dict], strategy: str) -> None:
    """An LSTM reads its parameters through its own list of them: the weights of ``"ddp"``."""
    for rank in range(WORLD_SIZE):
        runs = results[rank]["recurrent"]
        assert runs[strategy]["losses"] == FP32.approx(runs["ddp"]["losses"])
        close_states(runs[strategy]["weights"], runs["ddp"]["weights"], strategy)


@pytest.mark.parametrize("strategy", ZERO)
def test_a_training_step_returning_none_is_refused_as_under_ddp(results: list[dict], strategy: str) -> None:
    """Lightning's own check, as ``DeepSpeedStrategy``'s users meet it: the error ``"ddp"`` raises."""
    for rank in range(WORLD_SIZE):
        ddp, got = results[rank]["skipped_steps"]["ddp"], results[rank]["skipped_steps"][strategy]
        assert ddp["error"] is not None and "returning None" in ddp["error"]
        assert got == ddp


def test_storage_options_are_refused_with_a_hint(results: list[dict]) -> None:
    for rank in range(WORLD_SIZE):
        error = results[rank]["storage_options"]["zero3"]["error"]
        assert "takes no `storage_options`" in error and "HINT" in error


def test_the_save_filter_keeps_what_ddp_keeps(results: list[dict]) -> None:
    """``fabric.save(..., filter={"model": ...})``: the file and the directory hold the entries ``"ddp"``'s holds."""
    for rank in range(WORLD_SIZE):
        ddp = results[rank]["save_filter"]["ddp"]["full"]
        assert ddp["model"] and all(k.endswith("weight") for k in ddp["model"])
        for kind, got in results[rank]["save_filter"]["zero3"].items():
            assert got == ddp, kind


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_configure_model_layers_take_the_precisions_dtype(results: list[dict], strategy: str) -> None:
    """``configure_model``'s layers have the precision flag's dtype and device, there and at ``on_fit_start``, as
    under ``"ddp"`` (stage 3's are lazy tensors there, which report the device eager construction would give)."""
    expected = {"bf16-true": torch.bfloat16, "32-true": torch.float32}
    for rank in range(WORLD_SIZE):
        ddp, got = results[rank]["configure_model_dtype"]["ddp"], results[rank]["configure_model_dtype"][strategy]
        for precision, dtype in expected.items():
            assert got[precision]["configure_model"][0] == ddp[precision]["configure_model"][0] == dtype
            assert got[precision]["on_fit_start"] == ddp[precision]["on_fit_start"] == (dtype, "cpu")
            assert got[precision]["configure_model"][1] == ddp[precision]["configure_model"][1] == "cpu"


def test_a_file_of_fewer_optimizers_is_refused_by_name(results: list[dict]) -> None:
    """A single-file checkpoint of one optimizer's state, resumed with two configured, as ``FSDPStrategy`` refuses
    it (``"ddp"`` would load the first and leave the second fresh)."""
    for rank in range(WORLD_SIZE):
        error = results[rank]["optimizer_count"]["zero2"]["error"]
        assert "holds the state of 1 optimizer(s), and `configure_optimizers` returned 2. HINT" in error


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_a_compiled_module_set_up_by_fabric_trains_as_under_ddp(results: list[dict], strategy: str) -> None:
    """Fabric compiles again over what the strategy set up, as it does over FSDP's wrapper; its single file names the
    parameters as ``"ddp"``'s does (no ``_orig_mod.``)."""
    assert results[0]["compiled_fabric"][strategy]["saved"] == results[0]["compiled_fabric"]["ddp"]["saved"]
    assert not any("_orig_mod" in key for key in results[0]["compiled_fabric"]["ddp"]["saved"])
    for rank in range(WORLD_SIZE):
        ddp, got = results[rank]["compiled_fabric"]["ddp"], results[rank]["compiled_fabric"][strategy]
        assert got["compiled"] == ddp["compiled"] == "OptimizedModule"
        assert got["losses"] == FP32.approx(ddp["losses"])
        close_states(got["weights"], ddp["weights"], strategy)

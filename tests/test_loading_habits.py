"""How users load and hand weights around in a Fabric loop, against Fabric's ``"ddp"`` on 2 and 3 processes: whole
state dicts into ``model.load_state_dict`` (after an evaluation's forward, which leaves stage 3's root gathered),
``fabric.load_raw`` of a module's file (raw or a Lightning checkpoint) and of an optimizer's, ``fabric.load`` of a
file after an evaluation, and ``fabric.load`` of a checkpoint with and without a ``state``.

Loading is exact: what a load leaves in the module is the file's tensors bit for bit, under every strategy. The step
after each load is compared with ``"ddp"``'s within the fp32 parity tolerance of tests/oracle.py.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.distributed.fsdp._fully_shard import _fsdp_state

from lightning_zero import consolidate_checkpoint
from tests.launch import launch
from tests.oracle import FP32, close
from tests.scenarios import read_results, write_payload
from tests.workers.loading_habits import other_weights
from tests.workers.modules import Classifier

pytestmark = pytest.mark.slow  # every test here launches processes

STRATEGIES = ["ddp", "zero1", "zero2", "zero3", "zero2_full", "zero3_full"]
SHARDED = ["zero1", "zero2", "zero3"]
LOADED = {"load_state_dict": 1, "load_raw": 2, "load_raw_lightning_file": 3, "load_after_evaluation": 4}
# whether the installed torch's `fully_shard` warns of a unit that returns a view (on every rank): torch 2.8's does not
TORCH_WARNS_OF_VIEWS = "returned a view tensor" in inspect.getsource(_fsdp_state)


@pytest.fixture(scope="module")
def run_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """One launch per world size; the 2-rank one also runs the Trainer."""
    dirs = {}
    for world_size in (2, 3):
        dirs[world_size] = out = tmp_path_factory.mktemp(f"loading{world_size}")
        write_payload(out, strategies=STRATEGIES, trainer=world_size == 2)
        launch("tests.workers.loading_habits", [str(out)], world_size)
    return dirs


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"{n}ranks")
def run_dir(request: pytest.FixtureRequest, run_dirs: dict[int, Path]) -> tuple[Path, int]:
    return run_dirs[request.param], request.param


@pytest.fixture(scope="module")
def results(run_dir: tuple[Path, int]) -> list[dict[str, Any]]:
    return read_results(*run_dir)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_loads_leave_the_files_weights_exactly(results: list[dict[str, Any]], strategy: str) -> None:
    torch.manual_seed(0)
    shapes = Classifier()
    for rank, per_rank in enumerate(results):
        for moment, seed in LOADED.items():
            expected = other_weights(shapes, seed)
            loaded = per_rank[strategy][moment]
            assert loaded.keys() == expected.keys()
            for key, value in expected.items():
                assert torch.equal(loaded[key], value), f"rank {rank} {strategy} {moment} {key}"


@pytest.mark.parametrize("strategy", STRATEGIES[1:])
def test_loading_continues_as_ddp(results: list[dict[str, Any]], strategy: str) -> None:
    for rank, per_rank in enumerate(results):
        ours, ddp = per_rank[strategy], per_rank["ddp"]
        what = f"rank {rank} {strategy}"
        assert len(ours["losses"]) == len(ddp["losses"]) == 1 + len(LOADED)
        close(torch.tensor(ours["losses"]), torch.tensor(ddp["losses"]), f"{what} losses", FP32)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_load_raw_leaves_the_optimizer_files_state_exactly(
    run_dir: tuple[Path, int], results: list[dict[str, Any]], strategy: str
) -> None:
    """Each rank keeps its shard of every whole tensor; gathered, they are the file's, bit for bit."""
    saved = torch.load(run_dir[0] / "files" / "optimizer.pt")["state"]
    for rank, per_rank in enumerate(results):
        loaded = per_rank[strategy]["load_raw_optimizer"]
        assert loaded.keys() == saved.keys()
        for index, entries in saved.items():
            assert loaded[index].keys() == entries.keys()
            for key, value in entries.items():
                assert torch.equal(loaded[index][key], value), f"rank {rank} {strategy} state[{index}][{key}]"


@pytest.mark.parametrize("strategy", STRATEGIES[1:])
def test_load_returns_what_ddp_returns(results: list[dict[str, Any]], strategy: str) -> None:
    """``fabric.load(path)`` returns the checkpoint under the names it was saved with; with a ``state``, only the
    user's entries beyond it (none the checkpoint format added)."""
    for rank, per_rank in enumerate(results):
        ours, ddp = per_rank[strategy]["load_without_state"], per_rank["ddp"]["load_without_state"]
        assert ours["keys"] == ddp["keys"] == ["iter_num", "model", "optimizer"]
        assert ours["iter_num"] == ddp["iter_num"] == 7
        assert ours["optimizer_steps"] == ddp["optimizer_steps"]
        assert ours["model"].keys() == ddp["model"].keys()
        for key, value in ddp["model"].items():
            close(ours["model"][key], value, f"rank {rank} {strategy} {key}", FP32)
        assert per_rank[strategy]["load_rest"] == per_rank["ddp"]["load_rest"] == {"iter_num": 7}


@pytest.mark.parametrize("strategy", SHARDED)
def test_misdirected_loads_name_the_call_to_make(results: list[dict[str, Any]], strategy: str) -> None:
    """``fabric.load`` of a raw state-dict file points at ``fabric.load_raw``, and ``fabric.load_raw`` of a checkpoint
    directory at ``fabric.load``, naming the path."""
    for per_rank in results:
        raw_file, directory = per_rank[strategy]["misdirected"]
        assert "raw.pt" in raw_file and "fabric.load_raw(path, model)" in raw_file
        assert ".ckpt is a checkpoint directory" in directory and "fabric.load(path, {'model': model" in directory


def test_torchs_warning_of_a_returned_view_comes_once_from_rank_zero(results: list[dict[str, Any]]) -> None:
    """Offloaded stage 3 runs on ``fully_shard``, which warns of a unit returning a view on every rank: the user sees
    it once, from rank 0. The package's own engine (stage 3 on the device) has nothing to warn of."""
    on_rank_zero = 1 if TORCH_WARNS_OF_VIEWS else 0
    seen = [per_rank["zero3"]["view_warnings"] for per_rank in results]
    assert [s["zero3_offload"] for s in seen] == [on_rank_zero] + [0] * (len(results) - 1)
    assert [s["zero3"] for s in seen] == [0] * len(results)


@pytest.mark.parametrize("strategy", ["zero2_full", "zero3_full"])
def test_a_full_checkpoint_is_one_file_that_ddp_loads_exactly(results: list[dict[str, Any]], strategy: str) -> None:
    """``state_dict_type="full"``: ``fabric.save`` writes one file, with the user's names, that Fabric's ``"ddp"``
    loads into a fresh model and optimizer as they were saved, bit for bit."""
    for rank, per_rank in enumerate(results):
        assert per_rank[strategy]["saved_a_file"] and per_rank["ddp"]["saved_a_file"]
        assert not per_rank["zero3"]["saved_a_file"]
        saved, loaded = per_rank[strategy]["saved"], per_rank[f"ddp_loads_{strategy}"]
        assert loaded["rest"] == {"iter_num": 7}
        for key, value in saved["weights"].items():
            assert torch.equal(loaded["weights"][key], value), f"rank {rank} {strategy} {key}"
        assert loaded["optimizer"].keys() == saved["optimizer"].keys()
        for index, entries in saved["optimizer"].items():
            for key, value in entries.items():
                assert torch.equal(loaded["optimizer"][index][key], value), f"rank {rank} state[{index}][{key}]"


class Restored(pl.Callback):
    """The weights and step a resumed Trainer starts from."""

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.weights = {k: v.clone() for k, v in module.state_dict().items()}
        self.step = trainer.global_step


def test_load_from_checkpoint_reads_a_full_best_model_path(run_dirs: dict[int, Path], tmp_path: Path) -> None:
    """Stage 3 on 2 ranks with ``ModelCheckpoint``: under ``state_dict_type="full"`` the best model path is one file
    that ``load_from_checkpoint`` reads, holding exactly what consolidating the same run's sharded checkpoint gives;
    a ZeRO Trainer of another world size and stage (one process, stage 1) resumes from it exactly."""
    paths = read_results(run_dirs[2], 2)[0]["best_model_paths"]
    full, sharded = Path(paths["full"]), Path(paths["sharded"])
    assert full.is_file() and sharded.is_dir()
    consolidated = torch.load(consolidate_checkpoint(sharded, tmp_path / "consolidated.ckpt"), weights_only=False)
    model = Classifier.load_from_checkpoint(full)
    assert model.state_dict().keys() == consolidated["state_dict"].keys()
    for key, value in consolidated["state_dict"].items():
        assert torch.equal(model.state_dict()[key], value), key
    restored = Restored()
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy="zero1", max_epochs=3, limit_train_batches=3, limit_val_batches=0,
        callbacks=[restored], logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(Classifier(), ckpt_path=full)
    assert restored.step == torch.load(full, weights_only=False)["global_step"] > 0
    for key, value in consolidated["state_dict"].items():
        assert torch.equal(restored.weights[key], value), key

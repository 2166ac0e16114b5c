"""``start_method="spawn"`` and ``"fork"``: the strategy, its precision plugin included, is pickled to every spawned
process, and rank 0 hands the trained weights back to the main process, layers built in ``configure_model`` too."""

from __future__ import annotations

import copy
import pickle
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision

from lightning_zero import Zero2Strategy, Zero3Strategy
from tests.launch import without_gloo_connections
from tests.workers.modules import Classifier
from tests.workers.modules_zero3 import TiedLM

pytestmark = pytest.mark.slow  # every test here launches processes


def train(module: pl.LightningModule, strategy: object, devices: int) -> None:
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=devices, max_steps=3, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        use_distributed_sampler=False,  # every rank reads the whole loader: the same batches as one process
    )  # fmt: skip
    trainer.fit(module)


def test_spawned_ranks_train_and_return_the_weights() -> None:
    """Two spawned ranks that see the same batches average identical gradients, so they train as one process does on
    those batches: the weights the main process gets back are that run's (within the parity tests' tolerance, for
    the shards' multi-tensor Adam), and moved away from the initial ones."""
    pl.seed_everything(0)
    spawned = Classifier()
    initial = copy.deepcopy(spawned.state_dict())
    reference = Classifier()
    reference.load_state_dict(initial)

    train(spawned, Zero2Strategy(start_method="spawn"), devices=2)
    train(reference, "auto", devices=1)

    for key, expected in reference.state_dict().items():
        torch.testing.assert_close(spawned.state_dict()[key], expected, rtol=1e-4, atol=1e-5, msg=key)
        if expected.is_floating_point():
            assert not torch.allclose(expected, initial[key]), f"{key} did not train"


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "bf16-true", "16-true", "64-true"])
def test_precision_plugin_pickles_as_itself(precision: str) -> None:
    """Every plugin a `precision=` flag gives is ZeRO-aware and pickles by reference to its module-level class."""
    trainer = pl.Trainer(strategy="zero2", accelerator="cpu", devices=1, precision=precision, logger=False)
    plugin = trainer.strategy.precision_plugin
    copied = pickle.loads(pickle.dumps(plugin))
    assert type(copied) is type(plugin) and type(plugin).__module__ == "lightning_zero.pytorch.precision"
    assert copied.precision == plugin.precision == precision


def test_unknown_precision_plugin_is_refused() -> None:
    class Custom(MixedPrecision):
        pass

    with pytest.raises(TypeError, match=r"`Custom` is not one the ZeRO strategies can adapt.*HINT.*ZeroMixedPrecision"):
        Zero2Strategy(precision_plugin=Custom("bf16-mixed", "cpu"))


def test_layers_built_in_configure_model_come_back() -> None:
    """Stage 3 on 2 forked ranks with a module that builds its layers in `configure_model` (created on the meta
    device there): the main process, which never ran the hook, gets the layers with the trained weights, those of
    one process trained on the same batches from the same seed."""
    pl.seed_everything(0)
    forked = TiedLM(build_in_configure_model=True)
    train(forked, Zero3Strategy(start_method="fork"), devices=2)
    pl.seed_everything(0)
    reference = TiedLM(build_in_configure_model=True)
    train(reference, "auto", devices=1)

    expected = reference.state_dict()
    assert forked.state_dict().keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(forked.state_dict()[key], value, rtol=1e-4, atol=1e-5, msg=key)


FORK_AFTER_A_RUN = """
import multiprocessing, sys
import torch.distributed as dist
import lightning_zero
from lightning_zero._transport.mesh import data_parallel_mesh

def run(store):  # a one-rank run that caches its mesh, as every ZeRO run does
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    data_parallel_mesh("cpu", 1)
    dist.destroy_process_group()

run(sys.argv[1] + "/parent")
child = multiprocessing.get_context("fork").Process(target=run, args=(sys.argv[1] + "/child",))
child.start()
child.join(30)
print("child exit code:", child.exitcode)
"""


def test_a_rank_forked_after_a_run_in_the_main_process_starts(tmp_path: Path) -> None:
    """A forked process that drops the last reference to a process group of its parent's ended run would destroy it,
    waiting for gloo threads that exist only in the parent: forever. The parent releases such groups before it
    forks."""
    done = subprocess.run(
        [sys.executable, "-c", FORK_AFTER_A_RUN, str(tmp_path)], capture_output=True, text=True, timeout=60,
        cwd=Path(__file__).resolve().parents[1],
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert without_gloo_connections(done.stdout).strip() == "child exit code: 0", done.stdout + done.stderr

"""The launchers. For ``start_method="fork"``, ``"spawn"`` or ``"forkserver"`` (notebooks): Lightning's, except that the
weights rank 0 hands back to the main process are whole tensors, so the module there ends ``fit`` trained under every
stage, that the main process builds the layers a module creates in ``configure_model`` before it loads them, and that
forked ranks compute on one thread each. For ``"popen"`` (copies of the script): Lightning's, except that rank 0 ends
after the ranks it started, and fails when one of them did."""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher, _WorkerOutput
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn
from torch.distributed.tensor import DTensor
from typing_extensions import override

from lightning_zero._transport import launched


class ScriptLauncher(launched.RecordsStartedRanks, _SubprocessScriptLauncher):
    """Lightning's, except that this process, rank 0, ends after the ranks it started, and not with 0 when one of them
    failed (:mod:`lightning_zero._transport.launched`)."""


class FullWeightsLauncher(_MultiProcessingLauncher):
    """After the function ran, every rank computes the module's state dict and rank 0 saves it for the main process
    to load. Under stage 3 its parameters are DTensor shards, which the main process (no process group, a plain
    module) cannot load: here each is gathered whole on every rank (one all-gather each) as the state dict is made.
    """

    @override
    def _wrapping_function(self, *args: Any, **kwargs: Any) -> None:
        """Runs in each started process. A forked one computes on a single thread: GNU OpenMP (torch's CPU builds on
        Linux) hangs in a child that runs a multi-threaded region after its parent ran one, as a notebook does when
        it evaluates the model before ``fit``. Lightning's own choice (cores / processes, or an inherited
        ``OMP_NUM_THREADS``) hangs there whenever it is more than one thread."""
        if self._start_method == "fork":
            torch.set_num_threads(1)
            os.environ["OMP_NUM_THREADS"] = "1"  # this process only; Lightning then keeps the setting
        super()._wrapping_function(*args, **kwargs)

    @override
    def _collect_rank_zero_results(self, trainer: pl.Trainer, results: Any) -> _WorkerOutput | None:
        handle = trainer.lightning_module.register_state_dict_post_hook(_gather_dtensors)
        try:
            return super()._collect_rank_zero_results(trainer, results)
        finally:
            handle.remove()

    @override
    def _recover_results_in_main_process(self, worker_output: _WorkerOutput, trainer: pl.Trainer) -> None:
        """Lightning loads the returned weights leniently (``strict=False``): into a module whose layers only the
        ranks built, in ``configure_model``, nothing would load. Build them here first, as ``load_from_checkpoint``
        does (the hook must be idempotent), so they receive the trained weights."""
        module = trainer.lightning_module
        if worker_output.weights_path is not None and is_overridden("configure_model", module):
            module.configure_model()
        super()._recover_results_in_main_process(worker_output, trainer)


def _gather_dtensors(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    for key, value in state_dict.items():
        if isinstance(value, DTensor):
            state_dict[key] = value.full_tensor()

"""Typed scenarios for the multi-process tests, for both front ends, and how they travel to the workers.

Vocabulary:

- **strategy spec** (:class:`StrategySpec`): a name in Lightning's strategy registry (``"ddp"``, ``"zero2"``,
  ``"zero3_offload"``, ...) and options for its class; each worker builds it from the registry of its front end
  (:meth:`StrategySpec.for_trainer`, :meth:`StrategySpec.for_fabric`). Its ``label`` names its runs in the results.
- **scenario**: what to train, and under which strategies: the first is the reference (the oracle of
  :mod:`tests.oracle`), the others are compared with it. :class:`Scenario` drives a ``Trainer``
  (``tests/workers/parity.py``), :class:`FabricScenario` a hand-written Fabric loop (``tests/workers/fabric.py``).
- **results**: one dict per rank, each run's record under ``(scenario name, strategy label)``, such as
  ``("memory", "zero2")``.
- **phase**: what one launch of a worker does (``tests/workers/checkpoints.py``, ``checkpoint_faults.py``,
  ``hybrid.py``, ``failed_load.py``, ``shared_memory.py``): a member of that worker's enum here
  (:class:`CheckpointPhase`, :class:`FaultPhase`, :class:`HybridPhase`, :class:`FailedLoadPhase`,
  :class:`SharedMemoryCheck`), sent with :func:`run_phase` or :func:`start_phase` like a scenario. The launcher's
  own probe (``launch_probe.py``) takes a :class:`tests.launch.Probe`: it must run without importing torch.

Scenarios and phases are pickled to the workers (:func:`tests.launch.write_payload`), never passed as strings in
``sys.argv``, so options may hold classes and module-level functions.
"""

from __future__ import annotations

import enum
import os
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGIES
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.pytorch.strategies import StrategyRegistry as TRAINER_STRATEGIES

import lightning_zero  # noqa: F401  (registers the "zero*" names the specs use)
from tests.launch import launch, start, write_payload
from tests.launch import read_payload as read_payload  # the workers' one import for their payload

WORLD_SIZE = int(os.environ.get("WORLD_SIZE", 1))  # in a worker; read now: Lightning's teardown removes it
#: the Trainer options of the workers' runs: nothing logged, printed or saved but what a run asks for
QUIET: dict[str, Any] = {
    "logger": False, "enable_checkpointing": False, "enable_progress_bar": False, "enable_model_summary": False,
}  # fmt: skip
MODULE_KWARGS = {"scheduler": "step", "config_style": "dict", "hidden": 29}  # the classifier the checkpoint tests train


def new_process_group() -> None:
    """In a worker, after a run whose error left its process group unusable (a verdict's release closed its
    connections, a divergence broke its shared-memory channel): destroy it, so that the next run makes one on another
    port, agreed through the old group's store, as a user who caught the error would."""
    import socket
    import time

    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    if dist.get_rank() == 0:
        with socket.socket() as free:
            free.bind(("127.0.0.1", 0))
            port = free.getsockname()[1]
        store.set("next_port", str(port))
        while store.add("next_port_taken", 0) < dist.get_world_size() - 1:  # rank 0 holds the store: it goes last
            time.sleep(0.01)
    else:
        port = int(store.get("next_port"))
        store.add("next_port_taken", 1)
    dist.destroy_process_group()
    os.environ["MASTER_PORT"] = str(port)


def cpu_trainer(strategy: Any, max_steps: int = -1, **options: Any) -> pl.Trainer:
    """A quiet Trainer on this worker's CPU ranks; ``options`` add to :data:`QUIET` or override it."""
    options = {**QUIET, **options}
    return pl.Trainer(accelerator="cpu", devices=WORLD_SIZE, strategy=strategy, max_steps=max_steps, **options)


@dataclass(frozen=True)
class StrategySpec:
    """A registered strategy name and options for its class, e.g. ``StrategySpec("zero2", {"master_weights": True})``.

    ``label`` is the name under which its runs are recorded: the name alone without options, else the name and the
    options, ``"zero2(master_weights=True)"``; pass one where the options would read badly (classes, directories).
    """

    name: str
    options: Mapping[str, Any] = field(default_factory=dict, hash=False)
    label: str = ""

    def __post_init__(self) -> None:
        if not self.label:
            options = ", ".join(f"{k}={v!r}" for k, v in self.options.items())
            object.__setattr__(self, "label", f"{self.name}({options})" if options else self.name)

    @classmethod
    def of(cls, spec: StrategySpec | str) -> StrategySpec:
        return spec if isinstance(spec, StrategySpec) else cls(spec)

    def for_trainer(self) -> Any:
        """The ``Trainer(strategy=...)`` argument: the name itself, or its class built with the options."""
        return self._build(TRAINER_STRATEGIES)

    def for_fabric(self) -> Any:
        """The ``Fabric(strategy=...)`` argument: the name itself, or its class built with the options."""
        return self._build(FABRIC_STRATEGIES)

    def _build(self, registry: _StrategyRegistry) -> Any:
        if not self.options:
            return self.name
        entry = registry[self.name]
        return entry["strategy"](**{**entry["init_params"], **self.options})

    @property
    def file_name(self) -> str:
        """The label made safe for a file or directory name."""
        return "".join(c if c.isalnum() or c in "_=-." else "_" for c in self.label)

    def __str__(self) -> str:  # pytest's test ids
        return self.label


@dataclass(frozen=True)
class Runs:
    """What every scenario has: a name, the strategies (the reference first), the seeded module and its arguments.

    ``module`` names a module of ``tests.workers.modules.MODULES``."""

    name: str
    _: KW_ONLY
    strategies: tuple[StrategySpec, ...]  # names may be given as strings
    module: str = "classifier"
    module_kwargs: Mapping[str, Any] = field(default_factory=dict)
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "strategies", tuple(StrategySpec.of(s) for s in self.strategies))

    @property
    def reference(self) -> StrategySpec:
        return self.strategies[0]

    @property
    def compared(self) -> tuple[StrategySpec, ...]:
        return self.strategies[1:]


@dataclass(frozen=True)
class Scenario(Runs):
    """A ``Trainer.fit`` of the module under each strategy (``tests/workers/parity.py``).

    Args:
        trainer_kwargs: ``Trainer`` arguments beyond the worker's defaults (CPU, ``devices`` = world size, no logger).
        max_steps: steps of the ``fit``.
        limit_val_batches: validation batches per check (none by default).
        after_fit: ``"validate"``, ``"test"``, ``"predict"``: run after the ``fit``, their results recorded.
        resume_at: train this many steps first, save a checkpoint, and resume from it in a fresh Trainer and module.
        save_with: the strategy of that first part (by default the run's own).
    """

    _: KW_ONLY
    trainer_kwargs: Mapping[str, Any] = field(default_factory=dict)
    max_steps: int = 6
    limit_val_batches: int | float = 0
    after_fit: tuple[str, ...] = ()
    resume_at: int | None = None
    save_with: StrategySpec | None = None


UNUSED_OK = "ddp_find_unused_parameters_true"  # DDP needs this where parameters go without gradients


def trainer_features(*compared: StrategySpec | str) -> list[Scenario]:
    """What every stage must match ``"ddp"`` on under a ``Trainer`` (:data:`UNUSED_OK` where parameters go without
    gradients): optimizers and schedulers, accumulation, clipping, frozen and unused parameters, evaluation, manual
    optimization; one list for stages 1 and 2 (tests/test_parity.py) and stage 3 (tests/test_zero3.py), so that no
    stage is held to less."""

    def scenario(name: str, reference: str = "ddp", **fields: Any) -> Scenario:
        return Scenario(name, strategies=(reference, *compared), **fields)

    return [
        scenario("adam"),
        scenario("param_groups", module_kwargs={"optimizer": "adamw_groups", "config_style": "list"}),
        scenario("sgd_scheduler_dict", module_kwargs={"optimizer": "sgd", "scheduler": "step", "config_style": "dict"}),
        scenario("lars_trust_ratio", module_kwargs={"optimizer": "lars"}),
        scenario("accumulate", trainer_kwargs={"accumulate_grad_batches": 3}, max_steps=4),
        scenario("clip_norm", trainer_kwargs={"gradient_clip_val": 0.05, "gradient_clip_algorithm": "norm"}),
        scenario("clip_value", trainer_kwargs={"gradient_clip_val": 0.01, "gradient_clip_algorithm": "value"}),
        scenario("frozen", module_kwargs={"freeze_first": True}),
        scenario("unused_every_other_step", UNUSED_OK, module_kwargs={"unused_branch": True}),
        scenario(
            "batchnorm_eval",
            module_kwargs={"batch_norm": True},
            limit_val_batches=2,
            trainer_kwargs={"val_check_interval": 3},
            after_fit=("validate", "test", "predict"),
        ),
        scenario("manual_one", module="manual"),
        scenario("manual_two_optimizers", UNUSED_OK, module="manual", module_kwargs={"two_optimizers": True}),
    ]


class Setup(enum.Enum):
    """How a Fabric loop sets up its module and optimizer."""

    TOGETHER = "setup"  # fabric.setup(model, optimizer), the optimizer built on the module before it
    SEPARATELY = "setup_module"  # fabric.setup_module(model), the optimizer built on it after, setup_optimizers


class ClipBy(enum.Enum):
    NORM = "norm"  # fabric.clip_gradients(max_norm=...)
    VALUE = "value"  # fabric.clip_gradients(clip_val=...)


@dataclass(frozen=True)
class Clip:
    by: ClipBy
    value: float


@dataclass(frozen=True)
class FabricScenario(Runs):
    """A hand-written Fabric training loop of the module under each strategy (``tests/workers/fabric.py``): each rank
    draws its own random batches, the same under every strategy.

    Args:
        setup: how the module and optimizer are set up.
        steps: optimizer steps.
        accumulate: micro-batches per step; all but the last run under ``fabric.no_backward_sync``.
        clip: gradient clipping before each step.
        precision: Fabric's ``precision`` flag.
        init_module: the compared strategies build the module inside ``fabric.init_module(empty_init=empty_init)``;
            the reference builds it eagerly (its weights are the oracle).
    """

    _: KW_ONLY
    setup: Setup = Setup.TOGETHER
    steps: int = 6
    accumulate: int = 1
    clip: Clip | None = None
    precision: str = "32-true"
    init_module: bool = False
    empty_init: bool | None = None


class FrontEnd(enum.Enum):
    TRAINER = "trainer"
    FABRIC = "fabric"


@dataclass(frozen=True)
class Saver:
    """Who writes a checkpoint: a front end training the classifier under a strategy for ``steps`` steps."""

    front_end: FrontEnd
    strategy: StrategySpec
    steps: int = 4

    @property
    def label(self) -> str:
        return f"{self.front_end.value}-{self.strategy.file_name}"


class Exchange(enum.Enum):
    """What a launch of the Fabric worker does with the :class:`Resume` entries, after its scenarios."""

    SAVE = "save"  # each saver trains and writes its checkpoint (on 2 ranks)
    LOAD = "load"  # each resume loads one (on 3 ranks)


class Source(enum.Enum):
    """What a resume loads from a checkpoint directory."""

    DIRECTORY = "directory"  # the directory itself
    CONSOLIDATED = "consolidated"  # the single file `consolidate_checkpoint` makes of it


@dataclass(frozen=True)
class Resume:
    """A checkpoint written by ``saver`` on 2 ranks and loaded, into a fresh module and optimizer, by ``front_end``
    under ``strategy`` on 3 ranks; the state after loading must be what was saved, bit for bit."""

    name: str
    saver: Saver
    front_end: FrontEnd
    strategy: StrategySpec
    source: Source = Source.DIRECTORY


class CheckpointPhase(enum.Enum):
    """The launches of ``tests/workers/checkpoints.py``, in the order the tests make them on one directory."""

    TRAIN = "train"  # 2 ranks: the truth, a zero2 checkpoint, a DDP run, ModelCheckpoint rotation, epoch resumes
    RESUME_3RANKS_ZERO1 = "resume_3ranks_zero1"  # restore only (max_steps already reached), then save at 3 ranks
    RESUME_1RANK_ZERO2 = "resume_1rank_zero2"  # restore that on 1 rank under stage 2, save, train on
    RESUME_EXACTLY = "resume_exactly"  # per stage: stop at an epoch end, save, resume in a fresh Trainer
    CRASH_DURING_SAVE = "crash_during_save"  # a good save, then every rank dies half-way through the next
    RESUME_AFTER_CRASH = "resume_after_crash"  # resume from the good one, save over the leftovers


class FaultPhase(enum.Enum):
    """The launches of ``tests/workers/checkpoint_faults.py``."""

    SAVE = "save"  # a checkpoint of 2 ranks and its weights, for the tests to alter copies of
    RESUME_EACH = "resume_each"  # try to resume from each of the paths given; note what every rank raised
    KILL_DURING_PUBLISH = "kill_during_publish"  # per case: a checkpoint, a later one saved over it, dying at a step
    KILL_DURING_WRITE = "kill_during_write"  # every rank dies right after writing its shards over a checkpoint
    RESUME_AND_SAVE = "resume_and_save"  # for each of the paths given: resume from it, train on, save over it
    FILE_SIZE_LIMIT = "file_size_limit"  # rank 1 may write no file past a size limit: its shard file fails
    SAVE_REPEATEDLY = "save_repeatedly"  # a job (payload "job") with a process group of its own saves to one path


class HybridPhase(enum.Enum):
    """The launches of ``tests/workers/hybrid.py``."""

    TRAIN = "train"  # 2 nodes of 2: "ddp" and every stage with hybrid sharding, each saving a checkpoint
    RESUME = "resume"  # 2 ranks on one node: each hybrid checkpoint under another stage, fully sharded


class FailedLoadPhase(enum.Enum):
    """The launches of ``tests/workers/failed_load.py``, on 2 ranks under zero2."""

    SAVE = "save"  # a checkpoint of a module of 2 layers
    LOAD = "load"  # load it into a module of 3, which raises; at exit, report whether that module is still alive


class SharedMemoryCheck(enum.Enum):
    """The launches of ``tests/workers/shared_memory.py``."""

    OPEN = "open"  # the channel opens and leaves nothing in /dev/shm
    COLLECTIVES = "collectives"  # exact results of every collective, the gather ring's hand-out rule
    PEER_EXIT = "peer_exit"  # rank 1 exits without a word: rank 0 reports it
    TIMEOUT = "timeout"  # rank 1 arrives late: rank 0 reports it after the group's timeout
    CHANNEL_ALONE = "channel_alone"  # rank 1 never comes to the channel's opening: rank 0 waits there, to be killed
    RING_ALONE = "ring_alone"  # the same in the opening of stage 3's gather ring


class Divergence(enum.Enum):
    """Where ``tests/workers/divergent.py`` runs code that differs between ranks under stage 3."""

    PREDICT = "predict"  # `generate()` in `predict_step`, each rank its own number of new tokens
    VALIDATE = "validate"  # the same in `validation_step`, through `Trainer.validate`
    FIT = "fit"  # the same in the validation between two training epochs
    BRANCH = "branch"  # a plain module whose forward runs one of its units on rank 0 only


class Fault(enum.Enum):
    """Where ``tests/workers/faults.py`` breaks a run; ``RAISE_AT`` there is the step."""

    NONE = "none"  # train until the test stops or kills a rank; no validation, so every collective is this package's
    TRAINING_STEP = "training_step"  # every rank raises ValueError there
    VALIDATION_STEP = "validation_step"  # every rank raises ValueError there
    ON_TRAIN_START = "on_train_start"  # every rank raises ValueError there, before any forward (at step 0)
    RANK1_STOPS_IN_STEP = "rank1_stops_in_step"  # rank 1 SIGSTOPs itself at the start of training_step
    RANK1_STOPS_BETWEEN_STEPS = "rank1_stops_between_steps"  # the same once the step has ended
    # rank 1 reaches its address-space limit (RLIMIT_AS): a Python allocation raises MemoryError
    RANK1_OUT_OF_MEMORY_IN_STEP = "rank1_out_of_memory_in_step"  # in training_step, before the forward
    RANK1_OUT_OF_MEMORY_IN_BACKWARD = "rank1_out_of_memory_in_backward"  # in a hook of the backward
    RANK1_OUT_OF_MEMORY_BEFORE_SAVE = "rank1_out_of_memory_before_save"  # no allocation: the checkpoint's save runs out
    RANK1_OUT_OF_MEMORY_BEFORE_LOAD = "rank1_out_of_memory_before_load"  # the same for a resume's load


class Preemption(enum.Enum):
    """Where in step ``SIGNAL_AT`` of ``tests/workers/preemption.py`` every rank (or one) sends itself a signal, or
    raises."""

    IN_FORWARD = "sigusr1_in_forward"  # in a block's training forward (stage 3: that unit gathered)
    BEFORE_BACKWARD = "sigusr1_before_backward"  # in training_step, the loss computed (stage 3: the root gathered)
    BETWEEN_BACKWARD_AND_STEP = "sigusr1_between_backward_and_step"  # on_before_optimizer_step
    AFTER_STEP = "sigusr1_after_step"  # optimizer_step, once the optimizer stepped and before Lightning counts it
    DURING_SAVE = "sigusr1_during_save"  # on_save_checkpoint of a ModelCheckpoint's save
    RANK1_ONLY = "sigusr1_rank1_only"  # on_before_optimizer_step, on rank 1 alone
    # on_before_optimizer_step; then the next save dies half-way, leaving its staging directory (.hpc_ckpt_2.ckpt...)
    SAVE_KILLED = "sigusr1_then_a_save_killed"
    SIGTERM = "sigterm_between_backward_and_step"  # SIGTERM there; OnExceptionCheckpoint saves the checkpoint
    EXCEPTION = "exception_before_backward"  # every rank raises ValueError there; OnExceptionCheckpoint saves


@dataclass(frozen=True)
class FaultyRun:
    """One ``fit`` of ``tests/workers/faults.py``: the stage-3 test module under ``strategy`` (``"zero1"``,
    ``"zero2"``, ``"zero3"`` or ``"ddp"``, for comparison), broken by ``fault``."""

    strategy: str
    fault: Fault = Fault.NONE


def run_phase(
    worker: str, phase: enum.Enum, out_dir: Path, world_size: int, *, paths: Sequence[Path] = (), **launch_options: Any
) -> list[str]:
    """Run ``phase`` in ``world_size`` processes of ``worker``, which reads it (and ``paths``, the checkpoints it
    works on) with :func:`read_payload`; ``launch_options`` go to :func:`tests.launch.launch`. Returns each rank's
    output."""
    write_payload(out_dir, phase=phase, paths=[Path(p) for p in paths])
    return launch(worker, [str(out_dir)], world_size, **launch_options)


def start_phase(
    worker: str,
    phase: enum.Enum,
    out_dir: Path,
    world_size: int,
    *,
    logs: Path,
    paths: Sequence[Path] = (),
    **entries: Any,
) -> list[subprocess.Popen[bytes]]:
    """:func:`run_phase`, the processes left running (:func:`tests.launch.start`, each one's output in
    ``logs/rank<r>.log``); ``entries`` go into the payload beside the phase."""
    write_payload(out_dir, phase=phase, paths=[Path(p) for p in paths], **entries)
    return start(worker, [str(out_dir)], world_size, logs=logs)


def run_scenarios(
    scenarios: Sequence[Runs],
    world_size: int,
    out_dir: Path,
    worker: str = "tests.workers.parity",
    **extra: Any,
) -> list[dict[Any, Any]]:
    """Run ``scenarios`` in ``world_size`` processes of ``worker`` (which reads them under ``"scenarios"`` with
    :func:`read_payload`, along with ``extra``); return each rank's results."""
    write_payload(out_dir, scenarios=list(scenarios), **extra)
    launch(worker, [str(out_dir)], world_size)
    return read_results(out_dir, world_size)


def save_results(out_dir: Path, rank: int, results: Any) -> None:
    """In a worker: this rank's results, for :func:`read_results`."""
    torch.save(results, out_dir / f"rank{rank}.pt")


def read_results(out_dir: Path, world_size: int) -> list[Any]:
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world_size)]

"""User-facing options, validated once, with errors that name the option and how to fix it."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from enum import Enum, IntEnum
from pathlib import Path
from typing import Any, Literal

import torch

from lightning_zero._deepspeed_config import deepspeed_options
from lightning_zero._deepspeed_optim import DeepSpeedOptimization
from lightning_zero._offload.page_cache import PageCache, PageCacheOption
from lightning_zero._offload.target import OffloadTarget, check_directory
from lightning_zero._wrap import ModuleFilter, ModulePolicy, RepeatedEntries, resolve_policy

ModuleOption = set[type[torch.nn.Module] | str] | list[type[torch.nn.Module] | str] | int | ModuleFilter | None
"""How a user names submodules (``auto_wrap_policy``, ``activation_checkpointing``): see :mod:`lightning_zero._wrap`."""


class StateDictType(str, Enum):
    """How a checkpoint is written (the name and values of Lightning's ``FSDPStrategy`` option)."""

    SHARDED = "sharded"  # a directory, each rank writing its own shards
    FULL = "full"  # one ordinary file, written by rank 0 from tensors gathered whole one at a time


class Stage(IntEnum):
    """What ZeRO shards across data-parallel ranks."""

    OPTIMIZER = 1  # optimizer state
    GRADIENTS = 2  # optimizer state and gradients
    PARAMETERS = 3  # optimizer state, gradients and parameters (torch's ``fully_shard``)


@dataclass(frozen=True, kw_only=True)
class ZeroConfig:
    stage: Stage
    """1 shards optimizer state; 2 also gradients; 3 also parameters."""

    bucket_cap_mb: float = 25.0
    """Size of the buckets in which gradients are reduced and parameters gathered, in MiB (stages 1 and 2; in stage 3,
    consecutive units whose gradients fit in it together are reduced in one collective). Larger buckets mean fewer
    collective calls; smaller ones start communication earlier in backward and bound the staging memory."""

    keep_for_backward_mb: float = 25.0
    """Stage 3 (not offloaded): MiB of gathered parameters kept from their forward to their backward instead of
    gathered again: those of the last units to run, whose backward comes first, while they fit together (learnt from
    the step before). ``0`` gathers every unit twice a step, as ``fully_shard`` does."""

    broadcast_buffers: bool = True
    """Broadcast module buffers (BatchNorm statistics) from rank 0 before each synchronised training step, as DDP
    does by default, so every rank trains on the same buffer values."""

    auto_wrap_policy: ModulePolicy = field(default_factory=RepeatedEntries)
    """Stage 3: which submodules become units of their own, all-gathered just before their forward and freed after
    it (and again in backward); everything else lives in the root unit, gathered for the whole step."""

    activation_checkpointing: ModulePolicy | None = None
    """Which submodules recompute their activations in backward instead of keeping them (any stage)."""

    master_weights: bool = False
    """ZeRO mixed precision: with a 16-bit module (``precision="bf16-true"``, or ``"16-true"`` in stages 1 and 2),
    parameters and gradients stay 16-bit in the module and on the wire, while the optimizer steps on an fp32 master
    copy of this rank's shard only (in stage 3 the fp32 shards are the masters, gathered as bf16); fp16 gradients
    get dynamic loss scaling that skips a step on every rank when any rank overflows."""

    reduce_dtype: torch.dtype | None = None
    """Stages 2 and 3: dtype gradients are reduced in; ``torch.float32`` for accuracy with a 16-bit module.
    ``None``: the parameters' dtype, half the traffic."""

    offload_optimizer: OffloadTarget = OffloadTarget.DEVICE
    """Where the fp32 masters, optimizer state and optimizer step live: on the device, on the host (``"cpu"``), or on
    the host with the optimizer state in memory-mapped files under ``offload_dir`` (``"disk"``). In stage 3 the shards
    are the optimizer's parameters, so they and their gradients move to the host with it."""

    offload_parameters: OffloadTarget = OffloadTarget.DEVICE
    """Stage 3: where the parameter shards live between their gathers. On the host (``True`` or ``"cpu"``), each unit
    comes to the device only while it is gathered; in memory-mapped files under ``offload_dir`` (``"disk"``,
    ZeRO-Infinity), with their gradients, each unit read ahead of its gather and dropped from memory after it. The
    optimizer then steps on the host too (it updates those shards), one unit at a time with ``"disk"``."""

    offload_dir: Path | None = None
    """The directory of ``"disk"`` offload: a local disk with room for this node's optimizer state (and, with
    ``offload_parameters="disk"``, its parameter shards and gradients)."""

    max_in_cpu: int = 0
    """``offload_parameters="disk"``: parameter elements per rank kept in host memory rather than in files (DeepSpeed's
    and ColossalAI's unit): the shards of the first units, in order, while they fit (4 bytes an element in fp32)."""

    prefetch_units: int = 2
    """``offload_parameters="disk"``: how many units ahead of the one being gathered are read from disk, overlapped
    with compute (DeepSpeed's ``buffer_count`` less the one in use)."""

    page_cache: PageCacheOption = PageCache.AUTO
    """``"disk"`` offload: how much of the offload files the page cache may hold once the process has left their pages.
    ``"auto"``: without a memory limit below the machine's memory, as ``"keep"``; under one (a cgroup's, which counts
    the page cache), what the limit leaves beside the group's working set, the oldest pages written back and dropped
    beyond it. ``"keep"``: the kernel keeps them and writes them back as it sees fit. ``"drop"``: each range is written
    back and dropped as it leaves the process. A number: at most that many bytes per rank."""

    pin_memory: bool = True
    """Page-lock host copies of a CUDA module's state, so transfers run asynchronously at full speed."""

    memory_report: bool = True
    """Log, on rank 0 right after the first optimizer step of each ``fit``, this rank's measured model-state bytes
    beside the ZeRO paper's estimate for the same stage, ranks and precision."""

    shard_group_size: int | Literal["node"] | None = None
    """Hybrid sharding: model states are sharded within groups of this many consecutive ranks (``"node"``: the ranks
    of one node) and replicated across the groups; gradients are reduce-scattered within a group, then each shard is
    all-reduced across the groups, and parameters are gathered within a group only. ``None``: one group of every rank
    (full sharding). Per-rank bytes then follow the group size, not the number of ranks."""

    quantize_weights: bool = False
    """Stage 3 (ZeRO++'s quantized weights): a unit's parameters cross between hosts as int8 with a scale per 256
    elements, a quarter of fp32's bytes; every rank computes with the same dequantized weights, while the shards the
    optimizer steps (the masters) stay exact. Gathers within a host stay exact."""

    quantize_gradients: bool = False
    """Stages 2 and 3 (ZeRO++'s quantized gradients): gradients are reduced within each host at full precision, then
    across hosts as int8 with a scale per 256 elements, the error of each exchange carried into the next (error
    feedback); under hybrid sharding, the all-reduce of each shard across the shard groups. Reductions within a host
    stay exact."""

    secondary_group_size: int | Literal["node"] | None = None
    """Stage 3 (ZeRO++'s secondary partition): after its forward, each unit keeps its parameters sharded within groups
    of this many consecutive ranks (``"node"``: the ranks of one node) until its backward, whose gathers then stay
    within the group, on the node's links. Costs each rank ``1/size`` of each unit between the two."""

    state_dict_type: StateDictType = StateDictType.SHARDED
    """How checkpoints are written: ``"sharded"``, a directory in which each rank writes its own shards (fast, no rank
    holds the whole model); ``"full"``, one ordinary checkpoint file written by rank 0, which ``load_from_checkpoint``
    and a plain ``Trainer`` read as they are (rank 0 holds the whole checkpoint on the host while writing). Either
    kind resumes under any stage at any world size."""

    sharded_on_one_device: bool = False
    """For testing: run the ZeRO machinery (buckets and collectives, optimizer shards, ``fully_shard``) on a single
    device too, as a group of one rank, where every stage otherwise trains plainly. Results equal plain training's;
    it proves that the sharded code paths run on the device and its backend (NCCL on a GPU), not the communication
    between several ranks."""

    stall_after: float = 60.0
    """Seconds a collective may wait for its peers before every rank is asked what it is doing, and then for their
    answers: ranks that run different code, or a peer that stopped, exited or gave no sign of life that long, then
    fail on every rank with an error naming each rank's activity, on every transport (see
    :mod:`lightning_zero._watchdog`), instead of after the process group's ``timeout`` (30 minutes). A peer that is
    only slower (busy outside collectives, or computing in native code) is waited for."""

    deepspeed_optimization: DeepSpeedOptimization | None = None
    """Not an option of its own: the ``optimizer`` and ``scheduler`` sections of a ``deepspeed_config``, which the
    Trainer builds in place of what ``configure_optimizers`` returns (see :mod:`lightning_zero._deepspeed_optim`)."""

    @classmethod
    def option_names(cls) -> list[str]:
        """The names of the ZeRO options, ``stage`` first."""
        return [f.name for f in fields(cls) if f.name != "deepspeed_optimization"]

    @classmethod
    def for_strategy(
        cls,
        strategy: str,
        fixed_stage: Stage | None,
        unknown: dict[str, Any],
        *,
        peer: str,
        stage: object,
        deepspeed_config: str | os.PathLike | Mapping[str, Any] | None = None,
        **options: Any,
    ) -> ZeroConfig:
        """The options a strategy class named ``strategy`` was given: ``fixed_stage`` is the stage a ``Zero{N}Strategy``
        runs (``None`` for ``ZeroStrategy``); ``unknown`` what it did not take, refused with the names of the ZeRO
        options and of the Lightning strategy ``peer`` it takes the rest from. A ``deepspeed_config`` sets the options
        it maps to (see :mod:`lightning_zero._deepspeed_config`) where they were left at their defaults."""
        if deepspeed_config is not None:
            stage, options = _with_deepspeed_config(strategy, deepspeed_config, stage, options)
        if unknown:
            names = cls.option_names()
            listed = ", ".join(f"`{n}`" for n in names[:-1]) + f" and `{names[-1]}`"
            raise TypeError(
                f"{strategy} got unknown option(s) {sorted(unknown)}. HINT: the ZeRO options are {listed}; the rest"
                f" are those of Lightning's `{peer}`."
            )
        if fixed_stage is not None and stage is not None and stage != fixed_stage:
            raise ValueError(
                f"{strategy} runs stage {int(fixed_stage)}, not `stage={stage!r}`."
                f" HINT: use `ZeroStrategy(stage={stage!r})` or the matching `Zero{stage}Strategy`."
            )
        return cls.from_options(stage=(fixed_stage or Stage.GRADIENTS) if stage is None else stage, **options)

    @classmethod
    def from_options(cls, **options: object) -> ZeroConfig:
        """The config of the options a user gave (those left out keep their defaults), each checked and turned into
        its field's form: errors name the option and its value, and end with a HINT."""
        given = {f.name: _AS_GIVEN.get(f.name, f.default) for f in fields(cls)} | options
        stage = given["stage"]
        valid = [s.value for s in Stage]
        if isinstance(stage, bool) or not isinstance(stage, int) or stage not in valid:
            raise ValueError(
                f"`stage={stage!r}` is not a ZeRO stage this strategy runs. HINT: pass `stage` as one of {valid}."
            )
        bucket_cap_mb = given["bucket_cap_mb"]
        if not _finite_number(bucket_cap_mb) or bucket_cap_mb <= 0:  # type: ignore[operator]
            raise ValueError(
                f"`bucket_cap_mb={bucket_cap_mb!r}` must be a finite, positive number of MiB. HINT: the default, 25,"
                " suits most models."
            )
        keep_mb = given["keep_for_backward_mb"]
        if not _finite_number(keep_mb) or keep_mb < 0:  # type: ignore[operator]
            raise ValueError(
                f"`keep_for_backward_mb={keep_mb!r}` must be a finite number of MiB, 0 or more. HINT: the default, 25,"
                " saves small units' second gather; 0 gathers every unit again for its backward."
            )
        if not isinstance(given["memory_report"], bool):
            raise ValueError(
                f"`memory_report={given['memory_report']!r}` must be True or False. HINT: `memory_report=False` turns"
                " the report off."
            )
        for name in _SWITCHES:
            if not isinstance(given[name], bool):
                raise ValueError(f"`{name}={given[name]!r}` must be True or False.")
        if given["auto_wrap_policy"] is not None and stage != Stage.PARAMETERS:
            raise ValueError(
                f"`auto_wrap_policy` shapes the units of stage 3; stage {stage} keeps full parameters."
                " HINT: use `Zero3Strategy` (or `stage=3`), or drop `auto_wrap_policy`."
            )
        wrap = resolve_policy("auto_wrap_policy", given["auto_wrap_policy"])
        match given["activation_checkpointing"]:
            case None | False:
                checkpointing = None
            case True:
                checkpointing = wrap  # the modules the wrap policy picks (the repeated entries in stages 1 and 2)
            case other:
                checkpointing = resolve_policy("activation_checkpointing", other)
        group_size = given["shard_group_size"]
        if group_size not in (None, "node") and (
            isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1
        ):
            raise ValueError(
                f"`shard_group_size={group_size!r}` is not a group size. HINT: pass a positive number of ranks that"
                " divides the number of ranks, 'node' for one shard group per node, or None to shard across all."
            )
        _check_zero_plus_plus(Stage(stage), given, given["offload_parameters"] not in (False, None, "none"))
        stall_after = given["stall_after"]
        if isinstance(stall_after, bool) or not isinstance(stall_after, (int, float)) or not 0 < stall_after < math.inf:
            raise ValueError(
                f"`stall_after={stall_after!r}` must be a finite, positive number of seconds. HINT: the default, 60,"
                " suits most jobs; raise it where one rank legitimately works alone for longer (a large checkpoint"
                " written by rank 0) while the others wait."
            )
        dtype = _resolve_dtype(given["reduce_dtype"])
        if dtype is not None and stage == Stage.OPTIMIZER:
            raise ValueError(
                "`reduce_dtype` applies to the gradient shards of stages 2 and 3; stage 1 keeps full gradients in the"
                " parameters' dtype. HINT: use `Zero2Strategy`, or drop `reduce_dtype`."
            )
        parameters = _resolve_offload("offload_parameters", given["offload_parameters"])
        if parameters is not OffloadTarget.DEVICE and stage != Stage.PARAMETERS:
            raise ValueError(
                f"`offload_parameters={given['offload_parameters']!r}` moves the parameter shards of stage 3 off the"
                f" device; stage {stage} keeps full parameters on the device. HINT: use `Zero3Strategy` (or"
                ' `"zero3_offload"`), or offload only the optimizer with `offload_optimizer=True`.'
            )
        optimizer = _resolve_offload("offload_optimizer", given["offload_optimizer"])
        _check_disk_parameter_options(parameters, given["max_in_cpu"], given["prefetch_units"])
        page_cache = _resolve_page_cache(given["page_cache"], OffloadTarget.DISK in (optimizer, parameters))
        state_dict_type = given["state_dict_type"]
        if state_dict_type not in [t.value for t in StateDictType]:
            raise ValueError(
                f"`state_dict_type={state_dict_type!r}` is not a kind of checkpoint. HINT: pass 'sharded' (a directory"
                " of each rank's shards, the default) or 'full' (one ordinary file, written by rank 0)."
            )
        return cls(
            **{name: given[name] for name in (*_SWITCHES, "memory_report")},
            stage=Stage(stage),
            bucket_cap_mb=float(bucket_cap_mb),
            keep_for_backward_mb=float(keep_mb),
            auto_wrap_policy=wrap,
            activation_checkpointing=checkpointing,
            reduce_dtype=dtype,
            offload_optimizer=optimizer,
            offload_parameters=parameters,
            offload_dir=_resolve_offload_dir(optimizer, parameters, given["offload_dir"]),
            max_in_cpu=given["max_in_cpu"],
            prefetch_units=given["prefetch_units"],
            page_cache=page_cache,
            shard_group_size=group_size,
            secondary_group_size=given["secondary_group_size"],
            state_dict_type=StateDictType(state_dict_type),
            stall_after=float(stall_after),
            deepspeed_optimization=given["deepspeed_optimization"],
        )

    @property
    def offload(self) -> OffloadTarget:
        """Where the optimizer lives, ``offload_parameters`` included (it takes the optimizer to the host; parameters
        on disk take its state to disk too, unless ``offload_optimizer`` keeps it in host memory)."""
        if self.offload_optimizer is OffloadTarget.DEVICE:
            return self.offload_parameters
        return self.offload_optimizer

    @property
    def master_dtype(self) -> torch.dtype | None:
        return torch.float32 if self.master_weights else None

    @property
    def bucket_bytes(self) -> int:
        return int(self.bucket_cap_mb * 1024 * 1024)

    @property
    def keep_for_backward_bytes(self) -> int:
        return int(self.keep_for_backward_mb * 1024 * 1024)


def _finite_number(value: object) -> bool:
    """An int or float, not a bool, neither NaN nor infinite (either would fail in ``fit``, made a byte count)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# options whose field differs from what a user gives
_AS_GIVEN: dict[str, object] = {
    "auto_wrap_policy": None,
    "offload_optimizer": False,
    "offload_parameters": False,
    "page_cache": "auto",
}


def _with_deepspeed_config(
    strategy: str, config: str | os.PathLike | Mapping[str, Any], stage: object, options: dict[str, Any]
) -> tuple[object, dict[str, Any]]:
    """``stage`` and ``options`` with what ``config`` sets; an option given otherwise beside it is refused."""
    defaults = {f.name: _AS_GIVEN.get(f.name, f.default) for f in fields(ZeroConfig)} | {"stage": None}
    given = {**defaults, **options, "stage": stage}
    for name, value in deepspeed_options(config).items():
        if given[name] != defaults[name] and given[name] != value:
            raise ValueError(
                f"{strategy} got `{name}={given[name]!r}` and a DeepSpeed config that sets it to {value!r}."
                f" HINT: change it in the config, or leave `{name}` out of the strategy's arguments."
            )
        given[name] = value
    stage = given.pop("stage")
    return stage, {k: v for k, v in given.items() if k in options or v != defaults[k]}


_SWITCHES = (
    "broadcast_buffers", "master_weights", "pin_memory", "sharded_on_one_device", "quantize_weights",
    "quantize_gradients",
)  # fmt: skip


def _check_zero_plus_plus(stage: Stage, given: dict[str, Any], parameters_offloaded: bool) -> None:
    """ZeRO++'s options against the stage and the other options (the switches' types are checked with the others)."""
    if given["quantize_weights"] is True and stage != Stage.PARAMETERS:
        raise ValueError(
            f"`quantize_weights=True` quantizes stage 3's gathers of parameters; stage {stage} keeps full parameters"
            " on every rank. HINT: use `Zero3Strategy` (or `stage=3`), or drop `quantize_weights`."
        )
    if given["quantize_gradients"] is True and stage == Stage.OPTIMIZER:
        raise ValueError(
            "`quantize_gradients=True` quantizes the gradient reductions of stages 2 and 3; stage 1 all-reduces full"
            " gradients. HINT: use `Zero2Strategy` or `Zero3Strategy`, or drop `quantize_gradients`."
        )
    size = given["secondary_group_size"]
    if size is None:
        return
    if size != "node" and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
        raise ValueError(
            f"`secondary_group_size={size!r}` is not a group size. HINT: pass a positive number of ranks that divides"
            " the number of ranks, 'node' for the ranks of one node, or None."
        )
    if stage != Stage.PARAMETERS:
        raise ValueError(
            f"`secondary_group_size={size!r}` keeps stage 3's parameters sharded within a group between a unit's"
            f" forward and backward; stage {stage} keeps full parameters. HINT: use `Zero3Strategy`, or drop it."
        )
    if given["shard_group_size"] is not None:
        raise ValueError(
            f"`secondary_group_size={size!r}` with `shard_group_size={given['shard_group_size']!r}`: hybrid"
            " sharding gathers within its shard groups already. HINT: drop one of the two."
        )
    if parameters_offloaded:
        raise ValueError(
            f"`secondary_group_size={size!r}` keeps gathered parameters on the device between forward and backward;"
            " `offload_parameters` keeps them off it. HINT: drop one of the two."
        )


def _resolve_offload_dir(optimizer: OffloadTarget, parameters: OffloadTarget, offload_dir: object) -> Path | None:
    on_disk = [f"{name}='disk'" for name, target in (("offload_optimizer", optimizer), ("offload_parameters",
               parameters)) if target is OffloadTarget.DISK]  # fmt: skip
    if on_disk:
        if not isinstance(offload_dir, (str, Path)) or not str(offload_dir):
            raise ValueError(
                f"`{on_disk[-1]}` keeps state in files, but `offload_dir={offload_dir!r}`."
                " HINT: pass `offload_dir` as the path of a directory on a local disk (e.g. an NVMe drive)."
            )
        return check_directory("offload_dir", Path(offload_dir))
    if offload_dir is not None:
        raise ValueError(
            f"`offload_dir={offload_dir!r}` is used only by `offload_optimizer='disk'` or `offload_parameters='disk'`."
            " HINT: pass one of them as well, or drop `offload_dir`."
        )
    return None


def _check_disk_parameter_options(parameters: OffloadTarget, max_in_cpu: object, prefetch_units: object) -> None:
    for name, value, default in (("max_in_cpu", max_in_cpu, 0), ("prefetch_units", prefetch_units, 2)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"`{name}={value!r}` must be a whole number, 0 or more.")
        if value != default and parameters is not OffloadTarget.DISK:
            raise ValueError(
                f"`{name}={value!r}` shapes how parameter shards on disk are read; they are not on disk here."
                f" HINT: pass `offload_parameters='disk'` with `offload_dir`, or drop `{name}`."
            )


def _resolve_page_cache(value: object, on_disk: bool) -> PageCacheOption:
    match value:
        case PageCache():
            resolved: PageCacheOption = value
        case str() if value in [kind.value for kind in PageCache]:
            resolved = PageCache(value)
        case int() if not isinstance(value, bool) and value >= 0:
            resolved = value
        case _:
            raise ValueError(
                f"`page_cache={value!r}` is not a page-cache budget. HINT: pass 'auto' (the default: under a memory"
                " limit, what it leaves beside the working set), 'keep' (the kernel decides), 'drop' (each range"
                " written back and dropped as it leaves the process) or a whole number of bytes per rank."
            )
    if resolved != PageCache.AUTO and not on_disk:
        raise ValueError(
            f"`page_cache={value!r}` budgets the page cache of the offload files, and nothing is offloaded to disk"
            " here. HINT: pass `offload_optimizer='disk'` or `offload_parameters='disk'` with `offload_dir`, or drop"
            " `page_cache`."
        )
    return resolved


_REDUCE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _resolve_dtype(value: object) -> torch.dtype | None:
    if value is None or value in _REDUCE_DTYPES.values():
        return value  # type: ignore[return-value]
    if isinstance(value, str) and value.removeprefix("torch.") in _REDUCE_DTYPES:
        return _REDUCE_DTYPES[value.removeprefix("torch.")]
    raise ValueError(f"`reduce_dtype={value!r}` is not a dtype to reduce in. HINT: use one of {list(_REDUCE_DTYPES)}.")


def _resolve_offload(option: str, value: object) -> OffloadTarget:
    match value:
        case False | None | "none":
            return OffloadTarget.DEVICE
        case True | "cpu":
            return OffloadTarget.CPU
        case "disk" | "nvme":
            return OffloadTarget.DISK
        case OffloadTarget():
            return value
    what = "the optimizer" if option == "offload_optimizer" else "the parameter shards"
    raise ValueError(
        f'`{option}={value!r}` is not a place for {what}. HINT: use False, True (or "cpu") for host memory, or "disk"'
        " with `offload_dir` for memory-mapped files."
    )

"""What both front ends' ``ZeroAutoStrategy`` share: the model counted, each rank's budget measured and agreed, the
candidate chosen and turned into the strategy's options, before the mode that trains is made."""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_zero._auto.budget import Budget, device_room, disk_room, host_room
from lightning_zero._auto.candidates import Candidate, Offload, Working, Workload
from lightning_zero._auto.choice import AutoChoice, AutoChoiceError, AutoOptions, decide
from lightning_zero._config import Stage, ZeroConfig
from lightning_zero._core.report import log_info
from lightning_zero._offload.process_group import backend_with_host
from lightning_zero._transport.stalls import as_verdict
from lightning_zero._wrap import choose_units

# options the choice sets, or that tune only a placement it may not choose, with their defaults
_CHOSEN: dict[str, object] = {
    "stage": None,
    "offload_optimizer": False,
    "offload_parameters": False,
    "max_in_cpu": 0,
    "prefetch_units": 2,
    "page_cache": "auto",
    "deepspeed_config": None,
}


def without_chosen_options(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` less those the choice sets, which may only hold their defaults (a LightningCLI config passes every
    option of the signature it resolves): another value is refused, by name."""
    for name, default in _CHOSEN.items():
        if name in options and options[name] != default:
            raise ValueError(
                f"zero_auto chooses the stage and the offload itself and takes no `{name}`. HINT: cap the choice with"
                " `max_stage` or `offload`, or name the strategy by hand (e.g. `strategy='zero3_infinity'`)."
            )
    return {name: value for name, value in options.items() if name not in _CHOSEN}


class AutoChoosing:
    """Placed before a front end's ``ZeroStrategy``: the provisional ``config`` (stage 3, which takes every option)
    gives way to the chosen one in :meth:`_choose`, before the placement and the mode are made from it."""

    auto_options: AutoOptions
    auto_choice: AutoChoice | None = None  # the choice and its table, once made
    _given: dict[str, Any]  # the user's ZeRO options
    _offload_dir: Path | None = None  # where ZeRO-Infinity's files would go, as the user named it
    config: ZeroConfig
    _mode: Any
    _placement: Any
    root_device: torch.device
    world_size: int
    num_nodes: int
    num_processes: int
    is_global_zero: bool
    _process_group_backend: str | None

    def _take_options(self, options: dict[str, Any], offload_dir: str | Path | None, **auto: Any) -> dict[str, Any]:
        """Check and keep ``zero_auto``'s own options (``auto``: those of :meth:`AutoOptions.from_options`) and the
        user's ZeRO options; returns the options the provisional ``ZeroStrategy`` is made with."""
        self.auto_options = AutoOptions.from_options(**auto)
        options = without_chosen_options(options)
        self._given = {name: value for name, value in options.items() if name in ZeroConfig.option_names()}
        self._offload_dir = None if offload_dir is None else Path(offload_dir)
        return options

    def _get_process_group_backend(self) -> str:
        """On CUDA with offload allowed, a group that carries host tensors too: the choice comes after it exists."""
        if self.root_device.type == "cuda" and self.auto_options.offload is not Offload.NONE:
            return backend_with_host(self._process_group_backend)
        return super()._get_process_group_backend()  # type: ignore[misc]

    def _choose(self, module: nn.Module, precision: str, optimizer: str | None, builds_later: bool) -> None:
        """Choose once, the same on every rank (one collective), and log the table on rank 0. ``builds_later``: the
        module makes its layers in ``configure_model``, which runs on a copy on the meta device to count them."""
        if self.auto_choice is not None:
            return
        assert self._mode is None, "the mode was made before zero_auto chose its stage"
        counted, held = _counted(module, builds_later)
        num_params, trainable = _parameters(counted)
        budget = self._budget(held)
        params, budget = _agreed(num_params, trainable, budget)
        group = self.config.shard_group_size
        workload = Workload(
            num_params=params[0],
            trainable_params=params[1],
            precision=precision,
            master_weights=self.config.master_weights,
            optimizer=optimizer or self.auto_options.optimizer,
            num_ranks=self.world_size,
            num_nodes=self.num_nodes,
            shard_group_size=self.num_processes if group == "node" else group,
            working=_working(counted, self.config),
        )
        self.auto_choice = decide(workload, budget, self.auto_options)
        self.config = self._config_for(self.auto_choice.candidate)
        self._placement = None  # made again from the chosen options
        if self.is_global_zero:
            log_info(self.auto_choice.table())

    def _budget(self, held: dict[str, int]) -> Budget:
        options = self.auto_options
        disk = None
        if options.offload is Offload.DISK:
            disk = disk_room(self._infinity_dir(), self.num_processes)
        if self.root_device.type == "cuda":
            memory, source = device_room(self.root_device, held.get("cuda", 0))
            host = host_room(self.num_processes, held.get("cpu", 0))[0]
        else:
            memory, source = host_room(self.num_processes, held.get("cpu", 0))
            host = None
        if options.memory_per_rank is not None:
            memory, source = options.memory_per_rank, "`memory_per_rank`"
        return Budget(memory=memory, host=host, disk=disk, source=source)

    def _infinity_dir(self) -> Path:
        return self._offload_dir or Path(tempfile.gettempdir())

    def _config_for(self, candidate: Candidate) -> ZeroConfig:
        options = dict(self._given)
        if candidate.stage != Stage.PARAMETERS:
            options.pop("auto_wrap_policy", None)  # it shapes stage 3's units only
        return ZeroConfig.from_options(
            **options,
            stage=candidate.stage,
            offload_optimizer=candidate.offload_optimizer,
            offload_parameters=candidate.offload_parameters,
            offload_dir=self._infinity_dir() if candidate is Candidate.ZERO3_INFINITY else None,
        )


def _counted(module: nn.Module, builds_later: bool) -> tuple[nn.Module, dict[str, int]]:
    """The module to count (built whole), and the bytes of parameters this rank holds by device type. A module that
    builds in ``configure_model`` is counted on a copy whose hook runs on the meta device: its own tensors are copied
    as meta tensors and its trainer is left out, so the copy costs no memory."""
    held: dict[str, int] = {}
    for param in module.parameters():
        if not param.is_meta:
            held[param.device.type] = held.get(param.device.type, 0) + param.numel() * param.element_size()
    counted = module
    if builds_later:
        memo: dict[int, Any] = {id(t): _as_meta(t) for t in [*module.parameters(), *module.buffers()]}
        memo |= {id(getattr(module, name)): None for name in ("_trainer", "_fabric") if getattr(module, name, None)}
        counted = copy.deepcopy(module, memo)
        with torch.device("meta"):
            counted.configure_model()  # type: ignore[operator]
    return counted, held


def _parameters(module: nn.Module) -> tuple[int, int]:
    """(parameters, trainable parameters); a tied one counts once."""
    params = list(module.parameters())
    return sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)


def _working(module: nn.Module, config: ZeroConfig) -> Working:
    """What sizes a step's working buffers: stage 3's units as ``config``'s wrap policy picks them, its buckets."""
    taken: set[int] = set()
    largest = 0
    for unit in choose_units(module, config.auto_wrap_policy):  # deepest first: a parameter is its first unit's
        params = [p for p in unit.parameters() if id(p) not in taken]
        taken.update(id(p) for p in params)
        largest = max(largest, sum(p.numel() for p in params))
    root = sum(p.numel() for p in module.parameters() if id(p) not in taken)
    tensors = sum(1 for _ in module.parameters())
    return Working(largest, root, config.bucket_bytes, config.keep_for_backward_bytes, config.prefetch_units, tensors)


def _as_meta(tensor: torch.Tensor) -> torch.Tensor:
    meta = tensor.detach().to("meta")
    return nn.Parameter(meta, requires_grad=tensor.requires_grad) if isinstance(tensor, nn.Parameter) else meta


def _agreed(num_params: int, trainable: int, budget: Budget) -> tuple[tuple[int, int], Budget]:
    """Every rank's counts and budget, gathered in one collective: the tightest budget, and the counts, which must be
    the same on every rank."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return (num_params, trainable), budget
    gathered: list[Any] = [None] * dist.get_world_size()
    as_verdict(lambda: dist.all_gather_object(gathered, ((num_params, trainable), budget)))
    counts = {params for params, _ in gathered}
    if len(counts) > 1:
        raise AutoChoiceError(
            f"zero_auto counted different models on different ranks (parameters, trainable by rank:"
            f" {[params for params, _ in gathered]}). HINT: build the same model on every rank."
        )
    tightest = gathered[0][1]
    for _, other in gathered[1:]:
        tightest = tightest.tightest(other)
    return counts.pop(), tightest

"""The ``optimizer`` and ``scheduler`` sections of a DeepSpeed config as the ``torch.optim`` objects that compute what
DeepSpeed computes, for ``ZeroStrategy(deepspeed_config=...)`` under the Trainer.

Vocabulary:

- **iteration**: DeepSpeed's ``last_batch_iteration``: -1 when a schedule is built, then one more after every
  optimizer step (DeepSpeed's engine steps its scheduler after each one). A torch scheduler counts the same steps in
  ``last_epoch``, starting at 0: iteration = ``last_epoch - 1``, and Lightning steps a scheduler of
  ``interval="step"`` after each optimizer step too, so step ``k`` of training runs at the learning rate of iteration
  ``k - 1`` under both.
- The schedules set absolute learning rates (DeepSpeed's ``warmup_max_lr``, ``cycle_max_lr``), as DeepSpeed's do;
  ``WarmupCosineLR`` scales the groups' learning rates at construction (the optimizer's ``lr``).

The formulas are those of DeepSpeed's ``deepspeed/runtime/lr_schedules.py``; its ``Adam`` is AdamW unless
``adam_w_mode`` is false, with a weight decay of 0 unless given (``FusedAdam``'s defaults; ``torch_adam`` takes
torch's own defaults, as DeepSpeed passes the parameters on to torch then).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

_ADAM = ("adam", "adamw")
_ADAM_PARAMS = ("lr", "betas", "eps", "weight_decay", "bias_correction", "amsgrad", "torch_adam", "adam_w_mode")
# DeepSpeed's own optimizers with no torch equivalent: refused, with why
_NOT_IN_TORCH = {
    "lamb": "LAMB is not in `torch.optim`",
    "lion": "Lion is not in `torch.optim`",
    "muon": "DeepSpeed's Muon is its own",
    "onebitadam": "1-bit Adam compresses what ranks exchange",
    "onebitlamb": "1-bit LAMB compresses what ranks exchange",
    "zerooneadam": "0/1 Adam compresses what ranks exchange",
}
_LOG, _LINEAR = "log", "linear"


def _refuse(source: str, key: str, why: str, hint: str) -> ValueError:
    return ValueError(f"{source}: `{key}` {why}. HINT: {hint}.")


@dataclass(frozen=True)
class DeepSpeedOptimization:
    """A DeepSpeed config's ``optimizer`` section (``{"type": ..., "params": {...}}``) and ``scheduler`` section, each
    possibly absent, checked when the config is read and built by :meth:`optimizer` and :meth:`scheduler`."""

    optimizer_section: Mapping[str, Any] | None
    scheduler_section: Mapping[str, Any] | None
    source: str  # how to name the config in messages

    @classmethod
    def read(
        cls, optimizer: Mapping[str, Any] | None, scheduler: Mapping[str, Any] | None, source: str
    ) -> DeepSpeedOptimization:
        """The sections, refused now (at the strategy's construction) if they name what cannot be built here."""
        sections = cls(optimizer, scheduler, source)
        probe = [torch.zeros(1, requires_grad=True)]
        built = sections.optimizer(probe) if optimizer is not None else torch.optim.SGD(probe, lr=1e-3)
        sections.scheduler(built)
        return sections

    def optimizer(self, params: Iterable[Any]) -> Optimizer:
        """The optimizer the ``optimizer`` section names, on ``params``."""
        assert self.optimizer_section is not None
        kind, given = _type_and_params(self.optimizer_section, "optimizer", self.source)
        name = kind.lower()
        if name in _NOT_IN_TORCH:
            raise _refuse(
                self.source,
                "optimizer.type",
                f"is {kind!r}: {_NOT_IN_TORCH[name]}",
                "name a `torch.optim` optimizer (Adam, AdamW, SGD, Adagrad, ...) in the config, or build the one you"
                " want in `configure_optimizers` and drop the config's `optimizer` section",
            )
        if name in _ADAM:
            cls, given = self._adam(name, given)
        else:
            cls = getattr(torch.optim, kind, None)
            if not (isinstance(cls, type) and issubclass(cls, Optimizer)):
                raise _refuse(
                    self.source,
                    "optimizer.type",
                    f"is {kind!r}, which is neither DeepSpeed's Adam/AdamW nor a `torch.optim` optimizer",
                    "name an optimizer of `torch.optim` (Adam, AdamW, SGD, Adagrad, ...)",
                )
        try:
            return cls(params, **given)
        except (TypeError, ValueError) as error:
            raise _refuse(
                self.source, "optimizer.params", f"do not build `torch.optim.{cls.__name__}`: {error}", "fix them"
            ) from error

    def _adam(self, name: str, given: dict[str, Any]) -> tuple[type[Optimizer], dict[str, Any]]:
        unknown = sorted(set(given) - set(_ADAM_PARAMS))
        if unknown:
            raise _refuse(
                self.source,
                "optimizer.params",
                f"hold {unknown}, which DeepSpeed's Adam takes no part of",
                f"use only {list(_ADAM_PARAMS)}; clip with the config's `gradient_clipping`",
            )
        torch_adam = given.pop("torch_adam", False)
        adam_w = given.pop("adam_w_mode", True) or name == "adamw"  # DeepSpeed's "Adam" is AdamW by default
        if not given.pop("bias_correction", True):
            raise _refuse(
                self.source, "optimizer.params.bias_correction", "is false", "torch's Adam always corrects the bias"
            )
        if not torch_adam:
            given.setdefault("weight_decay", 0.0)  # FusedAdam's default; torch's AdamW would decay by 0.01
        return (torch.optim.AdamW if adam_w else torch.optim.Adam), given

    def scheduler(self, optimizer: Optimizer) -> LRScheduler | None:
        """The schedule the ``scheduler`` section names, on ``optimizer``; ``None`` without the section."""
        if self.scheduler_section is None:
            return None
        kind, given = _type_and_params(self.scheduler_section, "scheduler", self.source)
        schedule = _SCHEDULES.get(kind)
        if schedule is None:
            raise _refuse(
                self.source,
                "scheduler.type",
                f"is {kind!r}",
                f"use one of {sorted(_SCHEDULES)}, or a torch scheduler in `configure_optimizers`",
            )
        try:
            return schedule(optimizer, **given)
        except (TypeError, ValueError) as error:
            raise _refuse(self.source, "scheduler.params", f"do not build {kind}: {error}", "fix them") from error


def _type_and_params(section: object, name: str, source: str) -> tuple[str, dict[str, Any]]:
    """A section's ``type`` and ``params``; an ``"auto"`` value, for a launcher to fill in, is refused: left out, the
    default would take its place unseen."""
    kind = section.get("type") if isinstance(section, Mapping) else None
    params = section.get("params", {}) if isinstance(section, Mapping) else None
    if not isinstance(kind, str) or not isinstance(params, Mapping):
        raise _refuse(source, name, f"is {section!r}", 'write it as {"type": "...", "params": {...}}')
    auto = sorted(k for k, v in params.items() if v == "auto")
    if auto:
        raise _refuse(source, f"{name}.params", f"leave {auto} as 'auto'", "write the values in the config")
    return kind, dict(params)


# --- the schedules ---------------------------------------------------------------------------------------------------


class _DeepSpeedSchedule(LRScheduler):
    """A schedule of absolute learning rates by iteration (see the module's vocabulary); its state is numbers only,
    so it is saved and loaded with a checkpoint as torch's schedulers are."""

    def lr_at(self, iteration: int) -> list[float]:
        raise NotImplementedError

    def get_lr(self) -> list[float]:  # type: ignore[override]
        return self.lr_at(self.last_epoch - 1)


def _per_group(optimizer: Optimizer, value: float | list[float], name: str) -> list[float]:
    values = list(value) if isinstance(value, (list, tuple)) else [value] * len(optimizer.param_groups)
    if len(values) != len(optimizer.param_groups):
        raise ValueError(f"`{name}` holds {len(values)} values for {len(optimizer.param_groups)} parameter groups")
    return [float(v) for v in values]


def _warmup_fraction(iteration: int, num_steps: int, kind: str) -> float:
    """How far the warm-up is at ``iteration`` (0 to 1), ``log`` or ``linear``, DeepSpeed's ``_get_gamma``."""
    if kind == _LOG:
        return math.log(iteration + 1) / math.log(num_steps)
    return iteration / num_steps


def _check_warmup(num_steps: object, kind: str) -> int:
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps <= 0:
        raise ValueError(f"warmup_num_steps must be a positive integer, got {num_steps!r}")
    if kind not in (_LOG, _LINEAR):
        raise ValueError(f"warmup_type is {kind!r}, not 'log' or 'linear'")
    return max(2, num_steps)  # as DeepSpeed: log(1) would divide by zero


class WarmupLR(_DeepSpeedSchedule):
    """DeepSpeed's ``WarmupLR``: from ``warmup_min_lr`` to ``warmup_max_lr`` (the optimizer's ``lr`` if not given)
    over ``warmup_num_steps``, then held."""

    def __init__(
        self,
        optimizer: Optimizer,
        warmup_min_lr: float | list[float] = 0.0,
        warmup_max_lr: float | list[float] | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = _LOG,
    ) -> None:
        if warmup_max_lr is None:
            warmup_max_lr = optimizer.param_groups[0]["lr"]
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = _per_group(optimizer, warmup_max_lr, "warmup_max_lr")
        self.warmup_num_steps = _check_warmup(warmup_num_steps, warmup_type)
        self.warmup_type = warmup_type
        super().__init__(optimizer)

    def lr_at(self, iteration: int) -> list[float]:
        if iteration < 0:
            return list(self.min_lrs)
        gamma = self.gamma(iteration)
        return [low + (high - low) * gamma for low, high in zip(self.min_lrs, self.max_lrs, strict=True)]

    def gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return _warmup_fraction(iteration, self.warmup_num_steps, self.warmup_type)
        return 1.0


class WarmupDecayLR(WarmupLR):
    """DeepSpeed's ``WarmupDecayLR``: ``WarmupLR``'s warm-up, then a linear decay to 0 at ``total_num_steps``."""

    def __init__(
        self,
        optimizer: Optimizer,
        total_num_steps: int,
        warmup_min_lr: float | list[float] = 0.0,
        warmup_max_lr: float | list[float] = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = _LOG,
    ) -> None:
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type)

    def gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return _warmup_fraction(iteration, self.warmup_num_steps, self.warmup_type)
        remaining = self.total_num_steps - iteration
        return max(0.0, remaining / max(1.0, self.total_num_steps - self.warmup_num_steps))


class WarmupCosineLR(_DeepSpeedSchedule):
    """DeepSpeed's ``WarmupCosineLR``: the groups' learning rates scaled from ``warmup_min_ratio`` to 1 over
    ``warmup_num_steps``, then down a cosine to ``cos_min_ratio`` at ``total_num_steps``."""

    def __init__(
        self,
        optimizer: Optimizer,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = _LOG,
    ) -> None:
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = warmup_min_ratio
        self.warmup_num_steps = _check_warmup(warmup_num_steps, warmup_type)
        self.cos_min_ratio = cos_min_ratio
        self.warmup_type = warmup_type
        self.org_lrs = [float(group["lr"]) for group in optimizer.param_groups]
        super().__init__(optimizer)

    def lr_at(self, iteration: int) -> list[float]:
        return [lr * self.ratio(iteration) for lr in self.org_lrs]

    def ratio(self, iteration: int) -> float:
        if iteration < 0:
            return 0.0
        if iteration < self.warmup_num_steps:
            warmed = _warmup_fraction(iteration, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + warmed * (1.0 - self.warmup_min_ratio)
        progress = min(
            1.0, (iteration - self.warmup_num_steps + 1) / max(1, self.total_num_steps - self.warmup_num_steps)
        )
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)


class OneCycle(_DeepSpeedSchedule):
    """DeepSpeed's ``OneCycle``: the learning rate up from ``cycle_min_lr`` to ``cycle_max_lr`` over
    ``cycle_first_step_size`` iterations and back down over ``cycle_second_step_size``, then divided by
    ``1 + decay_lr_rate * (iterations since the cycle) / decay_step_size``; with ``cycle_momentum`` (and an optimizer
    with ``betas``), ``betas[0]`` moves the other way between ``cycle_max_mom`` and ``cycle_min_mom`` (and ``betas[1]``
    is DeepSpeed's 0.99)."""

    _BETA2 = 0.99  # DeepSpeed's OneCycle sets betas to (momentum, 0.99)

    def __init__(
        self,
        optimizer: Optimizer,
        cycle_min_lr: float,
        cycle_max_lr: float,
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: int = 2000,
        cycle_second_step_size: int | None = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: int | None = None,
        decay_step_size: int = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: float = 0.8,
        cycle_max_mom: float = 0.9,
        decay_mom_rate: float = 0.0,
    ) -> None:
        if cycle_first_stair_count or cycle_second_stair_count:
            raise ValueError("stair counts (a staircase cycle) are not built here; leave them at 0")
        self.first = float(cycle_first_step_size)
        self.total = self.first + float(cycle_second_step_size if cycle_second_step_size is not None else self.first)
        self.min_lr, self.max_lr, self.decay_lr_rate = float(cycle_min_lr), float(cycle_max_lr), float(decay_lr_rate)
        self.decay_step_size = decay_step_size
        self.cycle_momentum = cycle_momentum and "betas" in optimizer.defaults  # as DeepSpeed: SGD's is left alone
        self.min_mom, self.max_mom, self.decay_mom_rate = float(cycle_min_mom), float(cycle_max_mom), decay_mom_rate
        super().__init__(optimizer)

    def _scale(self, iteration: int) -> float:
        batch = iteration + 1
        x = 1.0 + batch / self.total - math.floor(1 + batch / self.total)
        ratio = self.first / self.total
        return x / ratio if x <= ratio else (x - 1) / (ratio - 1)

    def _decay_factor(self, iteration: int, rate: float) -> float:
        """``1 + rate * (decay intervals since the cycle)``, or 1 where DeepSpeed skips the decay."""
        if math.isclose(self.decay_step_size, 0) or math.isclose(rate, 0):
            return 1.0
        return 1 + rate * (iteration - self.total + 1) / self.decay_step_size

    def lr_at(self, iteration: int) -> list[float]:
        if iteration < 0:
            lr = self.min_lr
        elif iteration < self.total:
            lr = self.min_lr + (self.max_lr - self.min_lr) * self._scale(iteration)
        else:
            lr = self.min_lr / self._decay_factor(iteration, self.decay_lr_rate)
        return [lr] * len(self.optimizer.param_groups)

    def momentum_at(self, iteration: int) -> float:
        if iteration < 0:
            return self.min_mom
        if iteration < self.total:
            return self.max_mom - (self.max_mom - self.min_mom) * self._scale(iteration)
        return self.max_mom * self._decay_factor(iteration, self.decay_mom_rate)

    def step(self, epoch: int | None = None) -> None:  # type: ignore[override]
        super().step(epoch)
        if self.cycle_momentum:
            for group in self.optimizer.param_groups:
                group["betas"] = (self.momentum_at(self.last_epoch - 1), self._BETA2)


_SCHEDULES: dict[str, type[_DeepSpeedSchedule]] = {
    "WarmupLR": WarmupLR,
    "WarmupDecayLR": WarmupDecayLR,
    "WarmupCosineLR": WarmupCosineLR,
    "OneCycle": OneCycle,
}

"""Which submodules get something of their own: a unit in stage 3, activation checkpointing in any stage.

Vocabulary:

- **unit**: a submodule that ``fully_shard`` makes a group of its own. Its parameters are all-gathered right before
  its forward, freed right after it, gathered again for its backward and then freed, their gradients
  reduce-scattered in one collective. The LightningModule itself is the **root unit**: it holds every parameter that
  no unit below it holds, gathered for the whole step.
- **policy**: the rule that picks submodules, from the user's option: the default (:class:`RepeatedEntries`), module
  classes (:class:`ModuleClasses`), a parameter count (:class:`MinParams`) or a callable (:class:`Predicate`).

Whatever the policy, some modules can never be units: the root itself, containers that are never called
(``ModuleList``, ``ModuleDict``), modules without a parameter to shard, and modules that share a parameter with a
module outside them (tied weights): a tie must stay inside one unit, so such a module stays with its parent.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_zero._stage3.seam import CheckpointWrapper, gather_for_recompute

ModuleFilter = Callable[[nn.Module, str], bool]
"""A user policy: ``(module, qualified name) -> bool``, asked for every submodule."""

_NEVER_CALLED = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)
_REPEATING = (nn.ModuleList, nn.Sequential)


class ModulePolicy:
    """Picks submodules of a root module; ``pick`` returns them as ``(qualified name, module)`` in pre-order."""

    def pick(self, root: nn.Module) -> list[tuple[str, nn.Module]]:
        raise NotImplementedError


@dataclass(frozen=True)
class RepeatedEntries(ModulePolicy):
    """The default: entries of an ``nn.ModuleList`` or ``nn.Sequential`` whose class occurs at least twice in it
    (transformer blocks, residual stages). The search does not descend into a picked entry."""

    def pick(self, root: nn.Module) -> list[tuple[str, nn.Module]]:
        picked: list[tuple[str, nn.Module]] = []

        def visit(prefix: str, module: nn.Module) -> None:
            counts: dict[type, int] = {}
            if isinstance(module, _REPEATING):
                for child in module.children():
                    counts[type(child)] = counts.get(type(child), 0) + 1
            for name, child in module.named_children():
                qualified = f"{prefix}{name}"
                if counts.get(type(child), 0) >= 2 and _has_shardable_params(child):
                    picked.append((qualified, child))
                else:
                    visit(f"{qualified}.", child)

        visit("", root)
        return picked


@dataclass(frozen=True)
class ModuleClasses(ModulePolicy):
    """Every submodule that is an instance of one of ``classes``."""

    classes: tuple[type[nn.Module], ...]

    def pick(self, root: nn.Module) -> list[tuple[str, nn.Module]]:
        return [(n, m) for n, m in root.named_modules() if n and isinstance(m, self.classes)]


@dataclass(frozen=True)
class MinParams(ModulePolicy):
    """Like an auto-wrap threshold: bottom-up, a submodule is picked when the parameters it holds outside the
    submodules already picked below it number at least ``min_num_params``."""

    min_num_params: int

    def pick(self, root: nn.Module) -> list[tuple[str, nn.Module]]:
        tied = _tied_params(root)
        remaining: dict[int, int] = {}  # id(module) -> parameter count not yet in a picked submodule
        picked: list[tuple[str, nn.Module]] = []
        for name, module in reversed(list(root.named_modules())):  # descendants before their ancestors
            count = sum(p.numel() for p in module.parameters(recurse=False))
            count += sum(remaining.get(id(child), 0) for child in module.children())
            if name and count >= self.min_num_params and _can_be_unit(name, module, tied):
                picked.append((name, module))
                count = 0
            remaining[id(module)] = count
        return picked[::-1]


@dataclass(frozen=True)
class Predicate(ModulePolicy):
    """Every submodule for which the user's ``fn(module, qualified_name)`` is true."""

    fn: ModuleFilter

    def pick(self, root: nn.Module) -> list[tuple[str, nn.Module]]:
        return [(n, m) for n, m in root.named_modules() if n and self.fn(m, n)]


def resolve_policy(option: str, value: object) -> ModulePolicy:
    """Turn the value of ``option`` (``auto_wrap_policy`` or ``activation_checkpointing``) into a policy."""
    hint = (
        f"HINT: pass `{option}` as a set of module classes (or their import paths, like 'my_pkg.model.Block'), an"
        " int parameter count, or a callable `(module, name) -> bool`."
    )
    match value:
        case None:
            return RepeatedEntries()
        case bool():
            raise ValueError(f"`{option}={value!r}` is not a policy. {hint}")
        case int() if value > 0:
            return MinParams(value)
        case int():
            raise ValueError(f"`{option}={value!r}` must be a positive parameter count. {hint}")
        case type() | str():
            return ModuleClasses((_module_class(option, value, hint),))
        case set() | frozenset() | list() | tuple() if value:
            return ModuleClasses(tuple(_module_class(option, v, hint) for v in value))
        case _ if callable(value):
            return Predicate(value)
    raise ValueError(f"`{option}={value!r}` is not a policy. {hint}")


def _module_class(option: str, value: object, hint: str) -> type[nn.Module]:
    if isinstance(value, str):
        module_name, _, class_name = value.rpartition(".")
        try:
            value = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError, ValueError) as error:
            raise ValueError(f"`{option}` names {value!r}, which cannot be imported ({error}). {hint}") from error
    if not (isinstance(value, type) and issubclass(value, nn.Module)):
        raise ValueError(f"`{option}` holds {value!r}, which is not a subclass of `torch.nn.Module`. {hint}")
    return value


# --- choosing ---------------------------------------------------------------------------------------------------


def choose_units(root: nn.Module, policy: ModulePolicy) -> list[nn.Module]:
    """The submodules ``policy`` makes units, deepest first (the order ``fully_shard`` needs)."""
    tied = _tied_params(root)
    picked = [(n, m) for n, m in policy.pick(root) if _can_be_unit(n, m, tied)]
    return [m for _, m in reversed(_unique(picked))]


def _can_be_unit(name: str, module: nn.Module, tied: dict[int, list[str]]) -> bool:
    if isinstance(module, _NEVER_CALLED) or not _has_shardable_params(module):
        return False
    inside = (name, f"{name}.")
    return all(h == name or h.startswith(inside[1]) for p in module.parameters() for h in tied.get(id(p), ()))


def _has_shardable_params(module: nn.Module) -> bool:
    return any(p.dim() > 0 for p in module.parameters())


def _tied_params(root: nn.Module) -> dict[int, list[str]]:
    """``id(param) -> names of the modules holding it`` for every parameter held in more than one place."""
    holders: dict[int, list[str]] = {}
    for name, module in root.named_modules(remove_duplicate=False):
        for param in module._parameters.values():
            if param is not None:
                holders.setdefault(id(param), []).append(name)
    return {k: v for k, v in holders.items() if len(v) > 1}


def _unique(picked: Iterable[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    seen: set[int] = set()
    return [(n, m) for n, m in picked if not (id(m) in seen or seen.add(id(m)))]


# --- activation checkpointing ---------------------------------------------------------------------------------


class CheckpointedForward:
    """A module's own ``forward``, run under non-reentrant activation checkpointing while gradients are enabled.

    Installed as the module's instance attribute ``forward``, so the module keeps its class, its hooks, its
    parameter names and its ``state_dict`` keys. Non-reentrant checkpointing recomputes the forward inside the
    same backward pass, so every parameter still receives its gradient exactly once per backward.
    """

    def __init__(self, module: nn.Module, forward: Callable[..., Any]) -> None:
        self.module = module
        self.forward = forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.forward(*args, **kwargs)
        return checkpoint(self._gathered_forward, *args, use_reentrant=False, **kwargs)

    def _gathered_forward(self, *args: Any, **kwargs: Any) -> Any:
        """The forward, with the stage-3 units inside the module gathered when backward recomputes it."""
        gather_for_recompute(self.module)
        return self.forward(*args, **kwargs)


def apply_activation_checkpointing(root: nn.Module, policy: ModulePolicy) -> list[str]:
    """Checkpoint the outermost modules ``policy`` picks (a picked module inside another is covered by it);
    return their names. Calling it again on the same module changes nothing. A module that checkpoints layers itself
    (torch's ``CheckpointWrapper``) is left as it is, with a warning, as ``FSDPStrategy`` leaves it: checkpointing
    inside checkpointing would recompute those layers twice."""
    wrapped = [name for name, module in root.named_modules() if isinstance(module, CheckpointWrapper)]
    if wrapped:
        rank_zero_warn(
            f"`activation_checkpointing` is set, but the model checkpoints layers itself (torch's `CheckpointWrapper`"
            f" at {', '.join(f'`{n}`' for n in wrapped[:3])}{', ...' if len(wrapped) > 3 else ''}): the option is"
            " ignored. HINT: drop `activation_checkpointing`, or the model's own wrappers."
        )
        return []
    names: list[str] = []
    for name, module in _unique(policy.pick(root)):
        if isinstance(module, _NEVER_CALLED) or any(name.startswith(f"{outer}.") for outer in names):
            continue
        names.append(name)
        if not isinstance(module.__dict__.get("forward"), CheckpointedForward):
            module.forward = CheckpointedForward(module, module.forward)
    return names

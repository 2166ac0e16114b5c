"""The one road between a front end's live objects and the checkpoint layer, for both front ends and every mode.

The modules of a checkpoint, each with the mode that trains it, are one module to the checkpoint layer: a module alone
is named as itself (its parameter names, as the Trainer's checkpoints name them); several, as the children of one
``nn.ModuleDict`` under their names in Fabric's ``state`` (``{"g": generator, "d": discriminator}`` gives ``g.<fqn>``
and ``d.<fqn>``), so that each optimizer's state is named after the parameters it updates, wherever they live.

Every road runs outside the caller's ``torch.inference_mode()`` (Lightning's own tests load a checkpoint for
``trainer.test`` inside one): bringing stage 3's module to rest swaps its parameters' storage, and a load writes into
live tensors and creates the optimizer's state, none of which inference mode allows or should leave behind.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.optimizer import _optimizer_to_device
from torch import nn
from torch.optim import Optimizer

from lightning_zero._checkpoint.directory import Opened
from lightning_zero._checkpoint.live import (
    load_directory,
    load_full_optimizer_state,
    named_optimizer_state,
    save_directory,
)
from lightning_zero._core.mode import Mode
from lightning_zero._core.optimizers import as_set_up


@contextmanager
def outside_inference_mode() -> Iterator[None]:
    """Run as if the caller were in ``torch.no_grad()``, also when it is in ``torch.inference_mode()``: tensors
    written or made here stay ordinary tensors that training can use after."""
    with torch.inference_mode(False), torch.no_grad():
        yield


@dataclass(frozen=True)
class Trained:
    """A module as a front end set it up, and the mode that trains it."""

    module: nn.Module
    mode: Mode


class Checkpointed:
    """The modules of one checkpoint (by their names in it) and, for each optimizer, the mode that set it up."""

    def __init__(self, modules: Mapping[str, Trained], mode_of: Callable[[Optimizer], Mode]) -> None:
        self.modules = dict(modules)
        self._mode_of = mode_of
        if len(self.modules) == 1:
            self.named_like = next(iter(self.modules.values())).module  # what entries are named after
        else:
            self.named_like = nn.ModuleDict({key: trained.module for key, trained in self.modules.items()})

    @classmethod
    def one(cls, module: nn.Module, mode: Mode) -> Checkpointed:
        """A module alone, the Trainer's case."""
        return cls({"": Trained(module, mode)}, lambda _: mode)

    @outside_inference_mode()
    def module_states(self) -> dict[str, dict[str, Any]]:
        """Each module's entries (see :meth:`Mode.model_entries`) under its name."""
        return {key: trained.mode.model_entries(trained.module) for key, trained in self.modules.items()}

    def combined(self, states: Mapping[str, dict[str, Any]]) -> dict[str, Any]:
        """The modules' ``states`` as the state dict of :attr:`named_like`."""
        if len(self.modules) == 1:
            return dict(next(iter(states.values()), {}))
        return {f"{key}.{name}": value for key, state in states.items() for name, value in state.items()}

    def module_state(self) -> dict[str, Any]:
        """The state dict of :attr:`named_like` for a checkpoint."""
        return self.combined(self.module_states())

    @outside_inference_mode()
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """An optimizer's state dict for a checkpoint, parameters named, shards left as DTensors."""
        self._mode_of(optimizer).at_rest()
        return named_optimizer_state(as_set_up(optimizer), self.named_like)

    @outside_inference_mode()
    def save_directory(self, checkpoint: dict[str, Any], path: Path) -> None:
        """Write Lightning's ``checkpoint``, made of :meth:`module_state` and :meth:`optimizer_state`, as a directory
        at ``path``, every rank its own shards."""
        save_directory(checkpoint, self.named_like, path)

    def after_save(self) -> None:
        """After a checkpoint (a directory or a file) was written."""
        for trained in self.modules.values():
            trained.mode.after_save()

    @outside_inference_mode()
    def load_directory(
        self, opened: Opened, optimizers_for: Callable[[dict[str, Any]], list[Optimizer]], strict: bool = True
    ) -> dict[str, Any]:
        """Load the checkpoint directory ``opened`` into the live modules and the optimizers ``optimizers_for`` names,
        given what the checkpoint holds beyond the states (none when not fitting); return that. ``strict``: as in
        ``load_state_dict``."""

        def entries_for(saved: dict[str, Any]) -> list[Any]:
            return [self._mode_of(o).optimizer_entries(o) for o in optimizers_for(saved)]

        rest = load_directory(opened, self.named_like, self.module_state(), entries_for, strict)
        for trained in self.modules.values():
            trained.mode.after_load()
        return rest

    @outside_inference_mode()
    def load_module_state(self, state_dict: dict[str, Any], strict: bool) -> None:
        """Load a state dict of whole tensors (an ordinary single-file checkpoint, or what the user hands over) into
        the modules at rest: each rank keeps what it holds of each (stage 3: its rows, by a hook of the sharded module;
        stages 1 and 2 load the masters too, by a hook of the engine), ``strict`` as in ``load_state_dict``."""
        for trained in self.modules.values():
            trained.mode.at_rest()
        self.named_like.load_state_dict(state_dict, strict=strict)

    @outside_inference_mode()
    def load_optimizer_state(
        self, optimizer: Optimizer, state_dict: dict[str, Any], recorded: dict[int, list[str]] | None = None
    ) -> None:
        """Load an optimizer state dict of whole tensors (an ordinary single-file checkpoint, with the file's record
        for it, see :func:`.live.load_full_optimizer_state`); this rank keeps its shards of it, on the device unless
        they are offloaded."""
        mode = self._mode_of(optimizer)
        load_full_optimizer_state(mode.optimizer_entries(optimizer), state_dict, recorded)
        if mode.placement.state_on_device:  # offloaded state stays where the loader put it
            _optimizer_to_device(as_set_up(optimizer), mode.device)

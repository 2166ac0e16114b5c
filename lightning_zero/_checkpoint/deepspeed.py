"""A DeepSpeed ZeRO checkpoint read as an ordinary Lightning checkpoint of whole tensors, without DeepSpeed.

The result is what :func:`~lightning_zero.consolidate_checkpoint` writes for this package's own directories: the
module's state dict (every parameter's fp32 master weight, as DeepSpeed restores it), the optimizer's state dict
with whole-tensor moments, and Lightning's own entries where the checkpoint holds them. It then loads through the
single-file path at any world size and under any stage; each rank holds the whole model while it loads.

Vocabulary (the files are found and loaded by :mod:`.deepspeed_files`; "W" is the world size that saved):

- *flat group*: the trainable parameters of one optimizer param group (stages 1, 2) or of one sub-group of one
  (stage 3, cut by ``sub_group_size``), in the order the model-state file's ``param_shapes`` lists them. That order is
  the truth: the per-parameter slice mappings of the optimizer files are wrong under ``round_robin_gradients``.
- *partition* (stages 1, 2): a flat group laid end to end, zero-padded to a multiple of 2·W and cut into W equal
  pieces, rank r holding piece r. Each optimizer file records how many padding zeros end its piece.
- *piece* (stage 3): each parameter of numel n zero-padded to W·c (c = ceil(n/W)); rank r holds elements
  [r·c, (r+1)·c), and a rank's flat group is its pieces of the group's parameters, one after another.
- *per-element state*: optimizer state as long as the flat group (``exp_avg``, ``exp_avg_sq``), cut like the master
  weights; *shared state*: a 0-dim tensor (``step``), the same for every parameter of the group.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_zero._checkpoint import keys
from lightning_zero._checkpoint.deepspeed_files import DeepSpeedFiles, load_files, tag_directory
from lightning_zero._checkpoint.error import CheckpointError
from lightning_zero._checkpoint.unpickling import Unpickling

# What the model-state file holds beside the client state (Lightning's checkpoint, less its states).
_ENGINE_KEYS = frozenset(
    {
        "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "frozen_param_fragments",
        "shared_params", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names", "skipped_steps",
        "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config", "ds_version",
        "checkpoint_parallel_dimensions",
    }
)  # fmt: skip
_REMAP_HINT = "HINT: resume with the module and `configure_optimizers` that DeepSpeed trained."


def _unmapped(where: Path, why: str, kind: str = "") -> CheckpointError:
    """The error of an optimizer state that cannot be mapped to parameters, and why (``kind``: ``"file "`` where
    ``where`` is one file of the checkpoint)."""
    return CheckpointError(
        f"DeepSpeed checkpoint {kind}{where}: {why}; its optimizer state cannot be mapped. {_REMAP_HINT}"
    )


@dataclass
class DeepSpeedCheckpoint:
    """A DeepSpeed checkpoint as whole tensors, its optimizer state named by parameter."""

    path: Path
    state_dict: dict[str, torch.Tensor]  # parameters (fp32 masters; frozen ones as saved), buffers, tied aliases
    optimizer: dict[str, Any]  # {"state": {name: {entry: tensor}}, "param_groups": [{..., "params": [name]}]}
    frozen: list[str]  # parameters the optimizer did not own
    rest: dict[str, Any]  # the client state: Lightning's epoch, global_step, loops, callbacks, lr_schedulers, ...

    def lightning_checkpoint(self, weights_only: bool = False) -> dict[str, Any]:
        """An ordinary Lightning checkpoint, parameters numbered in the order DeepSpeed's param groups list them."""
        checkpoint = {**self.rest, "state_dict": self.state_dict}
        if weights_only:
            checkpoint.pop("lr_schedulers", None)
        else:
            checkpoint["optimizer_states"] = [keys.indexed_optimizer_state(self.optimizer)[0]]
        return checkpoint

    def checkpoint_for(self, module: nn.Module, optimizers: list[Any], strict: bool = True) -> dict[str, Any]:
        """An ordinary Lightning checkpoint for ``module`` and its live ``optimizers`` (none when not fitting):
        parameters numbered as those optimizers list them, after checking that names and shapes agree."""
        self.check_module(module, strict)
        checkpoint = {**self.rest, "state_dict": self.state_dict}
        if optimizers:
            if len(optimizers) != 1:
                raise CheckpointError(
                    f"DeepSpeed checkpoint {self.path} holds the state of one optimizer; {len(optimizers)} are"
                    f" configured. {_REMAP_HINT}"
                )
            checkpoint["optimizer_states"] = [self.optimizer_state_for(optimizers[0], keys.module_names(module))]
        return checkpoint

    def check_module(self, module: nn.Module, strict: bool) -> None:
        """Every tensor of the checkpoint has the shape of the module's tensor of its name; with ``strict``, the
        names are the same too."""
        expected = module.state_dict()
        differ = [
            f"`{n}` {tuple(v.shape)} here, {tuple(expected[n].shape)} in the module"
            for n, v in self.state_dict.items()
            if n in expected and tuple(v.shape) != tuple(expected[n].shape)
        ]
        if strict:
            differ += [f"`{n}` only in the checkpoint" for n in self.state_dict if n not in expected]
            differ += [f"`{n}` only in the module" for n in expected if n not in self.state_dict]
        if differ:
            raise CheckpointError(
                f"DeepSpeed checkpoint {self.path} does not fit the module: {'; '.join(differ)}. {_REMAP_HINT}"
            )

    def optimizer_state_for(self, optimizer: Any, names: dict[int, str]) -> dict[str, Any]:
        """The optimizer state numbered as ``optimizer`` lists its parameters (named by ``names``, by ``id``)."""
        saved = self.optimizer["param_groups"]
        configured = [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]
        if len(saved) != len(configured):
            raise CheckpointError(
                f"DeepSpeed checkpoint {self.path} holds {len(saved)} optimizer param groups; {len(configured)} are"
                f" configured. {_REMAP_HINT}"
            )
        frozen = set(self.frozen)
        groups = []
        for index, (group, live) in enumerate(zip(saved, configured, strict=True)):
            trained = [n for n in live if n not in frozen]  # DeepSpeed leaves frozen parameters out of its groups
            if sorted(trained) != sorted(group["params"]):
                only_saved = sorted(set(group["params"]) - set(trained))
                only_live = sorted(set(trained) - set(group["params"]))
                raise CheckpointError(
                    f"DeepSpeed checkpoint {self.path}: optimizer param group {index} holds other parameters than the"
                    f" configured one (only in the checkpoint: {only_saved}; only configured: {only_live})."
                    f" {_REMAP_HINT}"
                )
            groups.append({**group, "params": live})
        return keys.indexed_optimizer_state({"state": self.optimizer["state"], "param_groups": groups})[0]


def read_deepspeed_checkpoint(path: Path, unpickling: Unpickling) -> DeepSpeedCheckpoint:
    """Read the DeepSpeed checkpoint at ``path``: a save directory with ``latest``, a tag directory, or a ``.ckpt``
    directory written by Lightning's ``DeepSpeedStrategy``."""
    files = load_files(tag_directory(path), unpickling)
    first = files.first
    shapes: list[dict[str, torch.Size]] = list(first["param_shapes"])
    first_optim = files.optim_states[0]["optimizer_state_dict"]
    if "fp32_flat_groups" in first_optim:
        masters, state, hyper, group_of = _stage3(files, shapes)
    elif "single_partition_of_fp32_groups" in first_optim:
        masters, state, hyper, group_of = _partitioned(files, shapes)
    else:
        raise CheckpointError(
            f"DeepSpeed checkpoint file {files.optim_paths[0]} holds neither ZeRO stage 3's `fp32_flat_groups` nor the"
            " partitions of stages 1 and 2: its optimizer state cannot be mapped to parameters. HINT: only"
            " checkpoints of DeepSpeed's ZeRO optimizers load here; turn others into one file with DeepSpeed."
        )
    state_dict = _module_state(files, masters)
    groups = [{**h, "params": [n for n in masters if group_of[n] == g]} for g, h in enumerate(hyper)]
    frozen = list(_frozen_shapes(files))
    rest = {k: v for k, v in first.items() if k not in _ENGINE_KEYS}
    if "lr_schedulers" not in rest:  # DeepSpeed's own engine keeps the one scheduler it was given, if any
        rest["lr_schedulers"] = [] if first.get("lr_scheduler") is None else [first["lr_scheduler"]]
    # a checkpoint of DeepSpeed's own engine: Lightning reads it as one of its own version, with no loop state (the
    # installed version, from the package's metadata: `import lightning` imports both front ends)
    rest.setdefault("pytorch-lightning_version", version("lightning"))
    return DeepSpeedCheckpoint(path, state_dict, {"state": state, "param_groups": groups}, frozen, rest)


# --- stages 1 and 2 --------------------------------------------------------------------------------------------------


def _partitioned(files: DeepSpeedFiles, shapes: list[dict[str, torch.Size]]) -> tuple[dict, dict, list, dict]:
    """Masters, named state, param-group hyperparameters and each parameter's group, from W partitions per group."""
    optims = [o["optimizer_state_dict"] for o in files.optim_states]
    base = [o["base_optimizer_state"] for o in optims]
    num_groups = len(base[0]["param_groups"])
    if len(shapes) != num_groups:
        raise _unmapped(
            files.tag_dir,
            f"the model-state file lists {len(shapes)} groups of parameters,"
            f" the optimizer files {num_groups} param groups",
        )
    masters: dict[str, torch.Tensor] = {}
    state: dict[str, dict[str, Any]] = {}
    group_of: dict[str, int] = {}
    # ZeRO's optimizer keeps each rank's master without its padding zeros; BF16_Optimizer (no `zero_stage`) with them
    padded_masters = "zero_stage" not in optims[0]
    for g, names in enumerate(shapes):
        masters_of = [o["single_partition_of_fp32_groups"][g] for o in optims]
        size = len(masters_of[0]) + (0 if padded_masters else optims[0]["group_paddings"][g])  # of each partition
        lengths = [size - o["group_paddings"][g] for o in optims]  # every rank's partition, less its padding
        gaps = optims[0]["param_alignment_paddings"][g] if "param_alignment_paddings" in optims[0] else [0] * len(names)
        flat_master = torch.cat([m[:n] for m, n in zip(masters_of, lengths, strict=True)])
        per_element, shared = _split_state([b["state"][g] for b in base], size, files.optim_paths)
        flat_state = {k: torch.cat([v[:n] for v, n in zip(vs, lengths, strict=True)]) for k, vs in per_element.items()}
        offset = 0
        for (name, shape), gap in zip(names.items(), gaps, strict=True):
            numel = math.prod(shape)
            masters[name] = flat_master[offset : offset + numel].view(shape).clone()
            state[name] = {k: v[offset : offset + numel].view(shape).clone() for k, v in flat_state.items()}
            state[name].update({k: v.clone() for k, v in shared.items()})
            group_of[name] = g
            offset += numel + gap
        if offset != flat_master.numel():
            raise _unmapped(
                files.tag_dir, f"param group {g} lists {offset} elements but its partitions hold {flat_master.numel()}"
            )
    return masters, state, _hyperparameters(base[0]["param_groups"]), group_of


# --- stage 3 ---------------------------------------------------------------------------------------------------------


def _stage3(files: DeepSpeedFiles, shapes: list[dict[str, torch.Size]]) -> tuple[dict, dict, list, dict]:
    """Masters, named state, param-group hyperparameters and each parameter's group, from W pieces per parameter."""
    world = files.world_size
    optims = [o["optimizer_state_dict"] for o in files.optim_states]
    torch_states = [o["optimizer_state_dict"] for o in optims]
    flat_groups = [o["fp32_flat_groups"] for o in optims]
    param_groups = torch_states[0]["param_groups"]
    group_of_sub = {s: g for g, group in enumerate(param_groups) for s in group["params"]}
    if len(shapes) != len(flat_groups[0]) or sorted(group_of_sub) != list(range(len(shapes))):
        raise _unmapped(
            files.tag_dir,
            f"the model-state file lists {len(shapes)} sub-groups of parameters,"
            f" the optimizer files {len(flat_groups[0])}",
        )
    masters: dict[str, torch.Tensor] = {}
    state: dict[str, dict[str, Any]] = {}
    group_of: dict[str, int] = {}
    for s, names in enumerate(shapes):
        pieces = [math.ceil(math.prod(shape) / world) for shape in names.values()]
        length = sum(pieces)
        for rank, groups in enumerate(flat_groups):
            if groups[s].numel() != length:
                raise _unmapped(
                    files.optim_paths[rank],
                    f"sub-group {s} holds {groups[s].numel()} elements, its parameters' pieces {length}",
                    "file ",
                )
        per_element, shared = _split_state([t["state"][s] for t in torch_states], length, files.optim_paths)
        offset = 0
        for (name, shape), piece in zip(names.items(), pieces, strict=True):

            def whole(flats: Iterable[torch.Tensor], at: int = offset, piece: int = piece, shape: Any = shape) -> Any:
                return torch.cat([f[at : at + piece] for f in flats])[: math.prod(shape)].view(shape).clone()

            masters[name] = whole(g[s] for g in flat_groups)
            state[name] = {k: whole(v) for k, v in per_element.items()}
            state[name].update({k: v.clone() for k, v in shared.items()})
            group_of[name] = group_of_sub[s]
            offset += piece
    return masters, state, _hyperparameters(param_groups), group_of


# --- both --------------------------------------------------------------------------------------------------------


def _split_state(
    rank_states: list[dict[str, Any]], length: int, files: list[Path]
) -> tuple[dict[str, list[torch.Tensor]], dict[str, torch.Tensor]]:
    """One flat group's optimizer state, each rank's: per-element entries (``length`` long, a list over ranks) and
    shared ones (0-dim, equal on every rank)."""
    per_element: dict[str, list[torch.Tensor]] = {}
    shared: dict[str, torch.Tensor] = {}
    for key, value in rank_states[0].items():
        values = [s.get(key) for s in rank_states]
        whole = [isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == length for v in values]
        same = [isinstance(v, torch.Tensor) and v.dim() == 0 and torch.equal(v, value) for v in values]
        if all(whole):
            per_element[key] = values
        elif all(same):
            shared[key] = value
        else:
            fits = whole if whole[0] else same  # the file that breaks the form rank 0's entry has
            rank = fits.index(False) if False in fits else 0
            raise CheckpointError(
                f"DeepSpeed checkpoint file {files[rank]}: optimizer state `{key}` is neither one value per element of"
                f" the flat group ({length}) nor one value every rank shares; it cannot be mapped to parameters."
                " HINT: resume with an optimizer whose state is per element (Adam, AdamW, SGD with momentum)."
            )
    return per_element, shared


def _hyperparameters(param_groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in group.items() if k != "params"} for group in param_groups]


def _frozen_shapes(files: DeepSpeedFiles) -> dict[str, torch.Size]:
    """The parameters the optimizer did not own: recorded from stage 2 on; at stage 1 every parameter of ``module``
    that is no buffer, no tied alias and not trained."""
    first = files.first
    if first.get("frozen_param_shapes") is not None:
        return dict(first["frozen_param_shapes"])
    trained = {n for group in first["param_shapes"] for n in group}
    skip = trained | set(first["buffer_names"]) | set(first.get("shared_params") or {})
    return {n: v.shape for n, v in first["module"].items() if n not in skip}


def _frozen(files: DeepSpeedFiles, name: str, shape: torch.Size) -> torch.Tensor:
    fragments = [m.get("frozen_param_fragments") or {} for m in files.model_states]
    if name not in fragments[0]:  # stage 1 keeps them in the module only
        return files.first["module"][name].clone()
    if len(fragments) == 1:  # stage 2: the whole tensor
        return fragments[0][name].view(shape).clone()
    return torch.cat([f[name].flatten() for f in fragments])[: math.prod(shape)].view(shape).clone()


def _module_state(files: DeepSpeedFiles, masters: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The module's state dict, in the order the module lists it: trained parameters as their fp32 masters, frozen
    ones as saved, persistent buffers, and every tied alias as its source."""
    first = files.first
    frozen = {n: _frozen(files, n, shape) for n, shape in _frozen_shapes(files).items()}
    buffers = {n: first["module"][n].clone() for n in first["buffer_names"]}
    found = {**masters, **frozen, **buffers}
    for alias, source in (first.get("shared_params") or {}).items():
        found[alias] = found[source]
    missing = [n for n in first["module"] if n not in found]
    if missing:
        raise CheckpointError(
            f"DeepSpeed checkpoint {files.tag_dir}: the module's {missing} are neither trained, frozen, buffers nor"
            f" tied to a parameter in its model-state file; they cannot be restored. {_REMAP_HINT}"
        )
    return {n: found[n] for n in first["module"]} | {n: v for n, v in found.items() if n not in first["module"]}

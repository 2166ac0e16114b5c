"""Finding and loading the files of a DeepSpeed ZeRO checkpoint, without DeepSpeed; :mod:`.deepspeed` rebuilds whole
tensors from them.

Vocabulary (DeepSpeed 0.19.8's layout):

- *save directory*: what ``engine.save_checkpoint(DIR)`` was given; it holds ``latest`` (the tag, as text) and one
  directory per tag. Lightning's ``DeepSpeedStrategy`` makes the ``.ckpt`` path itself the save directory, with the
  tag ``checkpoint``.
- *tag directory*: one checkpoint: ``mp_rank_00_model_states.pt`` (stages 1, 2) or
  ``zero_pp_rank_<r>_mp_rank_00_model_states.pt`` per rank (stage 3), and ``[bf16_]zero_pp_rank_<r>_mp_rank_00_
  optim_states.pt`` per data-parallel rank ``r``.
- ``mp_rank_<t>``: the tensor-parallel rank; only ``00`` exists without model parallelism, the only kind read here.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_zero._checkpoint.error import DAMAGE_HINT, CheckpointError, StateNotSaved
from lightning_zero._checkpoint.unpickling import DEEPSPEED_STAND_INS, Unpickling, load_torch_file

LATEST = "latest"
_MODEL_FILE = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")
_OPTIM_FILE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_PARALLEL_HINT = (
    "HINT: only data-parallel ZeRO checkpoints load here; turn it into one file with DeepSpeed's `zero_to_fp32.py`"
    " per model-parallel rank and merge those with the tool that split the model."
)


@dataclass(frozen=True)
class DeepSpeedFiles:
    """The loaded files of one tag directory."""

    tag_dir: Path
    model_states: list[dict[str, Any]]  # one (stages 1, 2) or one per rank (stage 3)
    optim_states: list[dict[str, Any]]  # one per data-parallel rank, in rank order
    optim_paths: list[Path]

    @property
    def first(self) -> dict[str, Any]:
        """Rank 0's model-state file: the module's buffers, parameter names and shapes, Lightning's state."""
        return self.model_states[0]

    @property
    def world_size(self) -> int:
        return len(self.optim_states)


def is_deepspeed_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a DeepSpeed save directory (with ``latest``) or one of its tag directories."""
    path = Path(path)
    return path.is_dir() and ((path / LATEST).is_file() or any(_MODEL_FILE.match(c.name) for c in path.iterdir()))


def tag_directory(path: Path) -> Path:
    """The tag directory of the DeepSpeed checkpoint at ``path``: the one ``latest`` names, or ``path`` itself."""
    latest = path / LATEST
    if not latest.is_file():
        return path
    tag = latest.read_text().strip()
    if not (path / tag).is_dir():
        raise CheckpointError(
            f"DeepSpeed checkpoint {path}: `{latest}` names the tag {tag!r}, but {path / tag} is no directory."
            f" {DAMAGE_HINT}"
        )
    return path / tag


def load_files(tag_dir: Path, unpickling: Unpickling) -> DeepSpeedFiles:
    """Load every file of ``tag_dir`` after checking that it is a data-parallel ZeRO checkpoint with every rank's
    files present."""
    model_files, optim_files = _rank_files(tag_dir)
    first = _load(model_files[0], unpickling)
    world_size = _world_size(first, model_files[0])
    _check_ranks(tag_dir, optim_files, world_size, "optimizer")
    if len(model_files) > 1 or _MODEL_FILE.match(model_files[0].name).group(1) is not None:  # type: ignore[union-attr]
        _check_ranks(tag_dir, model_files, world_size, "model-state")
    models = [first, *(_load(file, unpickling) for file in model_files[1:])]
    optims = [_load(file, unpickling) for file in optim_files]
    for file, optim in zip(optim_files, optims, strict=True):
        if not isinstance(optim, dict) or not isinstance(optim.get("optimizer_state_dict"), dict):
            raise CheckpointError(
                f"DeepSpeed checkpoint file {file} holds no `optimizer_state_dict`: it is not a ZeRO optimizer file."
                " HINT: only checkpoints of DeepSpeed's ZeRO optimizers (stages 1 to 3) load here."
            )
    return DeepSpeedFiles(tag_dir, models, optims, optim_files)


def _rank_files(tag_dir: Path) -> tuple[list[Path], list[Path]]:
    """The model-state and optimizer files, sorted by data-parallel rank, refusing model parallelism."""
    models: dict[int, Path] = {}
    optims: dict[int, Path] = {}
    for child in sorted(tag_dir.iterdir()):
        if child.name.startswith("layer_") and child.name.endswith("-model_states.pt"):
            raise CheckpointError(
                f"DeepSpeed checkpoint {tag_dir} was written with pipeline parallelism ({child.name}). {_PARALLEL_HINT}"
            )
        for pattern, found in ((_MODEL_FILE, models), (_OPTIM_FILE, optims)):
            match = pattern.match(child.name)
            if match is None:
                continue
            dp_rank, mp_rank = match.groups()
            if int(mp_rank) != 0:
                raise CheckpointError(
                    f"DeepSpeed checkpoint {tag_dir} was written with tensor parallelism ({child.name}). "
                    + _PARALLEL_HINT
                )
            rank = int(dp_rank or 0)
            if rank in found:
                raise CheckpointError(
                    f"DeepSpeed checkpoint {tag_dir} holds two files for rank {rank}: {found[rank].name} and"
                    f" {child.name}. HINT: keep only the files of one save in a tag directory."
                )
            found[rank] = child
    if not models or not optims:
        missing = "model-state file (`*model_states.pt`)" if not models else "optimizer file (`*optim_states.pt`)"
        error = CheckpointError if not models else StateNotSaved
        raise error(
            f"DeepSpeed checkpoint {tag_dir} has no {missing}. HINT: copy the whole tag directory; a checkpoint saved"
            " without optimizer state (DeepSpeed's `zero_to_fp32.py` output) is one file: load that instead."
        )
    return [models[r] for r in sorted(models)], [optims[r] for r in sorted(optims)]


def _world_size(first: Any, file: Path) -> int:
    if not isinstance(first, dict) or "module" not in first or "param_shapes" not in first:
        raise CheckpointError(f"DeepSpeed checkpoint file {file} is not a model-state file. {DAMAGE_HINT}")
    parallel = first.get("checkpoint_parallel_dimensions") or {}
    if first.get("mp_world_size", 1) != 1 or any(parallel.get(k, 1) != 1 for k in ("pp_degree", "tp_degree")):
        raise CheckpointError(
            f"DeepSpeed checkpoint file {file} was written with model parallelism (mp_world_size"
            f" {first.get('mp_world_size')}, {parallel}). {_PARALLEL_HINT}"
        )
    return int(first["dp_world_size"])


def _check_ranks(tag_dir: Path, files: list[Path], world_size: int, kind: str) -> None:
    pattern = _OPTIM_FILE if kind == "optimizer" else _MODEL_FILE
    ranks = [int(pattern.match(f.name).group(1)) for f in files]  # type: ignore[union-attr]
    missing = sorted(set(range(world_size)) - set(ranks))
    if missing or len(ranks) != world_size:
        raise CheckpointError(
            f"DeepSpeed checkpoint {tag_dir} was saved by {world_size} ranks but holds {kind} files of ranks {ranks}"
            f" (missing: {missing}). {DAMAGE_HINT}"
        )


def _load(file: Path, unpickling: Unpickling) -> Any:
    return load_torch_file(file.read_bytes(), f"file {file}", unpickling, DEEPSPEED_STAND_INS)

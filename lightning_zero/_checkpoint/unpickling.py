"""Loading the pickled files of a checkpoint directory without running code.

A pickle names callables that run while it loads, so a checkpoint directory from elsewhere could run anything. Three
kinds of pickle live in one:

- DCP's ``.metadata`` (``pickle.dump`` of a ``Metadata``): always loaded by :class:`_MetadataUnpickler`, which
  imports only the classes of DCP's format on an allow-list. It never legitimately needs more, so no option widens it.
- our ``lightning_zero.pt`` (``torch.save`` of Lightning's remaining checkpoint, parameter groups, the sharded-key
  record) and DCP's non-tensor entries (``torch.save`` each, inside the shard files; DCP itself loads them with
  ``weights_only=False``): loaded by ``torch.load`` under the caller's :class:`Unpickling`, as Lightning loads a
  single-file checkpoint under ``"ddp"``: restricted to tensors and plain containers unless the user said
  ``weights_only=False``.
- the tensors of the shard files, which DCP already loads with ``weights_only=True``.

A DeepSpeed checkpoint's ``torch.save`` files (see :mod:`.deepspeed_files`) load like ``lightning_zero.pt``, except
that the three small DeepSpeed classes their pickles name come back as the inert stand-ins of
:data:`DEEPSPEED_STAND_INS`: records of their attributes, whatever the ``weights_only``, with DeepSpeed neither
imported nor needed.
"""

from __future__ import annotations

import io
import pickle
import types
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum, IntEnum
from pathlib import Path
from typing import IO, Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem, _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from lightning_zero._checkpoint.containment import open_file
from lightning_zero._checkpoint.error import DAMAGE_HINT, TRUST_HINT, CheckpointError
from lightning_zero._checkpoint.layout import StorageWindow, check_stored_chunk, expected_chunks


class Unpickling(Enum):
    """What ``lightning_zero.pt`` and DCP's non-tensor entries may import while they load (``torch.load``'s
    ``weights_only``, which Lightning passes on as the user gave it)."""

    TORCH_DEFAULT = None  # torch's default: restricted, unless TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD says otherwise
    RESTRICTED = True  # tensors, plain containers and the types torch allows
    TRUSTED = False  # anything importable: only for checkpoints the user trusts

    @classmethod
    def from_weights_only(cls, weights_only: bool | None) -> Unpickling:
        return cls(weights_only)

    @property
    def weights_only(self) -> bool | None:
        return self.value


# --- DCP's metadata --------------------------------------------------------------------------------------------------

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
# Every global a ``.metadata`` of DCP's file format refers to: its dataclasses, the enum encoding a memory format, the
# record of where each entry is stored, tensor sizes, layouts and dtypes, and the checkpoint path DCP records.
METADATA_GLOBALS = frozenset(
    {
        *(
            (_DCP_METADATA, name)
            for name in (
                "Metadata",
                "MetadataIndex",
                "StorageMeta",
                "TensorProperties",
                "TensorStorageMetadata",
                "BytesStorageMetadata",
                "ChunkStorageMetadata",
                "_MEM_FORMAT_ENCODING",
            )
        ),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("collections", "OrderedDict"),
        *(("pathlib", name) for name in ("Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")),
    }
)


class _ForbiddenGlobal(pickle.UnpicklingError):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


_TORCH_CONSTANTS = (torch.dtype, torch.layout, torch.memory_format)


def _is_torch_constant(module: str, name: str) -> bool:
    """A dtype such as ``torch.float32``: a value, not a callable."""
    return module == "torch" and isinstance(getattr(torch, name, None), _TORCH_CONSTANTS)


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``Metadata``, importing nothing off :data:`METADATA_GLOBALS`."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in METADATA_GLOBALS or _is_torch_constant(module, name):
            return super().find_class(module, name)
        raise _ForbiddenGlobal(f"{module}.{name}")


def read_dcp_metadata(data: bytes, file: Path) -> Metadata:
    """DCP's ``Metadata`` from the bytes of ``file``, as ``FileSystemReader.read_metadata`` returns it, unpickled with
    the allow-list."""
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except _ForbiddenGlobal as error:
        raise CheckpointError(
            f"Checkpoint file {file} refers to `{error.name}`, which DCP's metadata never holds; loading it could run"
            " code, so it was not loaded. HINT: this file was not written by torch.distributed.checkpoint or was"
            " altered since; do not load this checkpoint, resume from another one."
        ) from None
    except Exception as error:  # a truncated or overwritten pickle raises anything from EOFError to KeyError
        raise CheckpointError(
            f"Checkpoint file {file} cannot be read as DCP metadata ({_reason(error)}). {DAMAGE_HINT}"
        ) from error
    if not isinstance(metadata, Metadata):
        raise CheckpointError(
            f"Checkpoint file {file} holds a {type(metadata).__name__}, not DCP's Metadata. {DAMAGE_HINT}"
        )
    if metadata.storage_meta is None:
        metadata.storage_meta = StorageMeta()
    return metadata


# --- stand-ins for DeepSpeed's classes -------------------------------------------------------------------------------


class LossScalerRecord:
    """DeepSpeed's ``LossScaler`` (``cur_scale``, ``dynamic``) as plain attributes; no behaviour."""


class ZeroStageRecord(IntEnum):
    """DeepSpeed's ``ZeroStageEnum``: the ZeRO stage that wrote an optimizer file."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3


@dataclass
class FragmentAddressRecord:
    """DeepSpeed's ``fragment_address``: where a parameter's slice sits in a rank's partition."""

    numel: int = 0
    start: int = 0


# The only DeepSpeed globals a ZeRO checkpoint's pickles may name, by their import path, each loaded as its stand-in.
DEEPSPEED_STAND_INS: Mapping[str, type] = types.MappingProxyType(
    {
        "deepspeed.runtime.fp16.loss_scaler.LossScaler": LossScalerRecord,
        "deepspeed.runtime.zero.config.ZeroStageEnum": ZeroStageRecord,
        "deepspeed.utils.tensor_fragment.fragment_address": FragmentAddressRecord,
    }
)


def _stand_in_pickle_module(stand_ins: Mapping[str, type]) -> types.ModuleType:
    """A ``pickle_module`` for ``torch.load(weights_only=False)`` that resolves ``stand_ins`` without importing."""

    class Unpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            return stand_ins.get(f"{module}.{name}") or super().find_class(module, name)

    module = types.ModuleType("lightning_zero_stand_in_pickle")
    module.__dict__.update(vars(pickle))
    module.Unpickler = Unpickler  # type: ignore[attr-defined]
    return module


# --- torch.save files ------------------------------------------------------------------------------------------------


def load_torch_file(data: bytes, what: str, unpickling: Unpickling, stand_ins: Mapping[str, type] | None = None) -> Any:
    """``torch.load`` of ``data`` (the bytes of ``what``, named in errors) under ``unpickling``; the globals named in
    ``stand_ins`` (import path to class) load as those classes under any ``unpickling``. With stand-ins, torch's
    default reads as restricted."""
    try:
        if not stand_ins:
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=unpickling.weights_only)
        if unpickling is Unpickling.TRUSTED:
            module = _stand_in_pickle_module(stand_ins)
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False, pickle_module=module)
        with torch.serialization.safe_globals([(cls, path) for path, cls in stand_ins.items()]):
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as error:
        forbidden = _unsafe_globals(data) if isinstance(error, pickle.UnpicklingError) else []
        forbidden = [name for name in forbidden if name not in (stand_ins or {})]
        if forbidden:
            raise CheckpointError(
                f"Checkpoint {what} refers to {', '.join(f'`{name}`' for name in forbidden)}, which loading without"
                f" trust never imports: it could run code, so it was not loaded. {TRUST_HINT}"
            ) from None
        raise CheckpointError(f"Checkpoint {what} cannot be read ({_reason(error)}). {DAMAGE_HINT}") from error


def _unsafe_globals(data: bytes) -> list[str]:
    """The globals of a ``torch.save`` file that ``weights_only`` refuses, read from its pickle's opcodes without
    importing any; empty where the file is too damaged to tell."""
    try:
        return torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(data))
    except Exception:
        return []


def _reason(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


# --- inside DCP's load -----------------------------------------------------------------------------------------------


class _OwnFiles(FileSystem):
    """DCP's file access, reading only the checkpoint's own files (see :mod:`.containment`)."""

    @contextmanager
    def create_stream(self, path: str | Path, mode: str) -> Iterator[IO[bytes]]:
        path = Path(path)
        with open_file(path.parent, path.name, "a file `.metadata` names") as stream:
            yield stream


class VerifiedReader(FileSystemReader):
    """DCP's reader of a checkpoint directory, handed the ``Metadata`` already verified (see :mod:`.layout`) and
    unpickled with the allow-list instead of unpickling ``.metadata`` again with ``pickle.load``. It opens only the
    checkpoint's own files, and checks each chunk's stored shape before DCP loads it."""

    def __init__(self, path: Path, metadata: Metadata) -> None:
        super().__init__(path)
        self.fs = _OwnFiles()
        self._metadata = metadata
        self._chunks = expected_chunks(metadata)

    def _slice_file(self, file: Any, sinfo: _StorageInfo) -> IO[bytes]:
        view = StorageWindow(file, sinfo.offset, sinfo.length)
        expected = self._chunks.get(id(sinfo))
        if expected is not None:
            check_stored_chunk(view, Path(self.path) / sinfo.relative_path, *expected)
        return view

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        assert self._metadata.storage_meta is not None  # set by read_dcp_metadata
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata


class RestrictedLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, except that a non-tensor entry loads under ``unpickling``. The state dict is flat already
    (see :mod:`.directory`), so it is not flattened again."""

    def __init__(self, path: Path, unpickling: Unpickling, advance: Callable[[int], object] = lambda _: None) -> None:
        super().__init__(flatten_state_dict=False)
        self.path = path
        self.unpickling = unpickling
        self.advance = advance  # told the bytes of each tensor as it lands (a progress bar)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        super().commit_tensor(read_item, tensor)
        self.advance(tensor.numel() * tensor.element_size())

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        file = self.path / self.metadata.storage_data[read_item.storage_index].relative_path
        self.state_dict[fqn] = load_torch_file(value.getvalue(), f"entry `{fqn}` in {file}", self.unpickling)

"""What a checkpoint directory from elsewhere can do: run no code, and show damage as a `CheckpointError` that names
the file and what is wrong.

Altered copies of one real 2-rank checkpoint are loaded through every entry point: `consolidate_checkpoint`, the
command line, and `Trainer.fit(ckpt_path=...)` (one process here; two in a worker, where each rank checks its share
of the files and every rank must raise the same error). A payload pickles as a call that creates a marker file, so
"no code ran" is a file that does not exist. Whoever alters a checkpoint can rewrite its checksums too (they catch
damage, not forgery): :func:`reseal` does, so the payload tests reach the unpickling itself.
"""

from __future__ import annotations

import contextlib
import io
import json
import pickle
import re
import shutil
import signal
import subprocess
import sys
import zlib
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path
from typing import Any

import lightning
import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric import Fabric
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, ChunkStorageMetadata, MetadataIndex

import lightning_zero
from lightning_zero import CheckpointError, consolidate_checkpoint
from lightning_zero.__main__ import main as command_line
from lightning_zero._lightning_private import TAKES_WEIGHTS_ONLY
from tests.scenarios import MODULE_KWARGS, FaultPhase, run_phase
from tests.workers.modules import Classifier

WORKER = "tests.workers.checkpoint_faults"


class Touch:
    """Pickles as ``Path.touch(marker)``: loading it runs code, whose trace is the marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.marker,))


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("saved")
    run_phase(WORKER, FaultPhase.SAVE, out, world_size=2)
    return out


@pytest.fixture
def copy(saved: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(saved / "checkpoint", tmp_path / "checkpoint"))


def reseal(checkpoint: Path) -> None:
    """Rewrite ``checksums.json`` (where there is one) for the files as they are now."""
    record = checkpoint / "checksums.json"
    if not record.exists():
        return
    content = json.loads(record.read_text())
    for name, entry in content["files"].items():
        data = (checkpoint / name).read_bytes()
        entry.update(bytes=len(data), crc32=f"{zlib.crc32(data):08x}")
    canonical = json.dumps(content["files"], sort_keys=True, separators=(",", ":")).encode()
    content["record_crc32"] = f"{zlib.crc32(canonical):08x}"
    record.write_text(json.dumps(content))


def alter_meta(checkpoint: Path, change: Callable[[dict[str, Any]], None]) -> None:
    meta = torch.load(checkpoint / "lightning_zero.pt", weights_only=False)
    change(meta)
    torch.save(meta, checkpoint / "lightning_zero.pt")
    reseal(checkpoint)


def alter_dcp_metadata(checkpoint: Path, change: Callable[[Any], None]) -> None:
    metadata = pickle.loads((checkpoint / ".metadata").read_bytes())
    change(metadata)
    (checkpoint / ".metadata").write_bytes(pickle.dumps(metadata))
    reseal(checkpoint)


def fit(checkpoint: Path, **kwargs: Any) -> pl.Trainer:
    pl.seed_everything(0)
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy="zero2", max_steps=6, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Classifier(**MODULE_KWARGS), ckpt_path=checkpoint, **kwargs)
    return trainer


def consolidate_cli(checkpoint: Path, output: Path, *flags: str) -> None:
    """``python -m lightning_zero consolidate``, in this process; what it printed, raised as the error it reports."""
    printed = io.StringIO()
    with contextlib.redirect_stderr(printed):
        code = command_line(["consolidate", str(checkpoint), str(output), *flags])
    if code != 0:
        raise CheckpointError(printed.getvalue())


def fabric_load(checkpoint: Path, **options: bool | None) -> dict[str, Any]:
    """``fabric.load`` of the directory the Trainer saved, into a module and optimizer set up by Fabric, with
    ``options`` (``weights_only``)."""
    fabric = Fabric(accelerator="cpu", devices=1, strategy="zero2")
    fabric.launch()  # one process: this one
    module = Classifier(**MODULE_KWARGS)
    configured = module.configure_optimizers()  # the optimizer and its scheduler
    model, optimizer = fabric.setup(module, configured["optimizer"])
    return fabric.load(checkpoint, {"model": model, "optimizer": optimizer}, **options)


def passing_weights_only(*values: bool | None) -> list[dict[str, bool | None]]:
    """The keyword arguments of a load that passes each of ``values`` as its ``weights_only``; where the installed
    Lightning takes none (2.5), of the one load that passes nothing."""
    return [{"weights_only": value} for value in values] if TAKES_WEIGHTS_ONLY else [{}]


NO_WEIGHTS_ONLY = f"Lightning {lightning.__version__} takes no `weights_only` in `fit` nor in `fabric.load`"


ENTRY_POINTS: dict[str, Callable[[Path, Path], Any]] = {
    "consolidate": lambda checkpoint, tmp: consolidate_checkpoint(checkpoint, tmp / "out.ckpt"),
    "command line": lambda checkpoint, tmp: consolidate_cli(checkpoint, tmp / "out.ckpt"),
    "fit": lambda checkpoint, tmp: fit(checkpoint),
    "fabric.load": lambda checkpoint, tmp: fabric_load(checkpoint),
}


# --- no code runs ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("entry_point", list(ENTRY_POINTS))
@pytest.mark.slow
def test_code_planted_in_lightning_zero_pt_never_runs(copy: Path, tmp_path: Path, entry_point: str) -> None:
    marker = tmp_path / "ran"
    alter_meta(copy, lambda meta: meta["checkpoint"]["hyper_parameters"].update(note=Touch(marker)))
    with pytest.raises(CheckpointError, match=r"lightning_zero\.pt refers to .*`builtins\.getattr`.*HINT: only for"):
        ENTRY_POINTS[entry_point](copy, tmp_path)
    assert not marker.exists()
    assert not (tmp_path / "out.ckpt").exists()


@pytest.mark.parametrize("entry_point", list(ENTRY_POINTS))
@pytest.mark.slow
def test_code_planted_in_dcp_metadata_never_runs(copy: Path, tmp_path: Path, entry_point: str) -> None:
    marker = tmp_path / "ran"

    def plant(metadata: Any) -> None:
        metadata.planner_data = Touch(marker)

    alter_dcp_metadata(copy, plant)
    with pytest.raises(CheckpointError, match=r"\.metadata refers to `pathlib\.Path\.touch`, which DCP's metadata"):
        ENTRY_POINTS[entry_point](copy, tmp_path)
    assert not marker.exists()
    assert not (tmp_path / "out.ckpt").exists()


@pytest.mark.slow
def test_code_planted_in_a_dcp_entry_never_runs(copy: Path, tmp_path: Path) -> None:
    """DCP stores a non-tensor entry as `torch.save` bytes inside a shard file and loads it with `weights_only=False`;
    here one more entry points at a payload appended to a shard file."""
    marker, shard = tmp_path / "ran", copy / "__0_0.distcp"
    torch.save(Touch(marker), tmp_path / "payload.pt")
    payload = (tmp_path / "payload.pt").read_bytes()
    offset = shard.stat().st_size
    with shard.open("ab") as file:
        file.write(payload)

    def plant(metadata: Any) -> None:
        info = next(iter(metadata.storage_data.values()))
        metadata.state_dict_metadata["model/note"] = BytesStorageMetadata()
        metadata.storage_data[MetadataIndex("model/note")] = type(info)("__0_0.distcp", offset, len(payload))

    alter_dcp_metadata(copy, plant)
    with pytest.raises(CheckpointError, match=r"entry `model/note` in .*__0_0\.distcp refers to .*HINT: only for"):
        consolidate_checkpoint(copy, tmp_path / "out.ckpt")
    assert not marker.exists()


REFUSED_FRACTION = r"lightning_zero\.pt refers to `fractions\.Fraction`.*HINT: .*add_safe_globals.*trust_pickle=True"


@pytest.mark.slow
def test_objects_beyond_weights_load_only_when_trusted_as_under_ddp(copy: Path, tmp_path: Path) -> None:
    """A hyper-parameter that is neither a tensor nor a plain container: refused by default, as `"ddp"` refuses it in
    an ordinary checkpoint file (from Lightning 2.6 on); loaded once torch's allow-list names it, or with
    `weights_only=False` where that reaches the strategy (`fabric.load` passes it on: see the test below), or with
    `trust_pickle=True` (consolidation)."""
    alter_meta(copy, lambda meta: meta["checkpoint"]["hyper_parameters"].update(ratio=Fraction(1, 3)))
    for passed in passing_weights_only(None, True, False):  # Lightning 2.6 passes none on: each loads restricted
        with pytest.raises(CheckpointError, match=REFUSED_FRACTION):
            fit(copy, **passed)
    with torch.serialization.safe_globals([Fraction]):
        trainer = fit(copy)
    assert trainer.global_step == 6
    assert trainer.strategy.load_checkpoint(copy, weights_only=False)["hyper_parameters"]["ratio"] == Fraction(1, 3)
    with pytest.raises(CheckpointError, match=REFUSED_FRACTION):
        trainer.strategy.load_checkpoint(copy, weights_only=True)
    for passed in passing_weights_only(None, True):  # Fabric passes the user's on
        with pytest.raises(CheckpointError, match=REFUSED_FRACTION):
            fabric_load(copy, **passed)
    with pytest.raises(CheckpointError, match=REFUSED_FRACTION):
        consolidate_checkpoint(copy, tmp_path / "out.ckpt")
    assert command_line(["consolidate", str(copy), str(tmp_path / "out.ckpt")]) == 2
    for trusted in (lambda: consolidate_checkpoint(copy, tmp_path / "out.ckpt", trust_pickle=True),
                    lambda: consolidate_cli(copy, tmp_path / "out.ckpt", "--trust-pickle")):
        trusted()
        output = torch.load(tmp_path / "out.ckpt", weights_only=False)
        assert output["hyper_parameters"]["ratio"] == Fraction(1, 3)
    ordinary = tmp_path / "ordinary.ckpt"  # the same object in a single-file checkpoint, under "ddp"
    torch.save(output, ordinary)
    pl.seed_everything(0)
    ddp = pl.Trainer(accelerator="cpu", devices=1, strategy="ddp", max_steps=6, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    if TAKES_WEIGHTS_ONLY:
        with pytest.raises(pickle.UnpicklingError, match=r"fractions\.Fraction"):
            ddp.fit(Classifier(**MODULE_KWARGS), ckpt_path=ordinary)
    else:  # Lightning 2.5 loads an ordinary file's whole pickle
        ddp.fit(Classifier(**MODULE_KWARGS), ckpt_path=ordinary)
        assert ddp.global_step == 6


@pytest.mark.skipif(not TAKES_WEIGHTS_ONLY, reason=NO_WEIGHTS_ONLY)
@pytest.mark.slow
def test_fabric_load_with_weights_only_false_loads_objects_beyond_weights(copy: Path) -> None:
    """`fabric.load(..., weights_only=False)` reaches the strategy, which then loads the hyper-parameter that the test
    above sees refused by default."""
    alter_meta(copy, lambda meta: meta["checkpoint"]["hyper_parameters"].update(ratio=Fraction(1, 3)))
    assert fabric_load(copy, weights_only=False)["hyper_parameters"]["ratio"] == Fraction(1, 3)


@pytest.mark.slow
def test_ordinary_checkpoints_load_by_default(copy: Path, saved: Path, tmp_path: Path) -> None:
    """Hyper-parameters from `save_hyperparameters`, loops, callbacks and schedulers need no trust."""
    assert fit(copy).global_step == 6
    output = consolidate_checkpoint(copy, tmp_path / "out.ckpt")
    model = Classifier.load_from_checkpoint(output)
    assert model.hparams.hidden == MODULE_KWARGS["hidden"]
    for key, value in torch.load(saved / "weights.pt").items():
        assert torch.equal(model.state_dict()[key], value), key


# --- damage ----------------------------------------------------------------------------------------------------------


def truncate(file: Path) -> None:
    file.write_bytes(file.read_bytes()[: file.stat().st_size * 2 // 3])


def zero(file: Path) -> None:
    file.write_bytes(bytes(file.stat().st_size))


def flip_a_bit(file: Path, at: float = 0.5) -> None:
    data = bytearray(file.read_bytes())
    data[int(len(data) * at)] ^= 0x04
    file.write_bytes(bytes(data))


def flip_a_recorded_checksum(file: Path) -> None:
    text = file.read_text()
    at = text.index('"crc32"') + len('"crc32": "')
    digit = text[at]
    file.write_text(text[:at] + ("1" if digit == "0" else "0") + text[at + 1 :])


# --- a directory naming files outside itself, and sizes it does not hold (whoever alters it rewrites the sums) ------


def rewrite_record(checkpoint: Path, change: Callable[[dict[str, Any]], None]) -> None:
    """Change the entries of ``checksums.json`` and give it the CRC-32 of its new entries."""
    record = checkpoint / "checksums.json"
    content = json.loads(record.read_text())
    change(content["files"])
    canonical = json.dumps(content["files"], sort_keys=True, separators=(",", ":")).encode()
    content["record_crc32"] = f"{zlib.crc32(canonical):08x}"
    record.write_text(json.dumps(content))


def list_a_file_outside(how: str) -> Callable[[Path], None]:
    """``checksums.json`` lists a file outside the checkpoint, by ``how`` ("absolute" or "relative") path, with its
    true size and CRC-32."""

    def alter(record: Path) -> None:
        secret = record.parent.parent / "outside" / "secret.txt"
        secret.parent.mkdir(exist_ok=True)
        secret.write_text("secret")
        name = str(secret) if how == "absolute" else "../outside/secret.txt"
        entry = {"bytes": 6, "crc32": f"{zlib.crc32(b'secret'):08x}"}
        rewrite_record(record.parent, lambda files: files.update({name: entry}))

    return alter


def store_shard_0_elsewhere(how: str) -> Callable[[Path], None]:
    """``.metadata`` stores rank 0's entries in another checkpoint's shard file, named by ``how`` ("absolute",
    "relative") path, or in a file of this checkpoint that ``checksums.json`` does not list ("unlisted")."""

    def alter(metadata_file: Path) -> None:
        checkpoint = metadata_file.parent
        other = Path(shutil.copytree(checkpoint, checkpoint.parent / f"other-run-{how}"))
        shutil.copy(checkpoint / "__0_0.distcp", checkpoint / "__0_0.unlisted")
        name = {"absolute": str(other / "__0_0.distcp"), "relative": f"../{other.name}/__0_0.distcp",
                "unlisted": "__0_0.unlisted"}[how]

        def repoint(metadata: Any) -> None:
            for info in metadata.storage_data.values():
                if info.relative_path == "__0_0.distcp":
                    info.relative_path = name

        alter_dcp_metadata(checkpoint, repoint)

    return alter


def link_to_a_copy(file: Path) -> None:
    """Replace ``file`` with a link to an identical copy outside the checkpoint (same size, same CRC-32)."""
    outside = file.parent.parent / f"outside-{file.name}"
    shutil.copy(file, outside)
    file.unlink()
    file.symlink_to(outside)


def grow_sparse(file: Path) -> None:
    """Make ``file`` 8 GiB long (sparse): read whole, it would take GiBs of memory and seconds."""
    with file.open("r+b") as opened:
        opened.truncate(8 * 2**30)


def declare_elements(count: int) -> Callable[[Path], None]:
    """``.metadata`` declares `mid.bias` of ``count`` elements, its last chunk growing to cover them."""

    def alter(metadata_file: Path) -> None:
        def declare(metadata: Any) -> None:
            entry = metadata.state_dict_metadata["model/mid.bias"]
            entry.size = torch.Size([count])
            last = entry.chunks[-1]
            last.sizes = torch.Size([count - last.offsets[0]])

        alter_dcp_metadata(metadata_file.parent, declare)

    return alter


def chunks_over_one_stored_tensor(metadata_file: Path) -> None:
    """1,000 chunks of `mid.weight` (declared 1,000 times as tall), each stored in rank 0's one stored chunk."""

    def repeat(metadata: Any) -> None:
        entry = metadata.state_dict_metadata["model/mid.weight"]
        first = entry.chunks[0]
        stored = metadata.storage_data[MetadataIndex("model/mid.weight", first.offsets)]
        rows = first.sizes[0]
        entry.size = torch.Size([rows * 1000, *first.sizes[1:]])
        entry.chunks = [ChunkStorageMetadata(torch.Size([rows * i, 0]), first.sizes) for i in range(1000)]
        for chunk in entry.chunks:
            metadata.storage_data[MetadataIndex("model/mid.weight", chunk.offsets)] = stored

    alter_dcp_metadata(metadata_file.parent, repeat)


def drop_a_chunk(metadata_file: Path) -> None:
    alter_dcp_metadata(metadata_file.parent, lambda m: m.state_dict_metadata["model/mid.weight"].chunks.pop())


def declare_float64(metadata_file: Path) -> None:
    """`out.bias` declared float64: its chunks' raw bytes still fit in their storage, which holds float32."""

    def declare(metadata: Any) -> None:
        metadata.state_dict_metadata["model/out.bias"].properties.dtype = torch.float64

    alter_dcp_metadata(metadata_file.parent, declare)


OUTSIDE = {  # file, what is done to it, what the error must say after the checkpoint's path
    "checksums.json lists an absolute path": (
        "checksums.json", list_a_file_outside("absolute"), r"`checksums\.json` names '/.*secret\.txt', an absolute"
    ),
    "checksums.json lists ../": (
        "checksums.json", list_a_file_outside("relative"), r"`checksums\.json` names '\.\./outside/secret\.txt', a path"
    ),
    ".metadata stores in another checkpoint by absolute path": (
        ".metadata", store_shard_0_elsewhere("absolute"), r"`\.metadata` \(for `model/.*`\) names '/.*other-run-abs"
    ),
    ".metadata stores in another checkpoint by ../": (
        ".metadata", store_shard_0_elsewhere("relative"), r"names '\.\./other-run-relative/__0_0\.distcp', a path"
    ),
    ".metadata stores in an unlisted file": (
        ".metadata", store_shard_0_elsewhere("unlisted"), r"names the file '__0_0\.unlisted', which `checksums\.json`"
    ),
    "a shard file is a link": ("__1_0.distcp", link_to_a_copy, r"__1_0\.distcp \(.*\) is a symbolic link"),
    ".metadata is a link": (".metadata", link_to_a_copy, r"\.metadata \(DCP's index.*\) is a symbolic link"),
    "lightning_zero.pt grown to 8 GiB": ("lightning_zero.pt", grow_sparse, r"lightning_zero\.pt has grown: 8,589,934,"),
    "2**40 elements": (".metadata", declare_elements(2**40), r"a chunk of `model/mid\.bias` at \(15,\) of 4,398,046,"),
    "2**31 elements": (".metadata", declare_elements(2**31), r"a chunk of `model/mid\.bias` at \(15,\) of 8,589,934,"),
    "1,000 chunks over one stored tensor": (
        ".metadata", chunks_over_one_stored_tensor, r"stores `model/mid\.weight` and `model/mid\.weight` over the same"
    ),
    "a chunk dropped": (".metadata", drop_a_chunk, r"`model/mid\.weight` of size \(29, 29\) \(841 elements\) in"),
    "a chunk stored as another dtype": (
        ".metadata", declare_float64, r"the storage of `model/out\.bias` at \(0,\) holds shape \(2,\), torch\.float32"
    ),
}


@pytest.mark.parametrize("case", list(OUTSIDE))
def test_a_directory_reads_nothing_outside_itself_nor_sizes_it_does_not_hold(
    copy: Path, tmp_path: Path, case: str
) -> None:
    """Each refused before the bytes it names are read or the sizes it declares allocated; a `CheckpointError` that
    names the checkpoint, the file and the entry."""
    name, alter, message = OUTSIDE[case]
    alter(copy / name)
    named = r"Checkpoint (file )?" + re.escape(str(copy)) + r".*"
    with pytest.raises(CheckpointError, match=named + message + r".*HINT: "):
        consolidate_checkpoint(copy, tmp_path / "out.ckpt")
    assert not (tmp_path / "out.ckpt").exists()
    assert command_line(["consolidate", str(copy), str(tmp_path / "out.ckpt")]) == 2


def test_a_checkpoint_of_the_previous_release_reads_nothing_outside_itself_either(copy: Path, tmp_path: Path) -> None:
    """Without checksums.json (format 1) nothing lists the files, and a `.metadata` naming `../` is still refused."""
    (copy / "checksums.json").unlink()
    alter_meta(copy, lambda meta: meta.update(format=1))
    store_shard_0_elsewhere("relative")(copy / ".metadata")
    with pytest.warns(UserWarning, match=r"unverified"), pytest.raises(CheckpointError, match=r"names '\.\./other-run"):
        consolidate_checkpoint(copy, tmp_path / "out.ckpt")


DAMAGE = {  # file, what is done to it, what the error must say after the file's path
    "missing .metadata": (".metadata", Path.unlink, r"lacks `\.metadata` \(DCP's index"),
    "missing lightning_zero.pt": ("lightning_zero.pt", Path.unlink, r"lacks `lightning_zero\.pt` \(the rest"),
    "missing checksums.json": ("checksums.json", Path.unlink, r"checksums\.json is missing"),
    "missing a shard file": ("__0_0.distcp", Path.unlink, r"__0_0\.distcp is missing; it holds"),
    "truncated .metadata": (".metadata", truncate, r"\.metadata is truncated: [\d,]+ bytes, [\d,]+ when it was"),
    "truncated lightning_zero.pt": ("lightning_zero.pt", truncate, r"lightning_zero\.pt is truncated: [\d,]+ bytes"),
    "truncated checksums.json": ("checksums.json", truncate, r"checksums\.json cannot be read"),
    "truncated shard file": ("__1_0.distcp", truncate, r"__1_0\.distcp is truncated"),
    "zeroed .metadata": (".metadata", zero, r"\.metadata is damaged: its CRC-32 is"),
    "a bit flipped in .metadata": (".metadata", flip_a_bit, r"\.metadata is damaged: its CRC-32 is"),
    "a bit flipped in lightning_zero.pt": ("lightning_zero.pt", flip_a_bit, r"lightning_zero\.pt is damaged: its CRC"),
    "a bit flipped in shard 0": ("__0_0.distcp", flip_a_bit, r"__0_0\.distcp is damaged: its CRC-32 is [0-9a-f]{8},"),
    "a bit flipped in shard 1": ("__1_0.distcp", flip_a_bit, r"__1_0\.distcp is damaged: its CRC-32 is [0-9a-f]{8},"),
    "a bit flipped in checksums.json": (
        "checksums.json", flip_a_recorded_checksum, r"checksums\.json is damaged: its entries do not match"
    ),
}


@pytest.mark.parametrize("case", list(DAMAGE))
@pytest.mark.slow
def test_damage_is_named_with_a_hint(copy: Path, tmp_path: Path, case: str) -> None:
    name, damage, message = DAMAGE[case]
    damage(copy / name)
    with pytest.raises(CheckpointError, match=message + r".*HINT: ") as error:
        consolidate_checkpoint(copy, tmp_path / "out.ckpt")
    assert str(copy) in str(error.value)
    assert not (tmp_path / "out.ckpt").exists()
    assert command_line(["consolidate", str(copy), str(tmp_path / "out.ckpt")]) == 2


@pytest.mark.slow
def test_fabric_load_checks_every_file_as_the_trainer_does(copy: Path) -> None:
    """``fabric.load`` reads the directory through the same checks: a flipped bit in the shard another rank wrote."""
    flip_a_bit(copy / "__1_0.distcp")
    with pytest.raises(CheckpointError, match=r"__1_0\.distcp is damaged: its CRC-32 is [0-9a-f]{8},.*HINT: "):
        fabric_load(copy)


RESUMED_DAMAGE = ["a bit flipped in shard 0", "a bit flipped in shard 1", "a bit flipped in lightning_zero.pt",
                  "zeroed .metadata", "missing checksums.json", "truncated shard file",
                  "checksums.json lists an absolute path", ".metadata stores in another checkpoint by ../",
                  "a shard file is a link", "2**40 elements", "1,000 chunks over one stored tensor",
                  "a chunk stored as another dtype"]


@pytest.mark.slow
def test_damage_stops_a_resume_on_every_rank_alike(saved: Path, tmp_path: Path) -> None:
    """On 2 ranks each shard file is checked by one rank only; both raise the error that rank found. So do a
    directory naming files outside itself and one declaring sizes its files do not hold: `fit(ckpt_path=...)` loads
    no foreign weights and allocates nothing by them."""
    cases = {**DAMAGE, **OUTSIDE}
    copies = []
    for index, case in enumerate(RESUMED_DAMAGE):
        name, damage, _ = cases[case]
        copies.append(Path(shutil.copytree(saved / "checkpoint", tmp_path / f"damaged-{index}")))
        damage(copies[-1] / name)
    copies.append(Path(shutil.copytree(saved / "checkpoint", tmp_path / "intact")))
    run_phase(WORKER, FaultPhase.RESUME_EACH, tmp_path, world_size=2, paths=copies)
    errors = [json.loads((tmp_path / f"errors-rank{rank}.json").read_text()) for rank in range(2)]
    assert errors[0] == errors[1]
    for case, copy_ in zip(RESUMED_DAMAGE, copies[:-1], strict=True):
        assert errors[0][str(copy_)] is not None, case
        assert re.search(cases[case][2] + r".*HINT: ", errors[0][str(copy_)]), case
    assert errors[0][str(copies[-1])] is None


@pytest.mark.slow
def test_a_checkpoint_of_the_previous_release_loads_unverified_and_damage_is_still_named(
    copy: Path, saved: Path, tmp_path: Path
) -> None:
    """Checkpoints written before checksums were recorded (format 1, no checksums.json) load with a warning; what is
    damaged in them is still reported as a `CheckpointError`, not a raw unpickling traceback."""
    (copy / "checksums.json").unlink()
    alter_meta(copy, lambda meta: meta.update(format=1))
    with pytest.warns(UserWarning, match=r"has no checksums\.json.*unverified"):
        model = Classifier.load_from_checkpoint(consolidate_checkpoint(copy, tmp_path / "out.ckpt"))
    for key, value in torch.load(saved / "weights.pt").items():
        assert torch.equal(model.state_dict()[key], value), key
    for name, damage, message in (
        (".metadata", zero, r"\.metadata cannot be read as DCP metadata"),
        ("lightning_zero.pt", truncate, r"lightning_zero\.pt cannot be read"),
    ):
        damaged = Path(shutil.copytree(copy, tmp_path / f"damaged{name}"))
        damage(damaged / name)
        with pytest.raises(CheckpointError, match=message + r".*HINT: "):
            consolidate_checkpoint(damaged, tmp_path / "out.ckpt")


# --- staging never follows links -------------------------------------------------------------------------------------


def plant_links(at: list[Path], victim: Path) -> None:
    victim.mkdir(exist_ok=True)
    (victim / "precious").write_text("keep me")
    for link in at:
        link.symlink_to(victim, target_is_directory=True)


@pytest.mark.slow
def test_consolidation_never_writes_through_a_planted_link(copy: Path, tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    output = tmp_path / "out.ckpt"
    (tmp_path / ".out.ckpt.partial").symlink_to(victim)  # the staging name earlier releases used
    consolidate_checkpoint(copy, output)
    assert victim.read_text() == "keep me"
    output.unlink()
    output.symlink_to(victim)  # a link at the output itself is replaced, not written through
    consolidate_checkpoint(copy, output)
    assert victim.read_text() == "keep me"
    assert not output.is_symlink() and torch.load(output)["global_step"] == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.ckpt.partial", "checkpoint", "out.ckpt", "victim"]


def test_a_save_never_follows_links_planted_at_its_staging_names(tmp_path: Path) -> None:
    """Links at the names a save uses or once used beside its target: the save works, what they point to stays, and
    the links (the save's leftovers by name) go."""
    target = tmp_path / "checkpoints" / "checkpoint"
    target.parent.mkdir()
    names = [".checkpoint.partial", ".checkpoint.old", ".checkpoint.partial-0123456789abcdef"]
    plant_links([target.parent / name for name in names], tmp_path / "victim")
    trainer = fit_and_save(target)
    assert (tmp_path / "victim" / "precious").read_text() == "keep me"
    assert sorted(p.name for p in target.parent.iterdir()) == ["checkpoint"]
    plant_links([target.parent / name for name in names], tmp_path / "victim")
    trainer.save_checkpoint(target)  # over the first
    assert (tmp_path / "victim" / "precious").read_text() == "keep me"
    assert sorted(p.name for p in target.parent.iterdir()) == ["checkpoint"]
    assert fit(target).global_step == 6


@pytest.mark.slow
def test_consolidation_killed_while_writing_leaves_nothing(copy: Path, tmp_path: Path) -> None:
    """The output is written with no name until it is whole: a SIGKILL while writing leaves no file (GBs, for a
    large model) in the output's directory."""
    out = tmp_path / "out"
    out.mkdir()
    code = f"""
import os, signal, torch
from lightning_zero import consolidate_checkpoint
real_save = torch.save
def save_then_die(obj, file):
    real_save(obj, file)
    file.flush()
    os.kill(os.getpid(), signal.SIGKILL)
torch.save = save_then_die
consolidate_checkpoint({str(copy)!r}, {str(out / "model.ckpt")!r})
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert list(out.iterdir()) == []


def test_removing_a_checkpoint_removes_a_link_not_its_target(tmp_path: Path) -> None:
    """`ModelCheckpoint` removes old checkpoints through the strategy; a link planted at one's path goes alone."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious").write_text("kept")
    for target in (victim, victim / "precious"):
        link = tmp_path / f"link-to-{target.name}"
        link.symlink_to(target)
        lightning_zero.ZeroStrategy(stage=2).remove_checkpoint(link)
        assert not link.is_symlink()
    assert (victim / "precious").read_text() == "kept"


def fit_and_save(target: Path | None, hidden: int = MODULE_KWARGS["hidden"], steps: int = 4) -> pl.Trainer:
    """Train ``steps`` steps on one process; save to ``target``, if given."""
    pl.seed_everything(0)
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy="zero2", max_steps=steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Classifier(**{**MODULE_KWARGS, "hidden": hidden}))
    if target is not None:
        trainer.save_checkpoint(target)
    return trainer

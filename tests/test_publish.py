"""``_checkpoint/publish.py`` on its own, with real directories: a target always names one complete checkpoint, old or
new, and the recovery rule finds it after a publish stopped between its two renames. No processes."""

from __future__ import annotations

import os
from pathlib import Path

from lightning_zero._checkpoint import publish


def _staged(target: Path, content: str) -> Path:
    staging = publish.make_staging_directory(target)
    (staging / "data").write_text(content)
    return staging


def _content(path: Path) -> str:
    return (path / "data").read_text()


def test_a_publish_replaces_the_target_and_leaves_nothing_beside_it(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    staging = _staged(target, "one")
    assert staging.parent == tmp_path and staging.name.startswith(".ckpt.partial-")
    assert publish.leftovers(target) == [staging]
    publish.recover(target)
    publish.publish_directory(staging, target)
    assert _content(target) == "one" and publish.leftovers(target) == []
    publish.publish_directory(_staged(target, "two"), target)
    assert _content(target) == "two" and publish.leftovers(target) == []
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_a_publish_stopped_between_two_renames_is_recovered(tmp_path: Path) -> None:
    """The state the two-rename fallback passes through: the old checkpoint at the kept copy, no target. A load
    reads the kept copy; the next save moves it back first, then publishes over it."""
    target = tmp_path / "ckpt"
    publish.publish_directory(_staged(target, "old"), target)
    staging = _staged(target, "new")
    os.rename(target, publish.kept_copy(target))  # the first rename; the process dies here
    assert publish.readable(target) == publish.kept_copy(target)
    assert _content(publish.readable(target)) == "old"
    publish.recover(target)
    assert publish.readable(target) == target and _content(target) == "old"
    publish.reclaim(target)  # the dead save's staging directory
    assert not staging.exists()
    publish.publish_directory(_staged(target, "newer"), target)
    assert _content(target) == "newer" and publish.leftovers(target) == []


def test_a_kept_copy_beside_a_target_is_the_replaced_one(tmp_path: Path) -> None:
    """Both renames done, the process dies before removing the kept copy: the target is the checkpoint, and the kept
    copy goes at the next save."""
    target = tmp_path / "ckpt"
    publish.publish_directory(_staged(target, "new"), target)
    kept = publish.kept_copy(target)
    kept.mkdir()
    (kept / "data").write_text("old")
    assert publish.readable(target) == target
    publish.recover(target)
    assert not kept.exists() and _content(target) == "new"


def test_a_file_is_not_a_checkpoint_directory_and_links_are_removed_not_followed(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    target.write_text("a single-file checkpoint")
    assert publish.readable(target) is None
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep").write_text("mine")
    link = tmp_path / ".ckpt.old"
    link.symlink_to(elsewhere, target_is_directory=True)
    assert link in publish.leftovers(target)
    publish.reclaim(target)
    assert not os.path.lexists(link) and (elsewhere / "keep").read_text() == "mine"

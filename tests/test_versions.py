"""The declared range of torch and Lightning is one range: the floors ``lightning_zero`` checks at import are those
``pyproject.toml`` declares and CI installs (``.ci/floor.txt``), an older release is refused by name and version, and
the ceiling ``pyproject.toml`` declares admits the newest torch CI installs (``.ci/ceiling.txt``) and nothing newer."""

from __future__ import annotations

import re
from pathlib import Path

import lightning
import pytest
import torch

from lightning_zero._versions import FLOORS, check_installed, refusal, release

ROOT = Path(__file__).resolve().parents[1]


def declared_floors() -> dict[str, str]:
    """``pyproject.toml``'s ``package>=X`` floors of the runtime dependencies."""
    text = (ROOT / "pyproject.toml").read_text()
    dependencies = re.search(r"^dependencies = \[(.*?)^\]", text, re.S | re.M)
    assert dependencies is not None
    return dict(re.findall(r'"([\w-]+)>=([\d.]+)', dependencies.group(1)))


def pins(edge: str) -> dict[str, str]:
    """``.ci/<edge>.txt``'s ``package==X`` pins."""
    return dict(re.findall(r"^([\w-]+)==([\w.+]+)", (ROOT / ".ci" / f"{edge}.txt").read_text(), re.M))


def floor_pins() -> dict[str, str]:
    return pins("floor")


def test_pyproject_and_ci_floor_are_the_checked_floors() -> None:
    declared, pins = declared_floors(), floor_pins()
    for package, floor in FLOORS.items():
        assert release(declared[package])[:2] == floor, package
        assert release(pins[package])[:2] == floor, package
    assert pins["torchmetrics"] == declared["torchmetrics"]  # the oldest torchmetrics is tested too


def test_the_declared_torch_ceiling_is_the_newest_release_ci_tests() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    ceiling = re.search(r'"torch>=[\d.]+,<([\d.]+)"', text)
    assert ceiling is not None, "pyproject.toml declares no ceiling for torch"
    tested = release(pins("ceiling")["torch"])
    assert release(ceiling.group(1)) == (tested[0], tested[1] + 1)  # every patch of the tested minor, nothing newer
    assert release(pins("ceiling")["lightning"]) >= release(pins("floor")["lightning"])


@pytest.mark.parametrize(
    ("version", "numbers"),
    [("2.8.0+cu128", (2, 8, 0)), ("2.10.0a0+git1234", (2, 10, 0)), ("2.5", (2, 5)), ("2.14.1", (2, 14, 1))],
)
def test_release_reads_the_numbers(version: str, numbers: tuple[int, ...]) -> None:
    assert release(version) == numbers


@pytest.mark.parametrize(("package", "version"), [("torch", "2.7.1+cu126"), ("torch", "1.13"), ("lightning", "2.4.0")])
def test_an_older_release_is_refused_with_both_versions(package: str, version: str) -> None:
    reason = refusal(package, version)
    required = ".".join(map(str, FLOORS[package]))
    assert reason is not None
    assert f"{package}>={required}" in reason and f"{package} {version} is installed" in reason and "HINT:" in reason


@pytest.mark.parametrize(
    ("package", "version"), [("torch", "2.8.0"), ("torch", "2.14.1+cpu"), ("torch", "3.0"), ("lightning", "2.5.0")]
)
def test_the_floor_and_newer_releases_are_accepted(package: str, version: str) -> None:
    assert refusal(package, version) is None


def test_the_installed_releases_pass_the_import_check() -> None:
    check_installed()  # what `import lightning_zero` ran


@pytest.mark.parametrize(("module", "version"), [(torch, "2.7.1"), (lightning, "2.4.2")], ids=["torch", "lightning"])
def test_an_older_installed_release_fails_the_import_check(
    monkeypatch: pytest.MonkeyPatch, module: object, version: str
) -> None:
    monkeypatch.setattr(module, "__version__", version)
    name = module.__name__  # type: ignore[attr-defined]
    with pytest.raises(ImportError, match=rf"needs {name}>=[\d.]+, and {name} {re.escape(version)} is installed\."):
        check_installed()

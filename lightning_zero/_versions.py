"""The oldest torch and Lightning releases this package runs on, checked when it is imported.

They are the floors of ``pyproject.toml``'s dependencies, and CI runs the tests on exactly them (``.ci/floor.txt``).
An older release is refused here, by name and version, before anything imports the parts of torch or Lightning it
lacks (which would fail with an error that does not say why) or trains on what it does differently (torch 2.7's
``fully_shard`` has no ``ignored_params``; gloo's reduce-scatter in torch 2.8 sums where asked to average, which
:mod:`lightning_zero._stage3.collectives` works around).
"""

from __future__ import annotations

import re

import lightning
import torch

FLOORS = {"torch": (2, 8), "lightning": (2, 5)}
"""Each package's oldest supported release, as ``(major, minor)``."""


def release(version: str) -> tuple[int, ...]:
    """The numeric release of a version string: ``"2.8.0+cu128"`` and ``"2.8.0a0+git1234"`` give ``(2, 8, 0)``."""
    numbers = re.match(r"\d+(?:\.\d+)*", version)
    if numbers is None:
        raise ValueError(f"{version!r} does not start with a release number")
    return tuple(int(n) for n in numbers.group().split("."))


def refusal(package: str, installed: str) -> str | None:
    """Why ``installed`` (a version of ``package``) cannot be used, or ``None`` when it can."""
    floor = FLOORS[package]
    if release(installed) >= floor:
        return None
    required = ".".join(map(str, floor))
    return (
        f"lightning_zero needs {package}>={required}, and {package} {installed} is installed."
        f" HINT: upgrade it: `pip install '{package}>={required}'`."
    )


def check_installed() -> None:
    """Refuse the installed torch or Lightning if it is older than its floor."""
    for package, installed in (("torch", torch.__version__), ("lightning", lightning.__version__)):
        reason = refusal(package, str(installed))
        if reason is not None:
            raise ImportError(reason)


check_installed()

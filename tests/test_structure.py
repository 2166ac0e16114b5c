"""The package's rooms and their order: every import of a module of the package (at the top, in a function, or for
type checking alike) goes to its own layer or one below, and no modules import each other in a circle. Parsed from the
source, nothing imported.

A module's layer is that of the longest entry of :data:`LAYERS` that names it or a package above it; every module
must have one, so that a new room is placed on purpose.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_zero"

# lowest first; a layer may import itself and those before it
LAYERS: list[tuple[str, list[str]]] = [
    ("utilities", ["_threads", "_files", "_grouping", "_creator", "_progress", "_versions", "_warning_filter",
                   "_lightning_private"]),
    ("torch's fully_shard, as stage 3 and the offload room's shards in files use it", ["_stage3.seam"]),
    ("checkpoints on disk", ["_checkpoint"]),
    ("transport", ["_transport"]),
    ("the stall watchdog", ["_watchdog"]),
    ("offload", ["_offload"]),
    ("options", ["_wrap", "_deepspeed_optim", "_deepspeed_config", "_config"]),
    ("stages 1 and 2", ["_engine"]),
    ("stage 3", ["_stage3"]),
    ("reports", ["memory", "estimate"]),
    ("the automatic choice of stage and offload", ["_auto"]),
    ("the core", ["_core"]),
    ("front ends", ["pytorch", "fabric", "consolidate"]),
    ("the package", ["", "__main__"]),
]  # fmt: skip


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def layer_of(module: str) -> int:
    """The index in :data:`LAYERS` of the longest entry naming ``module`` or a package above it."""
    best, found = -1, None
    for index, (_, entries) in enumerate(LAYERS):
        for entry in entries:
            named = entry == "" or module == entry or module.startswith(f"{entry}.")
            if named and len(entry) > best:
                best, found = len(entry), index
    assert found is not None, f"lightning_zero.{module} belongs to no layer: add it to LAYERS"
    return found


def imports_of(module: str) -> set[str]:
    """The package's modules that ``module`` imports: ``from pkg import name`` imports the module ``pkg.name`` where
    there is one, else ``pkg`` (its ``__init__``)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".") if package else []
                base = base[: len(base) - (node.level - 1)]
                target = ".".join([*base, node.module] if node.module else base)
                absolute = f"lightning_zero.{target}" if target else "lightning_zero"
            else:
                absolute = node.module or ""
            named = [f"{absolute}.{alias.name}" for alias in node.names]
            modules = [name for name in named if name.removeprefix("lightning_zero.") in MODULES]
            targets = modules + ([absolute] if len(modules) < len(named) else [])
        else:
            continue
        for target in targets:
            if target == "lightning_zero" or target.startswith("lightning_zero."):
                name = target.removeprefix("lightning_zero").removeprefix(".")
                if name in MODULES:
                    found.add(name)
    return found


GRAPH = {module: imports_of(module) - {module} for module in MODULES}


def test_every_module_has_a_layer() -> None:
    for module in MODULES:
        layer_of(module)


def test_no_module_imports_a_layer_above_its_own() -> None:
    upward = [
        f"lightning_zero.{module} ({LAYERS[layer_of(module)][0]}) imports lightning_zero.{target}"
        f" ({LAYERS[layer_of(target)][0]})"
        for module, targets in GRAPH.items()
        for target in sorted(targets)
        if layer_of(target) > layer_of(module)
    ]
    assert upward == []


def test_no_modules_import_each_other_in_a_circle() -> None:
    assert cycles(GRAPH) == []


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


@pytest.mark.parametrize(
    ("graph", "expected"),
    [
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
        ({"a": {"b"}, "b": set(), "c": {"b"}}, []),
    ],
)
def test_the_circle_finder_finds_circles(graph: dict[str, set[str]], expected: list[list[str]]) -> None:
    assert cycles(graph) == expected

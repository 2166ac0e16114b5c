"""Every Python block of the README and of ``docs/`` runs, so that no example can rot.

A block runs as a user runs it: written to a file and started with ``python FILE`` in an empty directory, on the CPU
(a block with ``devices=2`` is relaunched by Lightning itself, as a user's script is). A block that needs GPUs is
marked by the line :data:`GPU_ONLY` right above its fence; it is compiled, its imports run, and every attribute it
reads from what it imports (``lightning_zero.Zero2Strategy``, ``pl.Trainer``) must exist. The API reference pages
must document every public name, and the benchmarks' charts must be shown by the pages and stay small.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

import lightning_zero
from lightning_zero import fabric
from tests.launch import without_rendezvous

pytestmark = pytest.mark.slow  # its tests run the docs' code blocks in fresh interpreters

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
GPU_ONLY = "<!-- gpu-only -->"
FENCE = re.compile(r"^```python\n(.*?)^```$", re.MULTILINE | re.DOTALL)
CHART = re.compile(r"!\[[^\]]*\]\([^)]*charts/([\w.]+\.png)\)")  # ![alt](.../charts/NAME.png)


@dataclass(frozen=True)
class Block:
    """One fenced Python block of a Markdown file."""

    where: str  # "docs/guides/precision.md:12", the line of the opening fence
    code: str
    gpu_only: bool


def markdown_files() -> list[Path]:
    return [REPO / "README.md", *sorted(DOCS.rglob("*.md"))]


def blocks_of(path: Path) -> list[Block]:
    text = path.read_text()
    found = []
    for match in FENCE.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        above = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        found.append(Block(f"{path.relative_to(REPO)}:{line}", match[1], above.strip() == GPU_ONLY))
    return found


def distinct(gpu_only: bool) -> list[Block]:
    """Each distinct block once (the README's quickstart is also the Trainer page's), named by its first place."""
    seen: dict[str, Block] = {}
    for path in markdown_files():
        for block in blocks_of(path):
            if block.gpu_only == gpu_only:
                seen.setdefault(block.code, block)
    return list(seen.values())


def test_every_marker_stands_above_a_python_block() -> None:
    """A misspelt or misplaced marker would leave a block unchecked, or check one it was not meant for."""
    for path in markdown_files():
        text = path.read_text()
        markers = sum(line.strip() == GPU_ONLY for line in text.splitlines())
        assert markers == sum(b.gpu_only for b in blocks_of(path)), f"{path}: a {GPU_ONLY} not right above ```python"
    assert len(distinct(gpu_only=False)) >= 3 and len(distinct(gpu_only=True)) >= 2


def run(script: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = without_rendezvous(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    argv = [sys.executable, str(script), *args]
    return subprocess.run(argv, cwd=script.parent, env=env, capture_output=True, text=True, timeout=240)


def several_processes(block: Block) -> bool:
    return "devices=2" in block.code


@pytest.mark.parametrize("block", [b for b in distinct(gpu_only=False) if several_processes(b)], ids=lambda b: b.where)
def test_block_on_two_processes_runs(block: Block, tmp_path: Path) -> None:
    """Lightning starts the second process by running the file again, as it does a user's script."""
    script = tmp_path / "snippet.py"
    script.write_text(block.code)
    done = run(script)
    assert done.returncode == 0, f"{block.where} failed:\n{block.code}\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"


def test_blocks_on_one_process_run(tmp_path: Path) -> None:
    """One interpreter runs them all (importing Lightning once), each block as ``__main__`` in a directory of its
    own."""
    blocks = [b for b in distinct(gpu_only=False) if not several_processes(b)]
    scripts = []
    for index, block in enumerate(blocks):
        (tmp_path / str(index)).mkdir()
        scripts.append(tmp_path / str(index) / "snippet.py")
        scripts[-1].write_text(block.code)
    runner = tmp_path / "runner.py"
    runner.write_text(RUNNER)
    done = run(runner, *map(str, scripts))
    failed = [blocks[int(index)] for index in re.findall(r"^FAILED (\d+)$", done.stdout, re.MULTILINE)]
    assert done.returncode == 0 and not failed, "\n".join(
        [*(f"{b.where} failed:\n{b.code}" for b in failed), done.stdout[-3000:], done.stderr[-6000:]]
    )
    assert done.stdout.count("PASSED") == len(blocks), done.stdout


RUNNER = """
import os, runpy, sys, traceback

for index, script in enumerate(sys.argv[1:]):
    os.chdir(os.path.dirname(script))
    try:
        runpy.run_path(script, run_name="__main__")
        print("PASSED", index, flush=True)
    except BaseException:
        traceback.print_exc()
        print("FAILED", index, flush=True)
"""


@pytest.mark.parametrize("block", distinct(gpu_only=True), ids=lambda b: b.where)
def test_gpu_block_compiles_and_names_what_exists(block: Block) -> None:
    tree = ast.parse(block.code, filename=block.where)
    compile(tree, block.where, "exec")
    statements = [node for node in tree.body if isinstance(node, ast.Import | ast.ImportFrom)]
    imports = ast.Module(body=statements, type_ignores=[])
    namespace: dict[str, object] = {}
    exec(compile(imports, block.where, "exec"), namespace)
    imported = set(namespace) - {"__builtins__"}
    assert imported, f"{block.where} imports nothing to check"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in imported:
            owner = namespace[node.value.id]
            assert hasattr(owner, node.attr), f"{block.where}: `{node.value.id}.{node.attr}` does not exist"


def test_every_chart_is_shown_and_small() -> None:
    """The benchmarks write their charts to ``docs/assets/charts/``: each one there is shown by a page (a chart no page
    shows is stale) and stays small enough for the repository; each page's images exist (as ``mkdocs build --strict``
    also checks)."""
    charts = {path.name: path for path in (DOCS / "assets" / "charts").glob("*.png")}
    shown = {name for path in markdown_files() for name in CHART.findall(path.read_text())}
    assert shown <= set(charts), f"pages show charts that do not exist: {shown - set(charts)}"
    assert set(charts) <= shown, f"charts no page shows: {set(charts) - shown}"
    for path in charts.values():
        assert path.read_bytes().startswith(b"\x89PNG") and path.stat().st_size < 200_000, path


@pytest.mark.parametrize(
    ("page", "module"), [("reference/api.md", lightning_zero), ("reference/fabric.md", fabric)], ids=["api", "fabric"]
)
def test_api_reference_documents_every_public_name(page: str, module: object) -> None:
    text = (DOCS / page).read_text()
    documented = set(re.findall(rf"^::: {re.escape(module.__name__)}\.(\w+)$", text, re.MULTILINE))
    public = {name for name in module.__all__ if name != "fabric"}  # the Fabric module has its own page
    assert documented == public, f"{page}: missing {public - documented}, not public {documented - public}"

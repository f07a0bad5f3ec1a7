"""The codebase's shape: layers whose imports run one way, lint-clean, small modules and functions (the
package's and tools/')."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

PACKAGE = REPO / "captioner"
TOOLS = REPO / "tools"  # outside the package: the demo build, held-out scenes, notebook helpers
# Guides, not cages: a module or function past these is worth a look, and none is exempt.
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 80


def _tool(name: str) -> str:
    path = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed (pip install -e '.[dev]')")
    return path


def test_imports_run_one_way_through_the_layers():
    p = subprocess.run([_tool("lint-imports")], cwd=REPO, capture_output=True, text=True)
    assert p.returncode == 0 and "2 kept, 0 broken" in p.stdout, p.stdout[-3000:]


@pytest.mark.parametrize("check", [["check", "."], ["format", "--check", "."]])
def test_ruff_is_clean(check):
    p = subprocess.run([_tool("ruff"), *check], cwd=REPO, capture_output=True, text=True)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-1000:]


def _layer_of(module: str, layers: list[str]) -> int | None:
    """The index of `module`'s layer in the import-linter contract (None: a module outside the layers)."""
    for k, layer in enumerate(layers):
        if any(module == p or module.startswith(p + ".") for p in (x.strip() for x in layer.split("|"))):
            return k
    return None


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(node: ast.AST) -> list[str]:
    """The captioner modules an import statement names (`from package import name`: the package, and the module
    of that name where there is one)."""
    names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
    names += [a.name for a in node.names] if isinstance(node, ast.Import) else []
    if isinstance(node, ast.ImportFrom) and node.module:  # `from package import module`
        names += [f"{node.module}.{a.name}" for a in node.names]
    return sorted({n for n in names if n.startswith("captioner.")})


def _loaded_on_import() -> dict[str, set[str]]:
    """Each module's imports that run when it is imported: at module level, not in a function, and not under
    `if TYPE_CHECKING:`."""
    graph: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        edges = graph.setdefault(_module_name(path), set())
        pending = list(ast.parse(path.read_text(encoding="utf-8")).body)
        while pending:
            node = pending.pop()
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                pending += node.orelse
                continue
            edges.update(_imported(node))
            pending += [c for c in ast.iter_child_nodes(node) if isinstance(c, ast.stmt)]
    return graph


def test_no_function_import_hides_a_cycle():
    """An import inside a function hides an arrow from the layers' contract: between modules of one layer it
    is how a cycle hides (decode importing search_state importing decode). One that defers a module of its
    own layer, to keep torch off a path that needs none (the ONNX runtime's), is allowed where the module it
    imports does not import, when it is imported, the one importing it. Imports of lower layers inside a
    function (the CLI's optional extras) stay allowed."""
    import tomllib

    config = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    layers = config["tool"]["importlinter"]["contracts"][0]["layers"]
    graph = _loaded_on_import()

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            module = todo.pop()
            if module == goal:
                return True
            if module not in seen:
                seen.add(module)
                todo += graph.get(module, ())
        return False

    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        here = _module_name(path)
        for fn in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                for name in _imported(node) if isinstance(node, (ast.Import, ast.ImportFrom)) else []:
                    same_layer = _layer_of(name, layers) is not None and _layer_of(name, layers) == _layer_of(
                        here, layers
                    )
                    if same_layer and name != here and reaches(name, here):
                        found.append(
                            f"{path.relative_to(REPO)}:{node.lineno} {fn.name} imports {name}, which imports it"
                        )
    assert not found, found


def test_modules_and_functions_are_small():
    long = []
    for path in sorted([*PACKAGE.rglob("*.py"), *TOOLS.rglob("*.py")]):
        source = path.read_text(encoding="utf-8")
        if len(source.splitlines()) > MAX_MODULE_LINES:
            long.append(f"{path.relative_to(REPO)}: {len(source.splitlines())} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name}: {lines} lines")
    assert not long, long


def _parameters(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    a = fn.args
    named = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs if x.arg not in ("self", "cls")]
    return len(named) + bool(a.vararg) + bool(a.kwarg)


@pytest.mark.parametrize("folder, most", [("train", 6), (".", 10)])
def test_functions_take_few_parameters(folder: str, most: int):
    """A run is one object (`train.trainer.Trainer`): what a training function needs travels in it or in a
    config, not in long argument lists; elsewhere what travels together is passed as one (`Trained`, `ImageFiles`)."""
    long = []
    for path in sorted((PACKAGE / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _parameters(node) > most:
                long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name}: {_parameters(node)}")
    assert not long, long


def test_the_formatter_is_never_switched_off():
    """No line is kept from the formatter to stay under a size limit (a table laid out by hand, between
    `# fmt: off` and `# fmt: on`, may be)."""
    found = [
        f"{path.relative_to(REPO)}:{k}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for k, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if re.search(r"#\s*fmt:\s*skip", line)
    ]
    assert not found, found


def test_code_carries_no_measurements():
    """Timings and speed-ups belong to docs/ (with the command and machine that made them), not to the
    package's code, comments or help texts."""
    timing = re.compile(r"\b\d+(\.\d+)?\s?(ms|µs|GFLOP(/s)?)\b|\d(\.\d+)?\s?[×x] (faster|slower|cheaper)")
    found = []
    for path in sorted([*PACKAGE.rglob("*.py"), *TOOLS.rglob("*.py"), REPO / "app.py", REPO / "train.py"]):
        for k, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if timing.search(line):
                found.append(f"{path.relative_to(REPO)}:{k}: {line.strip()}")
    assert not found, found


def test_code_carries_no_history():
    """Issue numbers and dates belong to git and docs/, not to the code."""
    found = []
    code = [
        *PACKAGE.rglob("*.py"),
        *TOOLS.rglob("*.py"),
        *(REPO / "tests").glob("*.py"),
        *(REPO / "benchmarks").glob("*.py"),
    ]
    for path in sorted(p for p in code + [REPO / "app.py", REPO / "train.py"] if p.name != "test_layout.py"):
        for k, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if (
                re.search(r"\bissue[ #]*\d+|\b20[2-3]\d-\d\d-\d\d\b", line, flags=re.IGNORECASE)
                and path.name != "test_layout.py"
            ):
                found.append(f"{path.relative_to(REPO)}:{k}: {line.strip()}")
    assert not found, found


def test_subpackages_are_the_layers():
    subpackages = sorted(p.parent.name for p in PACKAGE.glob("*/__init__.py"))
    assert subpackages == [
        "cli",
        "data",
        "decoding",
        "demo",
        "evaluation",
        "models",
        "objectives",
        "scenes",
        "serve",
        "train",
    ]


@pytest.mark.slow
def test_the_core_install_captions_without_the_extras(tmp_path):
    """Captioning from Python and `captioner caption` need none of [train]'s and [demo]'s packages."""
    for name in ("gradio", "gradio_client", "nltk", "pycocoevalcap", "pycocotools"):
        (tmp_path / f"{name}.py").write_text(f"raise ImportError('{name} is not installed in this test')\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    code = (
        "from captioner import Captioner\nfrom captioner.serve.sources import demo_model, example_images\n"
        "print(Captioner.load(demo_model()).caption(example_images()[0]).text)"
    )
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert p.returncode == 0 and p.stdout.strip(), p.stderr[-2000:]
    example = p.stdout.strip()
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "captioner",
            "caption",
            "--device",
            "cpu",
            str(sorted((PACKAGE / "assets" / "examples").iterdir())[0]),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert p.returncode == 0 and p.stdout.strip().split("\t")[1] == example, p.stderr[-2000:]

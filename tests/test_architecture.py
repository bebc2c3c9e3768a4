"""The layer rule of docs/architecture.md, checked from the code's own imports.

A module imports only from its own layer or below; module-level kbackend imports form no cycle;
an import inside a function only defers a heavy or optional library, with a comment saying so.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "kbackend"

# Top to bottom; keep in step with docs/architecture.md. A module belongs to the first entry
# that is a prefix of its dotted name (relative to kbackend).
LAYERS: list[tuple[str, ...]] = [
    ("__main__", "cli", "commands", "api"),
    # capabilities users run; benchmarks and the advisor measure everything below them
    ("study", "equivalence", "serving", "cache", "bench", "hardware.advise", "hardware.probe"),
    ("engines", "training", "workload"),
    ("hardware", "distributed", "runtime", "progress", "envinfo"),
    ("config", "models", "model_sources", "optim", "precision"),
    ("backends",),
    ("data",),
    ("backend_choice", "history", "io", "errors", "logs", "reports", "stats", "task", "__init__"),
]
# Libraries an import inside a function may defer (slow to import, or optional extras).
DEFERRABLE = {"keras", "tensorflow", "jax", "jaxlib", "optax", "matplotlib", "redis", "ray",
              "pynvml", "mnist1d", "sklearn", "tensorflow_datasets"}
# Frameworks no kbackend module may import when it is imported, outside the backend packages
# (which only ``kbackend.backends.impl()`` imports, once the backend is chosen).
HEAVY = ("keras", "jax", "tensorflow", "optax", "matplotlib")
BACKEND_PACKAGES = ("backends.jax", "backends.tensorflow")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def layer_of(name: str) -> int:
    for index, members in enumerate(LAYERS):
        for member in members:
            if name == member or name.startswith(member + "."):
                return index
    raise AssertionError(f"module kbackend.{name} is in no layer: add it to LAYERS and the doc")


def kbackend_target(node: ast.ImportFrom | ast.Import, known: set[str]) -> list[str]:
    """The kbackend modules an import statement names (relative to kbackend).

    ``from kbackend.X import y`` names module ``X.y`` where that is a module, else ``X``.
    """
    if isinstance(node, ast.Import):
        return [a.name[len("kbackend."):] for a in node.names if a.name.startswith("kbackend.")]
    if node.level or not node.module or not (node.module == "kbackend"
                                             or node.module.startswith("kbackend.")):
        return []
    base = node.module[len("kbackend."):] if node.module != "kbackend" else ""
    found = []
    for alias in node.names:
        candidate = f"{base}.{alias.name}" if base else alias.name
        found.append(candidate if candidate in known else (base or "__init__"))
    return sorted(set(found))


def scan(source: str, known: set[str]) -> tuple[list[tuple[str, int, bool]], list[tuple[str, int, str]]]:
    """(kbackend imports as (target, line, in_function), third-party imports in functions)."""
    tree = ast.parse(source)
    lines = source.splitlines()
    imports: list[tuple[str, int, bool]] = []
    deferred: list[tuple[str, int, str]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef)
            if isinstance(child, ast.Import | ast.ImportFrom):
                targets = kbackend_target(child, known)
                imports.extend((t, child.lineno, in_function) for t in targets)
                if in_function and not targets and not getattr(child, "level", 0):
                    names = ([child.module] if isinstance(child, ast.ImportFrom)
                             else [a.name for a in child.names])
                    for name in names:
                        text = lines[child.lineno - 1] + (lines[child.lineno - 2] if child.lineno > 1 else "")
                        deferred.append((name or "", child.lineno, text))
            visit(child, inside)

    visit(tree, False)
    return imports, deferred


def all_modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def violations(modules: dict[str, str]) -> list[str]:
    """Every breach of the layer rule in ``modules`` (name -> source)."""
    problems = []
    graph: dict[str, set[str]] = {}
    for name, source in modules.items():
        own = layer_of(name)
        imports, deferred = scan(source, set(modules))
        for target, line, in_function in imports:
            if layer_of(target) < own:
                problems.append(f"kbackend.{name}:{line} imports kbackend.{target} from a higher layer")
            if in_function:
                problems.append(f"kbackend.{name}:{line} imports kbackend.{target} inside a function")
            else:
                graph.setdefault(name, set()).add(target)
        for library, line, text in deferred:
            root = library.split(".")[0]
            if root not in DEFERRABLE:
                problems.append(f"kbackend.{name}:{line} defers '{library}', which is not slow or optional")
            elif "#" not in text:
                problems.append(f"kbackend.{name}:{line} defers '{library}' without a comment saying why")
    problems += [f"import cycle: {' -> '.join(cycle)}" for cycle in cycles(graph, set(modules))]
    return problems


def cycles(graph: dict[str, set[str]], known: set[str]) -> list[list[str]]:
    """One cycle per strongly connected group of modules (module-level imports only)."""
    def targets(name: str) -> set[str]:
        # ``from kbackend.data import batching`` names a module or a name in a package.
        return {t for t in graph.get(name, ()) if t in known and t != name}

    found, state = [], {}

    def walk(name: str, path: list[str]) -> None:
        state[name] = "open"
        for target in sorted(targets(name)):
            if state.get(target) == "open":
                found.append([*path[path.index(target):], target])
            elif target not in state:
                walk(target, [*path, target])
        state[name] = "done"

    for name in sorted(known):
        if name not in state:
            walk(name, [name])
    return found


def test_every_module_follows_the_layer_rule():
    modules = {name: path.read_text() for name, path in all_modules().items()}
    assert violations(modules) == []


@pytest.mark.parametrize(("modules", "expected"), [
    ({"data": "from kbackend.engines import loop\n", "engines.loop": ""}, "from a higher layer"),
    ({"engines.loop": "def f():\n    from kbackend.data import batching\n", "data.batching": ""},
     "inside a function"),
    ({"engines.loop": "def f():\n    import numpy\n"}, "not slow or optional"),
    ({"engines.loop": "def f():\n    import keras\n"}, "without a comment"),
    ({"engines.a": "from kbackend.engines import b\n", "engines.b": "from kbackend.engines import a\n"},
     "import cycle"),
])
def test_the_rule_catches_each_kind_of_breach(modules, expected):
    """Negative controls: each kind of breach is reported."""
    assert any(expected in problem for problem in violations(modules))


def heavy_modules_after_importing(modules: list[str]) -> list[str]:
    """The HEAVY frameworks loaded once ``modules`` are imported, in a fresh Python process.

    A fresh process is the point: this test process has long since imported Keras and the rest.
    """
    code = ("import importlib, json, sys\n"
            f"for name in {modules!r}:\n"
            "    importlib.import_module(name)\n"
            f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))")
    done = subprocess.run([sys.executable, "-c", code], cwd=PACKAGE.parent, capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_importing_kbackend_imports_no_framework():
    """Every module but the backend packages (and ``__main__``, which runs the CLI) imports
    cheaply, and none imports Keras before the backend is chosen."""
    names = [f"kbackend.{name}" if name != "__init__" else "kbackend" for name in all_modules()
             if name != "__main__" and not name.startswith(BACKEND_PACKAGES)]
    assert heavy_modules_after_importing(names) == []


def test_the_import_check_sees_a_framework():
    """Negative control: importing a backend package's module loads its framework."""
    assert "jax" in heavy_modules_after_importing(["kbackend.backends.jax.ops"])

"""The layer rule of docs/architecture.md, checked from the code's own imports.

A module imports only from its own layer or below; module-level kbackend imports form no cycle,
counted per module and per top-level unit (``kbackend/<name>``, a module or a package); an import
inside a function only defers a heavy or optional library, with a comment saying so; and no code
outside ``kbackend/backends/`` branches on a backend's name (it calls ``backends.impl()``).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "kbackend"

# Top to bottom; keep in step with docs/architecture.md. Each entry is a top-level unit
# (``kbackend/<name>.py`` or the package ``kbackend/<name>/``): a module belongs to the layer of
# its unit, so the rule holds between packages as well as between modules.
LAYERS: list[tuple[str, ...]] = [
    ("__main__", "cli", "commands", "api"),
    ("bench",),  # the one benchmark runner: an application of everything below it
    ("study", "equivalence", "serving", "cache", "advise"),  # the capabilities users run
    ("engines", "training"),
    ("hardware", "distributed", "runtime", "progress", "envinfo", "tensorboard_logs"),
    ("config", "models", "model_sources", "workload", "host_front"),
    ("backends",),  # ALL backend-specific code (optax included) sits above the backend-free maths
    ("optim", "precision", "data", "adaptive", "engine_facts"),
    ("backend_choice", "history", "io", "errors", "logs", "reports", "stats", "task", "sqlite",
     "digests", "escaping", "__init__"),
]
# Libraries an import inside a function may defer (slow to import, or optional extras;
# ``scipy.stats`` alone takes ~0.6 s).
DEFERRABLE = {"keras", "tensorflow", "jax", "jaxlib", "optax", "matplotlib", "redis", "ray",
              "pynvml", "mnist1d", "sklearn", "scipy", "tensorflow_datasets", "PIL",
              "tensorboard", "pandas"}
# Frameworks no kbackend module may import when it is imported, outside the backend packages
# (which only ``kbackend.backends.impl()`` imports, once the backend is chosen).
HEAVY = ("keras", "jax", "tensorflow", "optax", "matplotlib")
BACKEND_PACKAGES = ("backends.jax", "backends.tensorflow")
# Backend names no code outside ``backends`` compares anything with; ``backend_choice`` is where
# the name is read and checked (``KERAS_BACKEND``), before any backend package is imported.
BACKEND_NAMES = ("jax", "tensorflow")
MAY_NAME_BACKENDS = ("backends", "backend_choice")
# Likewise engine names: outside ``engines`` and its table of facts (``engine_facts``), code
# reads an engine's facts (``engine_facts(name).fuses_steps``), never compares its name nor
# keeps its own set of names. Argparse ``choices=`` and help text name engines without
# comparing; ``serving.export`` compares an export format, ``"keras"``, not an engine, and
# ``"keras" in sys.modules`` asks after the library.
ENGINE_NAMES = ("keras", "native", "data_parallel", "keras_data_parallel")
MAY_NAME_ENGINES = ("engines", "engine_facts")
NOT_ENGINES = {("serving.export", "keras")}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def unit_of(name: str) -> str:
    """The top-level unit of module ``name`` (relative to kbackend):
    ``engines.loop`` -> ``engines``."""
    return name.split(".")[0]


def layer_of(name: str) -> int:
    for index, members in enumerate(LAYERS):
        if unit_of(name) in members:
            return index
    raise AssertionError(f"module kbackend.{name} is in no layer: add {unit_of(name)!r} to "
                         "LAYERS and the doc")


def backend_branches(source: str, names: tuple[str, ...] = BACKEND_NAMES,
                     allowed: frozenset[str] = frozenset()) -> list[tuple[int, str]]:
    """(line, code) of each comparison with a backend's name (``backend == "jax"``,
    ``name in ("jax", "tensorflow")``) and each ``case "jax":``: a branch on the backend (on
    ``names``, less ``allowed``)."""
    def names_a_backend(node: ast.AST) -> bool:
        if isinstance(node, ast.Constant):
            return node.value in names and node.value not in allowed
        return (isinstance(node, ast.Tuple | ast.List | ast.Set)
                and any(map(names_a_backend, node.elts)))

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and any(
                names_a_backend(side) for side in [node.left, *node.comparators]):
            found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.match_case) and any(
                isinstance(value, ast.MatchValue) and names_a_backend(value.value)
                for value in ast.walk(node.pattern)):
            found.append((node.pattern.lineno, f"case {ast.unparse(node.pattern)}"))
    return found


def engine_name_breaches(name: str, source: str) -> list[str]:
    """Each comparison with an engine's name in module ``name``, and each collection of engine
    names only (``MONITORED = ("keras", "native")``: a fact kept beside the table)."""
    allowed = frozenset(value for module, value in NOT_ENGINES if module == name)
    found = [(line, code, "compares an engine's name")
             for line, code in backend_branches(source, ENGINE_NAMES, allowed)
             if "sys.modules" not in code]  # the library keras is imported, not the engine
    for node in ast.walk(ast.parse(source)):
        items = (node.keys if isinstance(node, ast.Dict)
                 else node.elts if isinstance(node, ast.Tuple | ast.List | ast.Set) else [])
        if items and all(isinstance(item, ast.Constant) and item.value in ENGINE_NAMES
                         for item in items):
            found.append((node.lineno, ast.unparse(node)[:60], "keeps a set of engine names"))
    return [f"kbackend.{name}:{line} {what} ({code}): read a fact of "
            "kbackend.engine_facts instead" for line, code, what in found]


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


def scan(source: str,
         known: set[str]) -> tuple[list[tuple[str, int, bool]], list[tuple[str, int, str]]]:
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
                    above = lines[child.lineno - 2] if child.lineno > 1 else ""
                    for name in names:
                        text = lines[child.lineno - 1] + above
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
        if unit_of(name) not in MAY_NAME_BACKENDS:
            problems += [f"kbackend.{name}:{line} branches on the backend's name ({code}): call "
                         "kbackend.backends.impl() (or a backend-free table in kbackend/backends/)"
                         for line, code in backend_branches(source)]
        if unit_of(name) not in MAY_NAME_ENGINES:
            problems += engine_name_breaches(name, source)
        for target, line, in_function in imports:
            where = f"kbackend.{name}:{line}"
            if layer_of(target) < own:
                problems.append(f"{where} imports kbackend.{target} from a higher layer")
            if in_function:
                problems.append(f"{where} imports kbackend.{target} inside a function")
            else:
                graph.setdefault(name, set()).add(target)
        for library, line, text in deferred:
            root = library.split(".")[0]
            where = f"kbackend.{name}:{line}"
            if root not in DEFERRABLE:
                problems.append(f"{where} defers '{library}', which is not slow or optional")
            elif "#" not in text:
                problems.append(f"{where} defers '{library}' without a comment saying why")
    problems += [f"import cycle: {' -> '.join(cycle)}" for cycle in cycles(graph, set(modules))]
    units = {unit_of(name) for name in modules}
    problems += [f"package cycle: {' -> '.join(cycle)} (kbackend/<name> units)"
                 for cycle in cycles(unit_graph(graph), units)]
    return problems


def unit_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The module graph seen between top-level units: ``a`` imports ``b`` when any module of
    ``a`` imports any module of ``b`` (at module level; a unit's own imports are left out)."""
    units: dict[str, set[str]] = {}
    for name, targets in graph.items():
        own = unit_of(name)
        units.setdefault(own, set()).update(unit_of(t) for t in targets if unit_of(t) != own)
    return units


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


def test_the_layers_are_top_level_units():
    """Every layer entry is a whole ``kbackend/<name>``, so no package spans two layers and the
    rule between modules is the rule between packages; every unit has a layer."""
    entries = [entry for layer in LAYERS for entry in layer]
    assert [entry for entry in entries if "." in entry] == []
    assert len(entries) == len(set(entries))
    units = {unit_of(name) for name in all_modules()}
    assert sorted(units - set(entries)) == []


@pytest.mark.parametrize(("modules", "expected"), [
    ({"data": "from kbackend.engines import loop\n", "engines.loop": ""}, "from a higher layer"),
    ({"engines.loop": "def f():\n    from kbackend.data import batching\n", "data.batching": ""},
     "inside a function"),
    ({"engines.loop": "def f():\n    import numpy\n"}, "not slow or optional"),
    ({"engines.loop": "def f():\n    import keras\n"}, "without a comment"),
    ({"engines.a": "from kbackend.engines import b\n",
      "engines.b": "from kbackend.engines import a\n"}, "import cycle"),
    # acyclic module by module (core -> model, export -> keys), a cycle between the packages
    ({"cache.core": "from kbackend.serving import model\n", "serving.model": "",
      "serving.export": "from kbackend.cache import keys\n", "cache.keys": ""}, "package cycle"),
    ({"commands.launch": "from kbackend.backend_choice import selected_backend\n"
                         "if selected_backend() == 'tensorflow':\n    pass\n",
      "backend_choice": ""}, "branches on the backend's name"),
    ({"training": "def f(backend):\n    return 1 if backend in ('jax', 'tensorflow') else 0\n"},
     "branches on the backend's name"),
    ({"engines.loop": "def f(backend):\n    match backend:\n        case 'jax':\n"
                      "            return 1\n"}, "branches on the backend's name"),
    ({"study.executor": "def f(config):\n    return config.engine == 'native'\n"},
     "compares an engine's name"),
    ({"config": "def f(engine):\n    return engine not in ('native', 'data_parallel')\n"},
     "compares an engine's name"),
    ({"api": "def f(engine):\n    match engine:\n        case 'keras':\n            return 1\n"},
     "compares an engine's name"),
    ({"study.executor": "EPOCH_EVAL = frozenset({'keras'})\n"}, "keeps a set of engine names"),
    ({"distributed": "TWINS = {'keras': 1, 'native': 2}\n"}, "keeps a set of engine names"),
    # the export format "keras" is not an engine, but "native" in the same module is
    ({"serving.export": "def f(fmt):\n    return fmt == 'native'\n"},
     "compares an engine's name"),
])
def test_the_rule_catches_each_kind_of_breach(modules, expected):
    """Negative controls: each kind of breach is reported."""
    assert any(expected in problem for problem in violations(modules))


def test_a_package_cycle_is_not_a_module_cycle():
    """The planted package cycle above is seen only at the package level (the module graph has
    no cycle), and the backend packages may name their backend."""
    planted = {"cache.core": "from kbackend.serving import model\n", "serving.model": "",
               "serving.export": "from kbackend.cache import keys\n", "cache.keys": ""}
    assert [p for p in violations(planted) if "cycle" in p] == [
        "package cycle: cache -> serving -> cache (kbackend/<name> units)"]
    assert violations({"backends.cluster": "def f(name):\n    return name == 'jax'\n"}) == []


def test_breaches_planted_in_the_real_code_are_caught():
    """Negative controls on the code itself: the cycle issue 38 removed (hardware's probe
    training a model, while engines use the hardware monitor) and the launcher's old branch."""
    modules = {name: path.read_text() for name, path in all_modules().items()}
    modules["hardware.probe"] += "\nfrom kbackend.training import train\n"
    modules["commands.launch"] += "\nif selected_backend() == 'tensorflow':\n    pass\n"
    modules["study.frontier"] += "\nNATIVE = runner.config.engine != 'native'\n"
    problems = violations(modules)
    assert any(p.startswith("kbackend.study.frontier:") and "engine's name" in p
               for p in problems), problems
    assert any(p.startswith("package cycle:") and "hardware" in p and "training" in p
               for p in problems), problems
    assert any(p.startswith("kbackend.commands.launch:") and "backend's name" in p
               for p in problems), problems


def test_engine_names_may_be_named_without_being_compared(tmp_path):
    """A planted engine-name branch written to a file is caught; what only names engines is not:
    argparse choices and help, a default, the table itself, the export format "keras"."""
    planted = tmp_path / "frontier.py"
    planted.write_text("def supported(runner):\n"
                       "    return runner.config.engine == 'native'\n")
    assert violations({"study.frontier": planted.read_text()}) == [
        "kbackend.study.frontier:2 compares an engine's name "
        "(runner.config.engine == 'native'): read a fact of kbackend.engine_facts instead"]
    naming = ("def add(parser):\n"
              "    parser.add_argument('--engine', default='native', choices=['native', 'x'],\n"
              "                        help='native: fused; keras: fit')\n"
              "    return 'keras' if parser else 'native'\n")
    assert violations({"commands.train": naming}) == []
    assert violations({"engine_facts": "FACTS = {'keras': 1, 'native': 2}\n",
                       "engines.loop": "def f(e):\n    return e == 'native'\n",
                       "serving.export": "def f(fmt):\n    return fmt == 'keras'\n",
                       "envinfo": "import sys\nLOADED = 'keras' in sys.modules\n"}) == []


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

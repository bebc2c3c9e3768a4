"""The measured goals of issue 44 ("One house, round two"), read off a checkout: each concern
the review found with two or more mechanisms and the rule that detects it, functions over 60
lines, ``dict[str, Any]`` in kbackend/study/, engine-name comparisons outside engines/, package
cycles, and kbackend/'s lines against the review's tree.

    python scripts/house_goals.py [--list]

Each concern's rule counts mechanisms (AST or text, over kbackend/*.py unless it says tests/);
a concern is "one place" at a count of 1 (0: the concern is gone). ``--list`` names each long
function and each engine-name comparison.

Results as dicts in kbackend/study/: every ``dict[str, Any]``, plus every ``JsonObject``
(``kbackend.io``'s alias for a JSON boundary) that is not at one. A ``JsonObject`` is at a JSON
boundary when it is in study/store.py (the store itself) or inside a function named in
``JSON_BOUNDARIES`` (a record's ``to_json`` / ``from_json`` / ``to_dict`` / ``from_dict``, the
store's payload hand-over ``stored_or_measured``, the hashed key configurations, the stored
trajectories read back, summary.json's payload); those are counted apart ("JSON boundaries").
A ``JsonObject`` anywhere else (a stored row read by a study function, a summary.json read
back by ``study compare``) counts as a result travelling as a dict.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout

from tests.test_architecture import (  # noqa: E402
    all_modules,
    engine_name_breaches,
    violations,
)

REVIEW_LINES = 28_896  # kbackend/ at 4eb9dcc, the review's tree
JSON_BOUNDARIES = frozenset({
    "to_json", "from_json", "to_dict", "from_dict", "stored_or_measured", "run_key_config",
    "content_identity", "plan_from_key_config", "trajectory_record", "history_from_trajectory",
    "summary_payload"})
LONG_FUNCTION = 60


def sources(folder: str = "kbackend") -> dict[Path, str]:
    """Every .py file under ``folder`` of the checkout and its text."""
    return {p: p.read_text() for p in sorted((ROOT / folder).rglob("*.py"))}


def count(pattern: str, folder: str = "kbackend", exclude: str | None = None) -> int:
    """Files under ``folder`` (not under ``exclude``) whose text matches ``pattern``."""
    regex = re.compile(pattern, re.MULTILINE)
    return sum(1 for path, text in sources(folder).items()
               if regex.search(text) and not (exclude and exclude in path.as_posix()))


def study_dicts() -> tuple[int, int]:
    """(results as dicts, JSON boundaries) in kbackend/study/: ``dict[str, Any]`` plus each
    ``JsonObject`` outside a JSON boundary, and the ``JsonObject`` s at one (module doc)."""
    as_dicts = boundaries = 0
    for path, text in sources("kbackend/study").items():
        lines = text.splitlines()
        at_boundary = [path.name == "store.py"] * len(lines)
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) \
                    and node.name in JSON_BOUNDARIES:
                for index in range(node.lineno - 1, node.end_lineno or node.lineno):
                    at_boundary[index] = True
        for line, boundary in zip(lines, at_boundary, strict=True):
            uses = len(re.findall(r"\bJsonObject\b", line.split("#")[0]))
            if line.lstrip().startswith(("from ", "import ")):
                uses = 0  # the import itself
            as_dicts += line.count("dict[str, Any]") + (0 if boundary else uses)
            boundaries += uses if boundary else 0
    return as_dicts, boundaries


def long_functions() -> list[str]:
    """``path:line name (lines)`` of every function over ``LONG_FUNCTION`` lines."""
    found = []
    for path, text in sources().items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > LONG_FUNCTION:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({length})")
    return found


def engine_comparisons() -> list[str]:
    """Each engine-name comparison or set of engine names outside engines/ and engine_facts:
    the architecture test's own rule (``tests.test_architecture.engine_name_breaches``)."""
    found = []
    for name, path in all_modules().items():
        if name.startswith("engines") or name == "engine_facts":
            continue
        found += engine_name_breaches(name, path.read_text())
    return found


# A file telling built-in from user model or data itself: a name tested against the built-in
# registries, or a source's class or kind tested (``isinstance(s, BuiltinModel)``,
# ``model_kind(m) is BuiltinModel``, ``.kind == "builtin"``) instead of asking the source
# (``data.named.data_source``, ``ModelSource``'s members).
BUILTIN_FORK = re.compile(
    r"\bis_builtin\(|\bin (MODELS|DATASETS|data_module\.DATASETS)\b(?!\[)"
    r"|isinstance\([^)]*\b(BuiltinModel|BuiltinData|OwnData)\b"
    r"|\bis (not )?(BuiltinModel|BuiltinData|OwnData)\b"
    r"|\.kind\s*[!=]=\s*[\"']builtin[\"']")


def builtin_forks() -> list[str]:
    """Files outside the sources' own dispatch (data/, model_sources.py, models.py, workload.py;
    bench/ iterates the registries) that tell built-in from user model or data themselves
    (``BUILTIN_FORK``)."""
    dispatch = ("kbackend/data/", "kbackend/model_sources.py", "kbackend/models.py",
                "kbackend/workload.py", "kbackend/bench/")
    return [str(path.relative_to(ROOT)) for path, text in sources().items()
            if BUILTIN_FORK.search(text) and not any(d in path.as_posix() for d in dispatch)]


# (concern, detection rule in words, mechanisms counted)
CONCERNS: list[tuple[str, str, Callable[[], int]]] = [
    ("engine facts", "modules outside engines/ comparing engine names (the architecture rule), "
     "beside kbackend.engine_facts", lambda: len({c.split(":")[0] for c in engine_comparisons()})
     + 1),
    ("steps per epoch / budget", "files with `-(-max_steps // per_epoch)` style ceilings "
     "outside engines/", lambda: count(r"-\(-\s*\w*max_steps\w*\s*//", exclude="engines/") + 1),
    ("plan types", "classes named *Plan holding a batch size",
     lambda: count(r"^class \w*Plan\b.*:\n(?:.*\n){0,30}?\s+batch_size:")),
    ("JAX train steps", "functions make_*step in backends/jax",
     lambda: count(r"^def make_(adaptive_)?step\(", "kbackend/backends/jax")),
    ("noise-scale estimators", "functions estimating B_simple (def b_simple / "
     "estimate_noise_scale)", lambda: count(r"def (b_simple|estimate_noise_scale)\(")),
    ("model loaders", "functions named load_model outside model_sources.py",
     lambda: count(r"^def load_model\(", exclude="model_sources.py") + 1),
    ("SQLite set-up", "files calling sqlite3.connect", lambda: count(r"sqlite3\.connect\(")),
    ("measurement harness", "files calling the per-machine store (machine_measurement) "
     "outside the harness, beside kbackend/hardware/measure.py",
     lambda: count(r"machine_measurement\(", exclude="hardware/measure.py") + 1),
    ("runtime subclass for Ray", "object.__new__ in study/", lambda: count(
        r"object\.__new__\(", "kbackend/study") + 1),
    ("tests replacing StudyRunner.execute", "test files patching StudyRunner's execute",
     lambda: count(r"setattr\(StudyRunner, \"execute\"", "tests") + 1),
    ("built-in vs user model and data", "files outside the sources' dispatch testing a name "
     "against MODELS / DATASETS or a source's class or kind (BUILTIN_FORK), beside the dispatch",
     lambda: len(builtin_forks()) + 1),
    ("user errors", "files raising bare ValueError/RuntimeError/TypeError beside KBackendError",
     lambda: count(r"raise (ValueError|RuntimeError|TypeError)\(") + 1),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="name each long function and "
                        "engine-name comparison")
    args = parser.parse_args()
    print("| concern | detection rule | mechanisms |\n| --- | --- | --- |")
    several = 0
    for concern, rule, measure in CONCERNS:
        mechanisms = measure()
        several += mechanisms >= 2
        print(f"| {concern} | {rule} | {mechanisms} |")
    long = long_functions()
    compares = engine_comparisons()
    as_dicts, json_boundaries = study_dicts()
    lines = sum(text.count("\n") for text in sources().values())
    cycles = [p for p in violations({name: path.read_text()
                                     for name, path in all_modules().items()}) if "cycle" in p]
    print(f"\nconcerns with two or more mechanisms: {several} (goal <= 3)")
    print(f"functions over {LONG_FUNCTION} lines: {len(long)} (goal <= 8)")
    print(f"dict[str, Any] in kbackend/study/ (results as dicts): {as_dicts} (goal <= 40)")
    print(f"JSON boundaries (JsonObject) in kbackend/study/: {json_boundaries}")
    print(f"engine-name comparisons outside engines/: {len(compares)} (goal 0)")
    print(f"package and import cycles: {len(cycles)} (goal 0)")
    print(f"kbackend/ lines: {lines:,} ({lines - REVIEW_LINES:+,} against 4eb9dcc's "
          f"{REVIEW_LINES:,})")
    if args.list:
        print("\n".join(["", "long functions:", *long, "", "engine-name comparisons:",
                         *compares]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

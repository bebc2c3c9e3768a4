"""Start-up profile of ``kbackend train``: what a whole process spends before and around training.

    python scripts/profile_startup.py [--backends jax,tensorflow] [--repeats N] [--out DIR]
                                      [--quick]

Runs the recipe of ``scripts/bench_time_to_target.py`` (MNIST to 0.97 validation accuracy; needs
``KBACKEND_DATA_DIR``; ``--quick``: digits to 0.9) as whole processes, per backend:

1. under ``python -X importtime``: the import tree, cut by the library each first import
   brings in and the kbackend module that asked for it (``kbackend: ...`` rows), and the sum of
   kbackend's own modules' self times;
2. under a phase timer (``PHASE_DRIVER``, this process's child): ``time.perf_counter`` around
   the set-up steps (the command line's import, argument parsing, the Keras import, the
   backend package's import, data loading, model build, the trainer's set-up with the device
   copies, each compiled call, the first and later validations, the test evaluation, the
   history), with a cold and then a warm compilation cache. What the wrappers do not cover is
   reported as "other"; the interpreter's start and exit are the process's wall time less what
   ran between them.

The wrappers only time (``functools.wraps``, the same arguments, results and exceptions); a
step a refactoring renamed is left out of the table, not an error. Figures are medians of
``--repeats``; the machine's load (``os.getloadavg``) is recorded beside them.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from kbackend.bench.time_to_target import EVAL_EVERY, QUICK_RECIPE, RECIPES

# The child: ``python -m kbackend`` with timers around named functions. Set-up steps are
# wrapped where they are looked up at call time (a module's global, a class's method).
PHASE_DRIVER = r'''
import atexit, functools, importlib, json, os, sys, time
T0 = time.perf_counter()
EVENTS = []  # (name, start, end) relative to T0

def timed(owner, attribute, name):
    original = getattr(owner, attribute, None)
    if original is None or getattr(original, "__wrapped_by_profile__", False):
        return False
    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            EVENTS.append((name, start - T0, time.perf_counter() - T0))
    wrapper.__wrapped_by_profile__ = True
    setattr(owner, attribute, wrapper)
    return True

def module_targets(module_name, targets):
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return
    for path, name in targets:
        owner = module
        *parents, attribute = path.split(".")
        for parent in parents:
            owner = getattr(owner, parent, None)
        if owner is not None:
            timed(owner, attribute, name)

def dump():
    with open(os.environ["KBACKEND_PROFILE_OUT"], "w") as out:
        json.dump({"events": EVENTS, "end": time.perf_counter() - T0}, out)

atexit.register(dump)  # registered first, so it runs after every other exit handler
import kbackend.cli
EVENTS.append(("import kbackend.cli", 0.0, time.perf_counter() - T0))
module_targets("kbackend.cli", [("build_parser", "parse arguments (parser)"),
                                ("use_backend", "import Keras (use_backend)")])
module_targets("kbackend.backends", [("backend_package", "import the backend package")])
module_targets("kbackend.distributed", [("prepare", "devices (distributed.prepare)")])
module_targets("kbackend.training", [("workload_of", "load the data (workload_of)"),
                                     ("check_model_fits", "memory check"),
                                     ("build_model", "build the model"),
                                     ("environment", "environment for the history"),
                                     ("History.save", "write the history")])
module_targets("kbackend.engines.native", [("compile_model", "Keras compile of the model"),
                                           ("cached_probe_fused_steps", "fused-steps probe")])
module_targets("kbackend.engines.loop", [("run", "engine loop (loop.run)")])
_packages = __import__("kbackend.backends", fromlist=["backend_package"])
_package_of = _packages.backend_package

def _patch_trainer(name):
    package = _package_of(name)
    trainer = getattr(package, "native_trainer", None)
    if isinstance(trainer, type):
        for attribute, label in (("__init__", "trainer set-up (device copies)"),
                                 ("put_epoch", "put an epoch's order"),
                                 ("compile", "compile a call"), ("run", "dispatch a call"),
                                 ("fetch", "wait for a call"), ("evaluate", "validation"),
                                 ("evaluate_test", "test evaluation")):
            timed(trainer, attribute, label)
    return package

_packages.backend_package = functools.wraps(_package_of)(_patch_trainer)  # timed inside
sys.argv = ["kbackend", *sys.argv[1:]]
kbackend.cli.entrypoint()
'''

PHASE_ORDER = ("import kbackend.cli", "parse arguments (parser)", "import Keras (use_backend)",
               "devices (distributed.prepare)", "import the backend package", "load the data",
               "memory check", "build the model", "Keras compile of the model",
               "fused-steps probe", "trainer set-up (device copies)", "put an epoch's order",
               "compile a call", "dispatch a call", "wait for a call", "validation",
               "test evaluation", "environment for the history", "write the history")
NESTED = {"import the backend package": "devices (distributed.prepare)"}
# The loop's own phases are inside "engine loop (loop.run)"; test evaluation runs after it.


def recipe_argv(quick: bool, backend: str, history: Path) -> list[str]:
    """``kbackend train`` arguments of bench_time_to_target's kbackend side."""
    recipe = QUICK_RECIPE if quick else RECIPES[backend]
    dataset, target = ("digits", 0.9) if quick else ("mnist", 0.97)
    return ["train", "--quiet", "--model", "seed_mlp", "--dataset", dataset, "--engine",
            "native", "--optimizer", "adam", "--lr", str(recipe["lr"]), "--batch-size",
            str(recipe["batch_size"]), "--fused-steps", str(recipe["fused_steps"]),
            "--eval-every", str(recipe.get("eval_every", EVAL_EVERY)), "--epochs",
            "20" if quick else "10", "--target", str(target), "--history", str(history)]


def parse_importtime(text: str) -> list[tuple[int, int, str, int]]:
    """``-X importtime`` lines as (self us, cumulative us, module, depth), in printed order
    (a module after the modules it imported)."""
    entries = []
    for line in text.splitlines():
        match = re.match(r"import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)", line)
        if match:
            entries.append((int(match[1]), int(match[2]), match[4], len(match[3]) // 2))
    return entries


def import_summary(entries: list[tuple[int, int, str, int]]) -> dict[str, Any]:
    """Totals and the first imports of each library, with the kbackend module that caused
    them (its nearest kbackend importer; none: a deferred import inside a function)."""
    parents: list[int | None] = [None] * len(entries)
    waiting: list[int] = []
    for index, (_, _, _, depth) in enumerate(entries):
        while waiting and entries[waiting[-1]][3] > depth:
            parents[waiting.pop()] = index
        waiting.append(index)

    def kbackend_importer(index: int) -> str | None:
        parent = parents[index]
        while parent is not None:
            if entries[parent][2].startswith("kbackend"):
                return entries[parent][2]
            parent = parents[parent]
        return None

    groups: dict[tuple[str, str | None], float] = collections.defaultdict(float)
    for index, (_, cumulative, name, _) in enumerate(entries):
        root, parent = name.split(".")[0], parents[index]
        if root == "kbackend" or (parent is not None
                                  and entries[parent][2].split(".")[0] == root):
            continue  # inside its own library: counted with the library's first import
        groups[(root, kbackend_importer(index))] += cumulative / 1e6
    kbackend_self = sum(e[0] for e in entries if e[2].split(".")[0] == "kbackend") / 1e6
    rows = sorted(({"library": root, "imported_by": by or "-", "seconds": seconds}
                   for (root, by), seconds in groups.items()), key=lambda r: -r["seconds"])
    return {"total_s": sum(e[0] for e in entries) / 1e6, "kbackend_self_s": kbackend_self,
            "kbackend_modules": sum(e[2].split(".")[0] == "kbackend" for e in entries),
            "modules": len(entries), "libraries": rows}


def _environment(backend: str, cache: Path) -> dict[str, str]:
    # As bench_time_to_target's processes: offline, bytecode on, the compilation cache on.
    return {**os.environ, "KERAS_BACKEND": backend, "KBACKEND_OFFLINE": "1",
            "TF_CPP_MIN_LOG_LEVEL": "2", "KBACKEND_COMPILE_CACHE": "1",
            "KBACKEND_CACHE_DIR": str(cache), "PYTHONDONTWRITEBYTECODE": ""}


def _run(argv: list[str], env: dict[str, str]) -> tuple[float, subprocess.CompletedProcess]:
    start = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=1800)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{argv[1:4]} failed ({done.returncode}): {done.stderr[-2000:]}")
    return seconds, done


def phase_run(argv: list[str], env: dict[str, str], folder: Path) -> dict[str, Any]:
    """One whole process under the phase timer: per phase its total, first call and count."""
    out = folder / "phases.json"
    wall, _ = _run([sys.executable, "-c", PHASE_DRIVER, *argv], {
        **env, "KBACKEND_PROFILE_OUT": str(out)})
    record = json.loads(out.read_text())
    phases: dict[str, dict[str, float]] = {}
    for name, start, end in record["events"]:
        phase = phases.setdefault(name, {"total_s": 0.0, "first_s": end - start, "calls": 0})
        phase["total_s"] += end - start
        phase["calls"] += 1
    history = json.loads(Path(argv[argv.index("--history") + 1]).read_text())
    return {"wall_s": wall, "driver_s": record["end"], "phases": phases,
            "timing": history["timing"]}


def profile_backend(backend: str, repeats: int, quick: bool) -> dict[str, Any]:
    """Import profile and phase timings (cold and warm compilation cache) of one backend."""
    result: dict[str, Any] = {"backend": backend, "runs": []}
    with tempfile.TemporaryDirectory(prefix="kbackend-startup-") as tmp:
        folder = Path(tmp)
        history = folder / "history.json"
        argv = recipe_argv(quick, backend, history)
        # Untimed: writes the bytecode every later process reads, as bench_time_to_target does.
        _run([sys.executable, "-m", "kbackend", *argv], _environment(backend, folder / "c0"))
        _, done = _run([sys.executable, "-X", "importtime", "-m", "kbackend", *argv],
                       _environment(backend, folder / "c1"))
        result["imports"] = import_summary(parse_importtime(done.stderr))
        bare = [_run([sys.executable, "-c", "pass"], os.environ.copy())[0] for _ in range(3)]
        result["bare_interpreter_s"] = statistics.median(bare)
        for repeat in range(repeats):
            cache = folder / f"cache-{repeat}"
            for kind in ("cold", "warm"):
                run = phase_run(argv, _environment(backend, cache), folder)
                result["runs"].append({"repeat": repeat, "cache": kind,
                                       "load": os.getloadavg()[0], **run})
    return result


def _median_phase(runs: list[dict[str, Any]], name: str, field: str) -> float | None:
    values = [r["phases"][name][field] for r in runs if name in r["phases"]]
    return statistics.median(values) if values else None


def report(results: list[dict[str, Any]]) -> str:
    """Markdown: the import profile and the phase table, per backend."""
    lines = []
    for result in results:
        imports = result["imports"]
        lines += [f"## {result['backend']}", "",
                  f"`-X importtime`: {imports['total_s']:.2f} s in {imports['modules']} modules; "
                  f"kbackend's own {imports['kbackend_modules']} modules "
                  f"{imports['kbackend_self_s']:.3f} s (self times); a bare interpreter "
                  f"{result['bare_interpreter_s']:.3f} s", "",
                  "| library (first import) | imported by | s |", "| --- | --- | --- |"]
        lines += [f"| {r['library']} | {r['imported_by']} | {r['seconds']:.3f} |"
                  for r in imports["libraries"] if r["seconds"] >= 0.005]
        lines += ["", "| phase | " + " | ".join(
            f"{cache}: total s (first call s, calls)" for cache in ("cold", "warm")) + " |",
            "| --- | --- | --- |"]
        by_cache = {cache: [r for r in result["runs"] if r["cache"] == cache]
                    for cache in ("cold", "warm")}
        names = [n for n in PHASE_ORDER if any(n in r["phases"] for r in result["runs"])]
        names.append("engine loop (loop.run)")
        for name in names:
            cells = []
            for runs in by_cache.values():
                total = _median_phase(runs, name, "total_s")
                first = _median_phase(runs, name, "first_s")
                calls = _median_phase(runs, name, "calls")
                cells.append("-" if total is None else
                             f"{total:.3f} ({first:.3f}, {calls:g})")
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        for label, field in (("process wall", "wall_s"), ("driver (start to exit handlers)",
                                                          "driver_s")):
            cells = [f"{statistics.median(r[field] for r in runs):.3f}"
                     for runs in by_cache.values()]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        loads = [r["load"] for r in result["runs"]]
        lines += ["", f"1-minute load average during the runs: {min(loads):.2f}-{max(loads):.2f}",
                  ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="jax,tensorflow")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="digits to 0.9 (no MNIST needed)")
    parser.add_argument("--out", default=None, help="folder for startup_profile.{json,md}")
    args = parser.parse_args(argv)
    results = [profile_backend(backend, args.repeats, args.quick)
               for backend in args.backends.split(",")]
    text = report(results)
    print(text)
    if args.out:
        folder = Path(args.out)
        folder.mkdir(parents=True, exist_ok=True)
        machine = {"python": sys.version.split()[0], "platform": platform.platform(),
                   "processor": platform.processor(), "cpus": os.cpu_count()}
        (folder / "startup_profile.json").write_text(
            json.dumps({"machine": machine, "results": results}, indent=1))
        (folder / "startup_profile.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

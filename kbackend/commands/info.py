"""``kbackend info``: backend, versions, devices, image data format, XLA-related flags and the
measurements kept per machine (the probes ``--reprobe`` takes again)."""

from __future__ import annotations

import argparse
from typing import Any

from kbackend.backend_choice import backend_source
from kbackend.backends.compile_cache import measurement_path, stored_measurements
from kbackend.engines.adaptive import KNEE_PROBE_FILE
from kbackend.engines.native import PROBE_CACHE_FILE
from kbackend.envinfo import device_summary, environment
from kbackend.io import strict_json_text
from kbackend.study.populations import POPULATION_PROBE_FILE


def register(subparsers: argparse._SubParsersAction, parents: list) -> None:
    parser = subparsers.add_parser("info", parents=parents,
                                   help="show backend, versions and devices")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser.set_defaults(func=run)


# The per-machine stores (``compile_cache.machine_measurement``) and what each entry answers.
PROBE_FILES = {"fused steps": PROBE_CACHE_FILE, "throughput knee": KNEE_PROBE_FILE,
               "population": POPULATION_PROBE_FILE}


def describe_probe(kind: str, entry: dict[str, Any]) -> str:
    """One line of a stored probe's answer."""
    if kind == "fused steps":
        return f"K={entry.get('fused_steps')}"
    if kind == "population":
        return f"{entry.get('path')} ({entry.get('members')} members)"
    if not entry.get("resolved"):
        answer = "unresolved (noisy)" if "resolved" in entry else f"{entry.get('knee')} (old)"
    else:
        answer = str(entry["knee"])
    sizes = entry.get("sizes") or []
    span = f", sizes {sizes[0]}-{sizes[-1]}" if sizes else ""
    return (f"knee {answer}{span}, noisy {'yes' if entry.get('noisy') else 'no'}, "
            f"re-measured {entry.get('remeasured', 0)}")


def stored_probes() -> dict[str, dict[str, str]]:
    """Every stored probe: ``{kind: {key prefix: its answer}}``."""
    return {kind: {key[:12]: describe_probe(kind, entry)
                   for key, entry in stored_measurements(name).items()}
            for kind, name in PROBE_FILES.items()}


def run(args: argparse.Namespace) -> int:
    env = environment()
    source = backend_source()
    probes = stored_probes()
    if args.json:
        env["backend_source"] = source
        env["stored_probes"] = probes
        print(strict_json_text(env))
        return 0
    how = source if source in ("default", "Keras, already imported") else f"from {source}"
    print(f"backend:            {env['backend']} ({how})")
    for name, version in env["versions"].items():
        print(f"{name + ':':<20}{version}")
    print(f"devices:            {device_summary(env['devices'])}")
    for device in env["devices"]:
        print(f"  - id {device['id']}: platform={device['platform']} kind={device['kind']}")
    print(f"image data format:  {env['image_data_format']}")
    print(f"cpu count:          {env['cpu_count']}")
    xla_env = ", ".join(f"{k}={v}" for k, v in env["env"].items())
    print("XLA-related env:    " + (xla_env or "(none set)"))
    print_probes(probes)
    return 0


def print_probes(probes: dict[str, dict[str, str]]) -> None:
    """The stored probes, one line each (``--reprobe`` on train, study, launch measures again)."""
    for kind, name in PROBE_FILES.items():
        entries = probes[kind]
        print(f"stored {kind + ':':<18}{len(entries)} in {measurement_path(name)}")
        for key, answer in entries.items():
            print(f"  - {key}: {answer}")

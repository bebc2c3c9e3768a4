"""``kbackend info``: backend, versions, devices, image data format, XLA-related flags and the
measurements kept per machine (the probes ``--reprobe`` takes again)."""

from __future__ import annotations

import argparse

from kbackend.backend_choice import backend_source
from kbackend.envinfo import device_summary, environment
from kbackend.hardware.measure import PROBES, measurement_path, stored_probes
from kbackend.io import strict_json_text


def register(subparsers: argparse._SubParsersAction, parents: list) -> None:
    parser = subparsers.add_parser("info", parents=parents,
                                   help="show backend, versions and devices")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    env = environment()
    source = backend_source()
    probes = stored_probes()
    if args.json:
        print(strict_json_text({**env, "backend_source": source, "stored_probes": probes}))
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
    for probe in PROBES:  # the stored probes, which --reprobe (train, study, launch) measures again
        entries = probes[probe.name]
        print(f"stored {probe.name + ':':<18}{len(entries)} in "
              f"{measurement_path(probe.file_name)}")
        for key, answer in entries.items():
            print(f"  - {key}: {answer}")
    return 0

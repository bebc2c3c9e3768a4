"""``kbackend advise``: probe this machine briefly and recommend batch size, fused steps, data
format, precision and device, each with the measured figures behind it, for a built-in model
or the user's own (``--model PATH.keras`` / ``FILE.py:FUNCTION``, ``--data SOURCE``), measured
with the loss it is compiled with."""

from __future__ import annotations

import argparse
import math
import sys

from kbackend.advise.advisor import advise, format_advice
from kbackend.commands.train import add_source_arguments
from kbackend.errors import ConfigError
from kbackend.io import atomic_write_json, check_output_path
from kbackend.model_sources import parse_model_source


def register(subparsers: argparse._SubParsersAction, parents: list) -> None:
    parser = subparsers.add_parser("advise", parents=parents,
                                   help="measure this hardware and recommend training settings")
    add_source_arguments(parser, parser, dataset="digits", model_default="seed_mlp")
    parser.add_argument("--quick", action="store_true", help="fewer, shorter measurements (~30 s)")
    parser.add_argument("--budget", type=float, default=100.0, metavar="SECONDS",
                        help="time budget for the measurements (default 100; --quick: 30)")
    parser.add_argument("--json", default=None, metavar="PATH",
                        help="also write the advice as JSON")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    budget = min(args.budget, 30.0) if args.quick and args.budget == 100.0 else args.budget
    if not math.isfinite(budget) or budget <= 0:
        raise ConfigError(
            f"Invalid --budget {args.budget!r}: expected a finite number of seconds > 0.")
    if args.json is not None:
        check_output_path(args.json, "--json")  # before the probe, not after it
    # The model's cheap checks (file, safe mode, builder syntax) before any work; the data is
    # read, and checked against the model, when the probe prepares them.
    parse_model_source(args.model, unsafe_deserialization=args.unsafe_deserialization)
    dataset = args.data or args.dataset
    print(f"probing {args.model} on {dataset} (budget {budget:.0f}s) ...", file=sys.stderr,
          flush=True)
    advice = advise(args.model, dataset, data_dir=args.data_dir, quick=args.quick, budget_s=budget,
                    log=lambda line: print(line, file=sys.stderr, flush=True), label=args.label,
                    image_size=args.image_size, unsafe_deserialization=args.unsafe_deserialization)
    print(format_advice(advice))
    if args.json:
        atomic_write_json(args.json, advice.to_dict())
        print(f"wrote {args.json}", file=sys.stderr)
    return 0

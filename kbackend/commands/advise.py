"""``kbackend advise``: probe this machine briefly and recommend batch size, fused steps, data
format, precision and device, each with the measured figures behind it."""

from __future__ import annotations

import argparse
import math
import sys

from kbackend.config import check_output_path
from kbackend.data import DATASETS
from kbackend.errors import ConfigError
from kbackend.hardware.advise import advise, format_advice
from kbackend.io import atomic_write_json
from kbackend.models import MODELS


def register(subparsers: argparse._SubParsersAction, parents: list) -> None:
    parser = subparsers.add_parser("advise", parents=parents,
                                   help="measure this hardware and recommend training settings")
    parser.add_argument("--model", default="seed_mlp", choices=sorted(MODELS))
    parser.add_argument("--dataset", default="digits", choices=sorted(DATASETS))
    parser.add_argument("--data-dir", default=None, help="folder with MNIST / Fashion-MNIST files")
    parser.add_argument("--quick", action="store_true", help="fewer, shorter measurements (~30 s)")
    parser.add_argument("--budget", type=float, default=100.0, metavar="SECONDS",
                        help="time budget for the measurements (default 100; --quick: 30)")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the advice as JSON")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    budget = min(args.budget, 30.0) if args.quick and args.budget == 100.0 else args.budget
    if not math.isfinite(budget) or budget <= 0:
        raise ConfigError(f"Invalid --budget {args.budget!r}: expected a finite number of seconds > 0.")
    if args.json is not None:
        check_output_path(args.json, "--json")  # before the probe, not after it
    print(f"probing {args.model} on {args.dataset} (budget {budget:.0f}s) ...", file=sys.stderr, flush=True)
    advice = advise(args.model, args.dataset, data_dir=args.data_dir, quick=args.quick, budget_s=budget,
                    log=lambda line: print(line, file=sys.stderr, flush=True))
    print(format_advice(advice))
    if args.json:
        atomic_write_json(args.json, advice.to_dict())
        print(f"wrote {args.json}", file=sys.stderr)
    return 0

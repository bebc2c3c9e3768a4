"""``kbackend equiv MODEL.keras``: run a saved model on JAX and on TensorFlow and compare.

Prints a table of max absolute and relative differences per output, gradient and optimizer step
(and for the model saved on each backend loaded on the other), each marked pass/fail against the
tolerances of ``kbackend.equivalence.tolerances``. Exit status 0 only when every row passes,
1 when any differs, 2 on bad input.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np

from kbackend.config import check_output_path
from kbackend.equivalence import KNOWN_DIVERGENCES, Case, WorkerPool, compare_model
from kbackend.equivalence.randomdata import random_inputs, random_targets
from kbackend.errors import DataError
from kbackend.io import atomic_write_json


def register(subparsers: argparse._SubParsersAction, parents: list) -> None:
    parser = subparsers.add_parser(
        "equiv", parents=parents,
        help="compare a saved model on JAX and TensorFlow (forward, loss, gradients, steps)")
    parser.add_argument("model", metavar="MODEL.keras", help="a model saved with model.save()")
    parser.add_argument("--inputs", default=None, metavar="x.npy",
                        help=".npy (one input) or .npz (one array per input, in order); "
                             "default: random inputs of the model's input shape")
    parser.add_argument("--targets", default=None, metavar="y.npy",
                        help=".npy or .npz targets (default: random ones of the output shape)")
    parser.add_argument("--loss", default=None,
                        help="a Keras loss name (default: the loss the model was compiled with, "
                             "else mse)")
    parser.add_argument("--from-logits", action="store_true",
                        help="the loss takes logits (cross-entropy losses)")
    parser.add_argument("--steps", type=int, default=3, metavar="K",
                        help="optimizer steps compared for sgd, momentum and adam (default 3)")
    parser.add_argument("--batch-size", type=int, default=8, help="rows of random inputs")
    parser.add_argument("--seed", type=int, default=0, help="seed of random inputs and targets")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds a worker may take per request before it is killed")
    parser.add_argument("--failures-only", action="store_true", help="print only failing rows")
    parser.add_argument("--json", default=None, metavar="OUT.json", help="also write the report")
    parser.set_defaults(func=run, needs_backend=False)


def _load_arrays(path: str | None, what: str) -> list[np.ndarray] | None:
    if path is None:
        return None
    file = Path(path)
    if not file.is_file():
        raise DataError(f"{what} file not found: {path!r}. Expected a .npy or .npz file.")
    try:
        loaded = np.load(file, allow_pickle=False)
    except (OSError, ValueError, EOFError) as error:  # EOFError: a zero-byte or cut file
        raise DataError(f"Cannot read {what} file {path!r} as .npy/.npz: "
                        f"{str(error) or type(error).__name__}") from None
    if isinstance(loaded, np.ndarray):
        return [loaded]
    with loaded:
        return [loaded[key] for key in loaded.files]


def _loss(args: argparse.Namespace, compiled: Any) -> Any:
    name = args.loss or compiled or "mse"
    if args.from_logits:
        if not isinstance(name, str):
            raise DataError("--from-logits needs --loss NAME (e.g. sparse_categorical_crossentropy).")
        class_name = "".join(part.capitalize() for part in name.split("_"))
        return {"class_name": class_name, "config": {"from_logits": True}}
    return name


def _is_file(path: str) -> bool:
    try:
        return Path(path).is_file()
    except (OSError, ValueError):  # a name the system cannot look at (too long, a NUL byte)
        return False


def check_args(args: argparse.Namespace) -> None:
    """Reject bad arguments before any worker starts."""
    if Path(args.model).suffix != ".keras" or not _is_file(args.model):
        raise DataError(f"Model file not found or not a .keras file: {args.model!r}. "
                        "Expected a file written by model.save('NAME.keras').")
    for name in ("steps", "batch_size"):
        if getattr(args, name) < 1:
            raise DataError(f"Invalid --{name.replace('_', '-')} {getattr(args, name)}: "
                            "expected an integer >= 1.")
    if not 0 <= args.seed <= 2**32 - 1:
        raise DataError(f"Invalid --seed {args.seed}: expected an integer in [0, {2**32 - 1}] "
                        "(NumPy's seed range).")
    for option in ("inputs", "targets"):
        path = getattr(args, option)
        if path is not None and not _is_file(path):
            raise DataError(f"{option} file not found: {path!r}. Expected a .npy or .npz file.")
        _load_arrays(path, option)  # readable, before any worker starts
    if not math.isfinite(args.timeout) or args.timeout <= 0:
        raise DataError(f"Invalid --timeout {args.timeout!r}: expected a finite number of seconds > 0.")
    if args.json is not None:
        check_output_path(args.json, "--json")


def compare_file(args: argparse.Namespace, pool: Any) -> Any:
    """The ``Report`` for the command's arguments, computed with ``pool``."""
    check_args(args)
    source = {"kind": "keras_file", "path": str(Path(args.model).resolve())}
    description = pool.call(pool.backends[0], "describe", source=source)
    loss = _loss(args, description["loss"])
    x = _load_arrays(args.inputs, "inputs")
    if x is None:
        x = random_inputs(description, args.batch_size, args.seed)
    if len(x) != len(description["inputs"]):
        raise DataError(f"The model takes {len(description['inputs'])} inputs; {args.inputs!r} "
                        f"holds {len(x)} arrays.")
    y = _load_arrays(args.targets, "targets")
    if y is None:
        sparse = "sparse" in str(loss).lower()
        y = random_targets(description, len(x[0]), args.seed, sparse_classes=sparse)
    case = Case(source, x, y, loss=loss, weights=description["weights"], steps=args.steps)
    return compare_model(pool, case)


def run(args: argparse.Namespace, pool: Any = None) -> int:
    check_args(args)
    own_pool = pool is None
    if own_pool:
        sys.stderr.write("starting one worker per backend (jax, tensorflow)...\n")
        pool = WorkerPool(timeout=args.timeout)
    try:
        report = compare_file(args, pool)
    finally:
        if own_pool:
            pool.close()
    print(report.table(only_failures=args.failures_only))
    for note in report.notes:
        print(f"note: {note}")
    for name in report.known_divergences():
        print(f"known divergence {name}: {KNOWN_DIVERGENCES[name].what}")
    print(report.summary())
    if args.json:
        atomic_write_json(args.json, report.to_dict())
    return 0 if report.passed else 1

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

from kbackend.config import MAX_TIMEOUT_S, check_output_path
from kbackend.equivalence import KNOWN_DIVERGENCES, Case, WorkerPool, compare_model
from kbackend.equivalence.losses import FROM_LOGITS, check_loss
from kbackend.equivalence.randomdata import random_inputs, random_targets
from kbackend.errors import DataError
from kbackend.io import atomic_write_json, read_arrays
from kbackend.serving.model import check_model_file

# Random rows: a batch to compare, not a data set. Beyond these the arrays are refused (one line)
# before they are drawn, not a MemoryError traceback.
MAX_RANDOM_ROWS = 65_536
MAX_RANDOM_ELEMENTS = 2**27  # 1 GiB of the float64 draws, over every input and target


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
    return read_arrays(path, f"--{what}", archive=True)


def _loss(args: argparse.Namespace, compiled: Any) -> Any:
    """The loss identifier the workers compile with: ``--loss`` (checked by ``check_args``),
    else the model's compiled loss, else mse."""
    if args.loss is not None:
        return check_loss(args.loss, from_logits=args.from_logits)
    if compiled is None:
        return check_loss("mse", from_logits=args.from_logits)
    if isinstance(compiled, str):
        return check_loss(compiled, from_logits=args.from_logits,
                          flag=f"compiled loss of {args.model!r}")
    if not args.from_logits:
        return compiled
    if isinstance(compiled, dict) and compiled.get("class_name") in FROM_LOGITS:
        return {**compiled, "config": {**(compiled.get("config") or {}), "from_logits": True}}
    raise DataError(f"--from-logits needs --loss NAME (e.g. sparse_categorical_crossentropy): the "
                    f"model's compiled loss {compiled.get('class_name', compiled)!r} takes no logits."
                    if isinstance(compiled, dict) else
                    "--from-logits needs --loss NAME (e.g. sparse_categorical_crossentropy).")


def _check_random_size(description: dict[str, Any], rows: int) -> None:
    """Refuse random inputs and targets too large to draw (before drawing them)."""
    elements = sum(rows * math.prod(d or 1 for d in spec["shape"][1:])
                   for spec in (*description["inputs"], *description["outputs"]))
    if elements > MAX_RANDOM_ELEMENTS:
        raise DataError(f"Invalid --batch-size {rows}: random inputs and targets of this model "
                        f"would hold {elements:.3g} numbers. Expected at most "
                        f"{MAX_RANDOM_ELEMENTS:.3g}: pass a smaller --batch-size or --inputs.")


def check_args(args: argparse.Namespace) -> None:
    """Reject bad arguments before any worker starts."""
    for name in ("steps", "batch_size"):
        if getattr(args, name) < 1:
            raise DataError(f"Invalid --{name.replace('_', '-')} {getattr(args, name)}: "
                            "expected an integer >= 1.")
    if args.batch_size > MAX_RANDOM_ROWS:
        raise DataError(f"Invalid --batch-size {args.batch_size}: expected at most "
                        f"{MAX_RANDOM_ROWS} random rows (a batch to compare, not a data set).")
    if args.loss is not None:
        check_loss(args.loss, from_logits=args.from_logits)
    if not 0 <= args.seed <= 2**32 - 1:
        raise DataError(f"Invalid --seed {args.seed}: expected an integer in [0, {2**32 - 1}] "
                        "(NumPy's seed range).")
    if not 0 < args.timeout <= MAX_TIMEOUT_S:  # NaN fails too
        raise DataError(f"Invalid --timeout {args.timeout!r}: expected seconds > 0 and at most "
                        f"{MAX_TIMEOUT_S} (a week).")
    if args.json is not None:
        check_output_path(args.json, "--json")
    check_model_file(args.model)  # not found, a folder, empty or not a .keras (zip) archive
    for option in ("inputs", "targets"):
        _load_arrays(getattr(args, option), option)  # readable, before any worker starts


def compare_file(args: argparse.Namespace, pool: Any) -> Any:
    """The ``Report`` for the command's arguments, computed with ``pool``."""
    check_args(args)
    source = {"kind": "keras_file", "path": str(Path(args.model).resolve())}
    description = pool.call(pool.backends[0], "describe", source=source)
    loss = _loss(args, description["loss"])
    x = _load_arrays(args.inputs, "inputs")
    if x is None:
        _check_random_size(description, args.batch_size)
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

"""``kbackend equiv MODEL``: run a model on JAX and on TensorFlow and compare.

``MODEL`` is a saved ``.keras`` file (compared with its saved weights) or a builder,
``FILE.py:FUNCTION`` / ``package.module:FUNCTION`` (built for the shape of ``--inputs``; the
reference backend's fresh weights are copied to the others). Prints a table of max absolute and
relative differences per output, gradient and optimizer step (and for the model saved on each
backend loaded on the other), each marked pass/fail against the tolerances of
``kbackend.equivalence.tolerances``. Exit status 0 only when every row passes, 1 when any
differs, 2 on bad input.
"""

from __future__ import annotations

import argparse
import math
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kbackend.commands import add_import_flag
from kbackend.config import MAX_SEED, MAX_TIMEOUT_S
from kbackend.data.user import Where, _npy_header, npy_data_bytes  # header-first checks
from kbackend.equivalence import (
    KNOWN_DIVERGENCES,
    Case,
    WorkerFailed,
    WorkerPool,
    compare_model,
)
from kbackend.equivalence.losses import FROM_LOGITS, check_loss
from kbackend.equivalence.randomdata import random_inputs, random_targets
from kbackend.errors import DataError, path_errors
from kbackend.io import NPY_MAGIC, atomic_write_json, check_distinct_paths, check_output_path
from kbackend.model_sources import Builder, ModelError, parse_model_source

# Random rows: a batch to compare, not a data set. Beyond these the arrays are refused (one line)
# before they are drawn, not a MemoryError traceback.
MAX_RANDOM_ROWS = 65_536
MAX_RANDOM_ELEMENTS = 2**27  # 1 GiB of the float64 draws, over every input and target
# --inputs / --targets: the arrays one flag names may hold this many bytes, as their headers
# declare them (read before any data): a batch every worker computes on at once.
MAX_INPUT_BYTES = 2**30
# What a builder with a ``num_classes`` argument is built for when no --targets name the classes.
DEFAULT_BUILDER_CLASSES = 2
_READ_ERRORS = (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile)
_EXPECTED = "a .npy array, a .npz archive, or PATH.npz:KEY (one array of an archive)"


def register(subparsers: argparse._SubParsersAction, parents: list) -> None:
    parser = subparsers.add_parser(
        "equiv", parents=parents,
        help="compare a model on JAX and TensorFlow (forward, loss, gradients, steps)")
    parser.add_argument("model", metavar="MODEL",
                        help="a model saved with model.save() (PATH.keras), or a builder "
                             "FILE.py:FUNCTION / package.module:FUNCTION (built for --inputs)")
    parser.add_argument("--inputs", default=None, metavar="x.npy",
                        help=".npy (one input), .npz:KEY (one array of an archive) or .npz "
                             "(one array per input, in order); default: random inputs of the "
                             "model's input shape")
    parser.add_argument("--targets", default=None, metavar="y.npy",
                        help=".npy, .npz:KEY or .npz targets (default: random ones of the "
                             "output shape)")
    parser.add_argument("--loss", default=None,
                        help="a Keras loss name (default: the loss the model was compiled with, "
                             "else mse)")
    parser.add_argument("--from-logits", action="store_true",
                        help="the loss takes logits (cross-entropy losses)")
    parser.add_argument("--unsafe-deserialization", action="store_true",
                        help="MODEL.keras: load its Lambda layers (their code runs)")
    parser.add_argument("--steps", type=int, default=3, metavar="K",
                        help="optimizer steps compared for sgd, momentum and adam (default 3)")
    parser.add_argument("--batch-size", type=int, default=8, help="rows of random inputs")
    parser.add_argument("--seed", type=int, default=0, help="seed of random inputs and targets")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds a worker may take per request before it is killed")
    parser.add_argument("--failures-only", action="store_true", help="print only failing rows")
    parser.add_argument("--json", default=None, metavar="OUT.json", help="also write the report")
    add_import_flag(parser)
    parser.set_defaults(func=run, needs_backend=False)


# --- --inputs / --targets ------------------------------------------------------------------


@dataclass(frozen=True)
class Arrays:
    """The arrays one flag named, in order (none when only their headers were read), and the
    archive keys they came from (None for a .npy file)."""

    arrays: list[np.ndarray] = field(default_factory=list)
    keys: list[str] | None = None

    @property
    def count(self) -> int:
        return len(self.keys) if self.keys is not None else 1


def split_key(value: str) -> tuple[str, str | None]:
    """``("data.npz", "x")`` for ``data.npz:x``; ``(value, None)`` for anything else."""
    head, colon, key = str(value).rpartition(":")
    if colon and head.lower().endswith(".npz"):
        return head, key
    return str(value), None


def _check_bytes(where: Where, nbytes: int, max_bytes: int) -> None:
    if nbytes > max_bytes:
        raise where.error(f"its arrays hold {nbytes:,} bytes, more than the {max_bytes:,} "
                          "compared at once (a batch every backend computes on in one call): "
                          "save fewer rows.")


def read_arrays(value: str, flag: str, *, max_bytes: int | None = None,
                load: bool = True) -> Arrays:
    """The arrays ``value`` names for ``flag``: a ``.npy`` file's array, the array ``KEY`` of
    ``PATH.npz:KEY``, or every array of an ``.npz`` in order. Headers first: sizes, object
    dtypes and cut files are refused before any data is read (``load=False`` stops there and
    returns no arrays; ``max_bytes`` defaults to ``MAX_INPUT_BYTES``). Never unpickles. Every
    error is one line naming ``flag``."""
    max_bytes = MAX_INPUT_BYTES if max_bytes is None else max_bytes
    path_text, key = split_key(value)
    where = Where(f"{flag} {str(value)!r}")
    with path_errors(value, flag, DataError):
        path = Path(path_text)
        found = path.is_file()
    if not found:
        raise where.error(f"file not found (expected {_EXPECTED}).")
    try:
        with open(path, "rb") as handle:
            head = handle.read(len(NPY_MAGIC))
        if head == NPY_MAGIC:
            if key is not None:
                raise where.error(f"{path.name} is a .npy array, not an archive: name the file "
                                  "without :KEY.")
            with open(path, "rb") as handle:  # the header's bytes, against the file's size
                _check_bytes(where, npy_data_bytes(where, handle, path.stat().st_size,
                                                   "the array"), max_bytes)
            return Arrays([np.load(path, allow_pickle=False)] if load else [])
        if zipfile.is_zipfile(path):
            return _read_archive(where, path, key, max_bytes, load)
        size = path.stat().st_size
    except _READ_ERRORS as error:
        if isinstance(error, DataError):
            raise
        reason = " ".join(str(error).split())[:200] or type(error).__name__
        raise where.error(f"not a readable .npy/.npz file ({reason}).") from None
    raise where.error(f"expected {_EXPECTED}. Received: {size} bytes without a NumPy header "
                      "(empty, cut, or another format).")


def _read_archive(where: Where, path: Path, key: str | None, max_bytes: int,
                  load: bool) -> Arrays:
    with zipfile.ZipFile(path) as archive:
        members = {info.filename.removesuffix(".npy"): info for info in archive.infolist()
                   if not info.is_dir()}
        if not members:
            raise where.error(f"the archive holds no arrays (expected {_EXPECTED}).")
        if key is not None and key not in members:
            raise where.error(f"the archive has no array {key!r}; its arrays are "
                              f"{', '.join(members)}.")
        keys = [key] if key is not None else list(members)
        total = sum(_npy_header(where, archive, members[name], name) for name in keys)
    _check_bytes(where, total, max_bytes)
    if not load:
        return Arrays([], keys)
    with np.load(path, allow_pickle=False) as loaded:
        return Arrays([loaded[name] for name in keys], keys)


def _load_arrays(value: str | None, what: str) -> Arrays | None:
    return None if value is None else read_arrays(value, f"--{what}")


def check_count(arrays: Arrays, value: str, what: str, expected: int, tensors: str) -> None:
    """A one-line error unless ``arrays`` hold one array per model input (or output)."""
    if arrays.count == expected:
        return
    if arrays.keys is not None and expected == 1:
        path = split_key(value)[0]
        raise DataError(f"Invalid --{what} {value!r}: the archive holds {arrays.count} arrays "
                        f"({', '.join(arrays.keys)}) and the model takes one {tensors[:-1]}: "
                        f"name one, e.g. {path}:{arrays.keys[0]}.")
    raise DataError(f"Invalid --{what} {value!r}: the model has {expected} {tensors}; the file "
                    f"holds {arrays.count} arrays.")


# --- the model and its loss ------------------------------------------------------------------


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
                    f"model's compiled loss {compiled.get('class_name', compiled)!r} takes no "
                    "logits."
                    if isinstance(compiled, dict) else
                    "--from-logits needs --loss NAME (e.g. sparse_categorical_crossentropy).")


def check_model(args: argparse.Namespace) -> Any:
    """The model's ``ModelSource`` after its cheap checks (file, safe mode, builder syntax)."""
    text = str(args.model)
    if not (text.endswith(".keras") or ":" in text):
        raise ModelError(f"Invalid model {text[:200]!r}: expected a saved PATH.keras, or a "
                         "builder FILE.py:FUNCTION or package.module:FUNCTION (a built-in model "
                         "has no weights to compare: save one with kbackend train --save).")
    return parse_model_source(text, unsafe_deserialization=args.unsafe_deserialization)


def _classes(y: np.ndarray) -> int:
    """What a builder's ``num_classes`` is for targets ``y``: one-hot width, else integer
    labels' max + 1, else 1."""
    if y.ndim >= 2 and y.shape[-1] > 1:
        return int(y.shape[-1])
    if y.size and np.issubdtype(y.dtype, np.integer):
        return int(y.max()) + 1
    return 1


def worker_source(args: argparse.Namespace, x: Arrays | None,
                  y: Arrays | None) -> dict[str, Any]:
    """What the workers make the model from (``equivalence.operations``): the model's source as
    JSON (``ModelSource.to_json``), a builder's with the input shape of ``x`` and the classes
    of ``y`` it is built for."""
    source = check_model(args)
    if not isinstance(source, Builder):
        return source.to_json()
    assert x is not None  # check_args
    return {**source.to_json(), "input_shape": [int(d) for d in x.arrays[0].shape[1:]],
            "num_classes": _classes(y.arrays[0]) if y is not None else DEFAULT_BUILDER_CLASSES}


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
    if not 0 <= args.seed <= MAX_SEED:
        raise DataError(f"Invalid --seed {args.seed}: expected an integer in [0, {MAX_SEED}] "
                        "(NumPy's seed range).")
    if not 0 < args.timeout <= MAX_TIMEOUT_S:  # NaN fails too
        raise DataError(f"Invalid --timeout {args.timeout!r}: expected seconds > 0 and at most "
                        f"{MAX_TIMEOUT_S} (a week).")
    if args.json is not None:
        check_distinct_paths({"--json": args.json}, {
            "--model": args.model, "--inputs": (args.inputs or "").split(":")[0] or None,
            "--targets": (args.targets or "").split(":")[0] or None})
        check_output_path(args.json, "--json", suffix=".json")
    source = check_model(args)  # not found, not a .keras archive, Lambda, builder syntax
    headers = {option: read_arrays(getattr(args, option), f"--{option}", load=False)
               for option in ("inputs", "targets") if getattr(args, option) is not None}
    if source.kind == "builder":  # one input, one output: kbackend's builders' contract
        if "inputs" not in headers:
            raise ModelError(f"Builder {source.name!r} is built for the shape of its inputs: "
                             "pass --inputs x.npy (or data.npz:KEY) with rows of it.")
        for option, tensors in (("inputs", "inputs"), ("targets", "outputs")):
            if option in headers:
                check_count(headers[option], getattr(args, option), option, 1, tensors)


def compare_file(args: argparse.Namespace, pool: Any) -> Any:
    """The ``Report`` for the command's arguments, computed with ``pool``."""
    check_args(args)
    x = _load_arrays(args.inputs, "inputs")
    y = _load_arrays(args.targets, "targets")
    source = worker_source(args, x, y)
    try:
        description = pool.call(pool.backends[0], "describe", source=source)
    except WorkerFailed as error:  # the model does not load or build: say so in one line
        raise ModelError(f"Model {str(args.model)!r} does not load on {error.backend}: "
                         f"{' '.join(error.error.split())[:400]}") from None
    loss = _loss(args, description["loss"])
    if x is None:
        _check_random_size(description, args.batch_size)
        inputs = random_inputs(description, args.batch_size, args.seed)
    else:
        check_count(x, args.inputs, "inputs", len(description["inputs"]), "inputs")
        inputs = x.arrays
    if y is None:
        sparse = "sparse" in str(loss).lower()
        targets = random_targets(description, len(inputs[0]), args.seed, sparse_classes=sparse)
    else:
        check_count(y, args.targets, "targets", len(description["outputs"]), "outputs")
        targets = y.arrays
    # Without --loss or --from-logits the comparison takes the model's compiled loss (else
    # mse) itself, and its report notes which.
    chosen = loss if args.loss is not None or args.from_logits else None
    case = Case(source, inputs, targets, loss=chosen, weights=description["weights"],
                steps=args.steps)
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

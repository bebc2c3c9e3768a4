"""The Python API at the package top, in Keras's shapes: ``kbackend.train`` and ``kbackend.study``.

``model`` is a ``keras.Model`` (Sequential or functional; fresh weights per seed, or its own with
``from_weights=True``), a builder function, a built-in name, a ``.keras`` path or
``FILE.py:FUNCTION``. Data is NumPy arrays ``x, y`` (with ``validation_data=(x_val, y_val)``), a
``tf.data.Dataset`` or ``keras.utils.PyDataset`` as ``x``, or a source string as ``data``
(``PATH.npz``, ``PATH.csv`` with ``label=``, a folder, ``tfds:NAME``, ``FILE.py:FUNCTION``). The
model's compiled loss and metrics are what every engine trains and reports. The defaults are the
command line's: the native engine, fused steps measured (``"auto"``), progress lines on a
terminal.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import os
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from kbackend.commands.study import DEFAULT_OUT
from kbackend.commands.train import command_line as train_command_line
from kbackend.commands.train import resolve_engine
from kbackend.config import TrainConfig
from kbackend.data.user import from_python, own_batch_size
from kbackend.digests import arrays_digest, json_digest
from kbackend.distributed import prepare
from kbackend.engine_facts import engine_facts
from kbackend.errors import ApiTypeError, ConfigError, field_default
from kbackend.io import atomic_write
from kbackend.model_sources import parse_model_source
from kbackend.models import ModelOptions
from kbackend.optim import OptimizerSpec
from kbackend.progress import EpochReporter
from kbackend.study.config import StudyConfig
from kbackend.study.pipeline import run_study
from kbackend.study.recommend import CONFIRM_SEEDS
from kbackend.study.results import (
    CellRow,
    Recommendation,
    StudyResult,
    recommendation,
    recommendation_lines,
)
from kbackend.study.targets import study_target
from kbackend.training import TrainResult, for_task, save_model
from kbackend.training import train as train_config
from kbackend.workload import Workload, prepare_workload, unwrap

# TrainConfig's fields of a data-parallel or multi-process run (kbackend.distributed.prepare).
PARALLEL_FIELDS = ("devices", "data_parallel", "dp_impl", "virtual_devices", "num_processes",
                   "process_id", "coordinator", "coordinator_timeout", "heartbeat_timeout")

__all__ = ["CellRow", "Recommendation", "StudyResult", "recommendation", "recommendation_lines",
           "study", "train"]

# Each default is stated once, on the config the argument fills (the command line reads the same).
_TRAIN = partial(field_default, TrainConfig)
_OPTIMIZER = partial(field_default, OptimizerSpec)
_STUDY = partial(field_default, StudyConfig)

# The arguments of Keras's ``fit`` that kbackend names otherwise, and what to pass instead.
KERAS_HABITS = {
    "verbose": "progress=True or False",
    "validation_split": "validation_fraction=",
    "callbacks": "early_stopping=PATIENCE or target=VALUE (no Keras callbacks run)",
    "steps_per_epoch": "max_steps= (a budget of steps) or eval_every=",
    "lr": "learning_rate=",
    "dataset": "data=SOURCE, or arrays as x and y",
    "monitor": "target_metric=",
    "task": "the model compiled with its loss and metrics",
}


def _check_options(options: dict[str, Any], owner: type, call: Callable[..., Any],
                   set_here: tuple[str, ...]) -> None:
    """A one-line ``ApiTypeError`` for a keyword argument ``call`` does not take: not one of
    its own and no field of ``owner`` (the config its further options fill), or a field it
    sets itself; a Keras habit (``verbose=``) names kbackend's argument instead."""
    fields = {item.name for item in dataclasses.fields(owner)} - set(set_here)
    for name in options:
        if name in fields:
            continue
        if name in KERAS_HABITS:
            hint = f": use {KERAS_HABITS[name]}"
        else:
            known = [name for name, parameter in inspect.signature(call).parameters.items()
                     if parameter.kind is not inspect.Parameter.VAR_KEYWORD] + sorted(fields)
            close = difflib.get_close_matches(name, known, n=1)
            hint = (f": did you mean {close[0]}=?" if close else
                    f"; it takes its own arguments and {owner.__name__} fields")
        raise ApiTypeError(f"kbackend.{call.__name__}() got an unexpected keyword argument "
                           f"{name!r}{hint}")


def _workload(model: Any, x: Any, y: Any, validation_data: Any, data: Any, label: str | None,
              seed: int, target_metric: str | None, from_weights: bool,
              unsafe_deserialization: bool, validation_fraction: float,
              options: dict[str, Any] | None = None) -> Workload:
    """The workload of the call's model and data; ``options`` (the further ``TrainConfig``
    fields) give the model options, image size and data folder the workload is read with."""
    options = options or {}
    model_options = dataclasses.replace(options.get("model_options") or ModelOptions(),
                                        seed=seed)
    if x is None and data is None:
        raise ApiTypeError("No data: pass arrays (x, y), a tf.data.Dataset as x, or data=SOURCE.")
    if x is not None and data is not None:
        raise ConfigError(f"Data given twice: x (arrays or a dataset) and data={str(data)[:80]!r}."
                          " Pass one of them.")
    return prepare_workload(model, data, x=x, y=y, validation_data=validation_data,
                            label=label, validation_fraction=validation_fraction, seed=seed,
                            options=model_options, target_metric=target_metric,
                            image_size=options.get("image_size"),
                            data_dir=options.get("data_dir"),
                            unsafe_deserialization=unsafe_deserialization,
                            from_weights=from_weights)


def train(model: Any, x: Any = None, y: Any = None, *, validation_data: Any = None,
          data: Any = None, label: str | None = None, batch_size: int | None = None,
          epochs: int = _TRAIN("epochs"), optimizer: str = _OPTIMIZER("name"),
          learning_rate: float = _OPTIMIZER("learning_rate"),
          engine: str = _TRAIN("engine"), fused_steps: int | str = "auto",
          target: float | None = None, target_metric: str | None = None,
          early_stopping: int = _TRAIN("early_stopping"), seed: int = _TRAIN("seed"),
          validation_fraction: float = _TRAIN("validation_fraction"), from_weights: bool = False,
          unsafe_deserialization: bool = False, progress: bool | None = None,
          save: str | os.PathLike | None = None, history: str | os.PathLike | None = None,
          tensorboard: str | os.PathLike | None = None, **options: Any) -> TrainResult:
    """Train the user's ``model`` on their data, as ``model.fit(x, y, validation_data=...)``
    would, on kbackend's engines; the trained model, its history and the dataset.

    ``batch_size``: default a ``tf.data`` set's own (``.batch(64)``), else 32; one that
    replaces the set's own is said in one line. ``target`` stops at the first evaluation where
    ``target_metric`` (default ``val_`` + the model's metric) reaches it. ``progress``:
    per-epoch lines (default: on a terminal). ``tensorboard``: a folder for TensorBoard event
    files (each evaluation's scalars). ``options``: further ``TrainConfig`` fields
    (``eval_every``, ``max_steps``, ...). ``result.history.history`` is a dict of
    per-evaluation lists, as Keras's ``History.history``."""
    _check_options(options, TrainConfig, train, ("dataset", "monitor", "task"))
    batch_size = _batch_size(batch_size, x, progress)
    # Virtual devices and a multi-process job come before the framework starts (preparing
    # the workload starts it); TrainConfig checks the options first.
    prepare(TrainConfig(**{k: v for k, v in options.items() if k in PARALLEL_FIELDS}))
    workload = _workload(model, x, y, validation_data, data, label, seed, target_metric,
                         from_weights, unsafe_deserialization, validation_fraction, options)
    engine = resolve_engine(engine)[0]  # "auto": every source is in memory
    if fused_steps == "auto":
        fused_steps = engine_facts(engine).default_fused_steps
    config = for_task(TrainConfig(
        model=workload.model_name, dataset=workload.dataset.info.name,
        optimizer=OptimizerSpec(optimizer, learning_rate), batch_size=batch_size, epochs=epochs,
        engine=engine, fused_steps=int(fused_steps), early_stopping=early_stopping, seed=seed,
        validation_fraction=validation_fraction, **options), workload.task, target=target,
        target_metric=target_metric, monitor=None)
    reporter = EpochReporter() if _shown(progress) else None
    return train_config(config, reporter=reporter, save=save, history_path=history,
                        workload=workload, tensorboard=tensorboard)


def _batch_size(asked: int | None, x: Any, progress: bool | None) -> int:
    """The batch size to train at: ``asked``, else the tf.data set's own, else 32; where
    ``asked`` replaces the set's own, one line says so (unless ``progress=False``)."""
    own = own_batch_size(x)
    if asked is None:
        return own or _TRAIN("batch_size")
    if own is not None and own != asked and _shown(progress):
        print(f"batch_size={asked} replaces the tf.data set's own batch of {own} (kbackend "
              "reads the set into memory and batches it itself).", file=sys.stderr)
    return asked


def study(model: Any, x: Any = None, y: Any = None, *, validation_data: Any = None,
          data: Any = None, label: str | None = None,
          optimizers: tuple[str, ...] = _STUDY("optimizers"),
          batch_sizes: tuple[int, ...] | None = None, target: float | None = None,
          target_metric: str | None = None, seeds: int = _STUDY("seeds"),
          out: str | os.PathLike = DEFAULT_OUT, progress: bool | None = None,
          confirm_seeds: int = CONFIRM_SEEDS, tensorboard: str | os.PathLike | None = None,
          **options: Any) -> StudyResult:
    """The batch-size x optimizer study on the user's ``model`` and data: which batch size,
    optimizer and learning rate reach ``target`` of ``target_metric`` (default ``val_`` + the
    model's metric) in the least training time on this machine. Returns a ``StudyResult``
    (``.best``: a ``Recommendation``; ``.rows``: ``CellRow`` s; ``.report_path``,
    ``.runs_path``, ``.to_dict()``, ``.to_pandas()``). ``target``: required for the user's own
    data (the error names the metric and what a short probe reached). ``confirm_seeds``:
    held-out seeds the best cell's printed ``train`` command runs on (0: none). ``progress``:
    the progress bar and the printed table (default: on a terminal; False prints nothing).
    ``tensorboard``: a folder for a TensorBoard run per run and the HParams experiment.
    ``options``: further ``StudyConfig`` fields.

    In-memory data (arrays, ``tf.data``) and a ``keras.Model`` are written under ``out``, named
    by their content (the model by its architecture and compile settings: every run starts from
    fresh weights), so a re-run resumes; a builder given as a function must be importable by
    name (defined in a module, not in ``__main__``'s interactive session)."""
    _check_options(options, StudyConfig, study, ("dataset",))
    out_path = Path(out)
    data_source, workload = data, None
    fraction = options.get("validation_fraction", _STUDY("validation_fraction"))
    if x is not None:
        workload = _workload(model, x, y, validation_data, None, label, 0, target_metric, False,
                             False, fraction)
        data_source = str(_save_arrays(workload, out_path) if workload.front is None
                          else _save_texts(x, y, validation_data, out_path))
    model_source = _model_source_string(model, out_path, workload)
    if target_metric is None and workload is not None:
        target_metric = f"val_{workload.task.metric}"
    resolved = study_target(
        model_source, str(data_source), target, target_metric, label=label, python=True,
        data_dir=options.get("data_dir"),
        unsafe_deserialization=options.get("unsafe_deserialization", False),
        validation_fraction=fraction)
    config = StudyConfig(model=model_source, dataset=str(data_source), label=label,
                         optimizers=tuple(optimizers), batch_sizes=batch_sizes,
                         target=resolved, seeds=seeds, **options)
    show = _shown(progress)
    outcome = run_study(config, out_path, show_progress=show, print_results=show,
                        tensorboard=tensorboard, command_line=train_command_line,
                        confirm_seeds=confirm_seeds)
    paths = outcome.paths
    return StudyResult.of(outcome.study, outcome.analysis, Path(paths["report"]),
                          Path(paths["runs"]) if paths.get("runs") else None)


def _model_source_string(model: Any, out: Path, workload: Workload | None = None) -> str:
    """A source string a study's runs (and Ray workers) can rebuild ``model`` from: a live
    ``keras.Model`` is saved under ``out`` first (``_save_model``); one with a string front
    with the front as ``workload`` adapted it (Keras cannot load a lookup layer saved empty)."""
    if isinstance(model, str | os.PathLike):
        return str(model)
    keras = sys.modules.get("keras")  # a live keras.Model means Keras is already imported
    if keras is not None and isinstance(model, keras.Model):
        if workload is not None and workload.front is not None:
            return str(_save_model(unwrap(workload.first_model()), out, workload.front.digest()))
        return str(_save_model(model, out))
    module = getattr(model, "__module__", None)
    name = getattr(model, "__qualname__", None)
    if callable(model) and module and name and module != "__main__" and "<" not in name:
        return f"{module}:{name}"
    raise ApiTypeError("study() takes the model as a keras.Model, a built-in name, a .keras path, "
                    "FILE.py:FUNCTION or an importable builder function (its runs build a "
                    "fresh model per seed and cell).")


def _save_model(model: Any, out: Path, front: str = "") -> Path:
    """``model`` as ``out/models/<name>-<digest>.keras`` (atomically; reused when present),
    the digest of its architecture and compile settings (and ``front``: its string front's
    digest, vocabularies included): what its runs rebuild, each from fresh weights, so a re-run
    with the same model resumes from the store."""
    digest = parse_model_source(model).digest(model)  # the run keys' own model digest
    if front:
        digest = json_digest([digest, front])
    name = "".join(c if c.isalnum() or c in "-_" else "_" for c in model.name) or "model"
    path = out / "models" / f"{name}-{digest}.keras"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        save_model(model, path)
    return path


def _save_arrays(workload: Workload, out: Path) -> Path:
    """The workload's splits as ``out/data/<digest>.npz`` (atomically; reused when present)."""
    data = workload.dataset
    arrays = {}
    for split in ("train", "val", "test"):
        arrays[f"x_{split}"] = getattr(data, f"x_{split}")
        labels = workload.task.fit_labels(getattr(data, f"y_{split}"))
        # A multi-output task's labels as the y_<split>_<output> keys the .npz reader takes.
        arrays.update({f"y_{split}_{name}": value for name, value in labels.items()}
                      if isinstance(labels, dict) else {f"y_{split}": labels})
    return _saved(out / "data" / f"arrays-{data.digest()}.npz", arrays)  # the run keys' digest


def _save_texts(x: Any, y: Any, validation_data: Any, out: Path) -> Path:
    """The raw splits of a model with a string front (its runs adapt and run the front
    themselves) as ``out/data/texts-<digest>.npz``: strings as ``str`` arrays, read back
    without pickle."""
    splits = from_python(x, y, validation_data=validation_data).splits
    arrays = {f"{part}_{split}": (np.asarray(value).astype(str) if part == "x" else value)
              for split, pair in splits.items() for part, value in zip("xy", pair, strict=True)}
    return _saved(out / "data" / f"texts-{arrays_digest(arrays)}.npz", arrays)


def _saved(path: Path, arrays: dict[str, Any]) -> Path:
    """``arrays`` written to ``path`` (atomically, without pickle) unless it is there: it is
    named by their digest."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda tmp: np.savez(tmp, allow_pickle=False, **arrays))
    return path


def _shown(progress: bool | None) -> bool:
    return sys.stderr.isatty() if progress is None else progress


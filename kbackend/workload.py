"""A workload: the user's model (or a built-in one), their data, and the task that ties them.

``prepare_workload`` turns what a user names (a model source, a data source or arrays) into a
validated ``Dataset``, a ``ModelSource`` that builds one model per seed, and the ``Task`` every
engine trains (the model's compiled loss and metric, else inferred from the labels), with every
check done before any training: model input vs data shape, output units vs classes, labels the
loss cannot take. ``train`` and ``study`` both start here, so they treat a model the same way.

Splits: the source's own validation and test splits are used as given. Without a validation
split, one is held out of the training data (``validation_fraction``); without a test split, one
of the same size is held out first. Both draws, and the order a folder's files are read in, are
fixed (``SPLIT_SEED``, ``TEST_SPLIT_SEED``): a run's seed picks its initial weights and data
order only, so every seed is validated and tested on the same samples and ``train --seed S``
trains on the data the study's seed S trained on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from kbackend import data as data_module
from kbackend.backend_choice import keras as import_keras
from kbackend.data import user as user_data
from kbackend.errors import ConfigError, DataError
from kbackend.host_front import HostFront
from kbackend.model_sources import ModelError, ModelSource, parse_model_source, takes_shape
from kbackend.models import ModelOptions
from kbackend.task import (
    CLASSIFICATION,
    MultiOutputTask,
    Task,
    output_names,
    output_units,
)

# The fixed draws behind a held-out test split and a held-out validation split (and a folder's
# file order), independent of the run's seed. The validation draw is the one seed 0 made when
# the draw followed the seed, so what seed 0 trained on is unchanged.
TEST_SPLIT_SEED = 1_000_003
SPLIT_SEED = 0


# How a note that warns begins (commands print every note; study prints these).
WARNING = "warning: "

# Integers are packed into float32 next to real inputs: exact up to 2**24 (token ids, indices).
MAX_PACKED_INTEGER = 2**24


@dataclass(frozen=True)
class InputPacking:
    """A model's named inputs (a dict of arrays) packed side by side into one float32 array,
    so that every engine, batch gatherer and device copy handles one array; ``wrap`` puts a
    front on the model that slices the packed rows back into its named inputs (exact: a copy,
    no arithmetic). What is saved is the user's own model (``unwrap``)."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, x: dict[str, Any]) -> InputPacking:
        if not x:
            raise DataError("Invalid inputs: an empty dict; expected one array per model input.")
        names = tuple(sorted(x))
        return cls(names, tuple(tuple(int(d) for d in np.shape(x[n])[1:]) for n in names))

    @property
    def input_shapes(self) -> dict[str, tuple[int, ...]]:
        return dict(zip(self.names, self.shapes, strict=True))

    def pack(self, x: Any, split: str) -> np.ndarray:
        """``x`` (a dict with this packing's keys and shapes) as one ``(N, total)`` array."""
        if not isinstance(x, dict) or set(x) != set(self.names):
            got = sorted(x) if isinstance(x, dict) else type(x).__name__
            raise DataError(f"Invalid inputs in the {split} split: expected a dict with the "
                            f"keys {list(self.names)}. Received: {got}.")
        arrays = [np.asarray(x[name]) for name in self.names]
        lengths = {len(a) for a in arrays}
        if len(lengths) != 1:
            raise DataError(f"Inputs of different lengths in the {split} split: "
                            + ", ".join(f"{n} {len(a)}" for n, a in zip(self.names, arrays,
                                                                          strict=True)) + ".")
        for name, shape, array in zip(self.names, self.shapes, arrays, strict=True):
            if tuple(array.shape[1:]) != shape:
                raise DataError(f"Input {name!r} of the {split} split has samples of shape "
                                f"{tuple(array.shape[1:])}, the training split's {shape}.")
            if array.dtype.kind in "iu" and array.size and \
                    np.abs(array).max() >= MAX_PACKED_INTEGER:
                raise DataError(f"Input {name!r} of the {split} split holds integers beyond "
                                f"2**24, which float32 cannot hold exactly.")
            if array.dtype.kind not in "biuf":
                raise DataError(f"Input {name!r} of the {split} split holds {array.dtype} "
                                "values: expected numbers.")
        return np.concatenate([a.reshape(len(a), -1).astype(np.float32) for a in arrays],
                              axis=1)

    def wrap(self, model: Any) -> Any:
        """A functional model of one packed input around ``model`` (same variables)."""
        keras = import_keras()
        sizes = [int(np.prod(shape)) for shape in self.shapes]
        packed = keras.Input((sum(sizes),), name="packed_inputs")
        parts, start = {}, 0
        for name, shape, size in zip(self.names, self.shapes, sizes, strict=True):
            part = packed[:, start:start + size]
            parts[name] = part if len(shape) == 1 else keras.layers.Reshape(shape)(part)
            start += size
        wrapper = keras.Model(packed, model(parts), name=f"{model.name}_packed")
        object.__setattr__(wrapper, "_kbackend_inner", model)  # what is saved
        return wrapper


def unwrap(model: Any) -> Any:
    """The user's own model inside an ``InputPacking.wrap`` front (else ``model``)."""
    return getattr(model, "_kbackend_inner", model)


@dataclass
class Workload:
    """A model source, the data as validated splits, and the task the engines train."""

    source: ModelSource
    dataset: data_module.Dataset
    task: Task
    options: ModelOptions = field(default_factory=ModelOptions)
    # Named inputs packed into one array (a dict of arrays given as x), else None.
    packing: InputPacking | None = None
    # The model's string front (kbackend.host_front), run on the host once per split, and the
    # sample shape of the raw inputs it takes; else None.
    front: HostFront | None = None
    raw_shape: tuple[int, ...] | None = None
    # Lines a command prints before training (the inferred task, held-out splits, ...).
    notes: list[str] = field(default_factory=list)
    # Whether a command says the task (not for a built-in model on a built-in dataset, whose
    # task is the built-in classification).
    says_task: bool = True
    _first: Any = field(default=None, repr=False)

    @property
    def model_name(self) -> str:
        return self.source.name

    def first_model(self) -> Any:
        """The model built while preparing, else one built now for the options' seed; kept
        for the first ``build`` of that seed."""
        if self._first is None:
            self._first = (self.options.seed, self.build(), _dtype_policy())
        return self._first[1]

    def build(self, seed: int | None = None) -> Any:
        """A fresh model for seed ``seed`` (default: the options' seed)."""
        seed = self.options.seed if seed is None else seed
        # Built once while preparing: reused, when built under the dtype policy in force now
        # (a run's --precision scope; the workload may have been prepared outside it).
        if self._first is not None:
            first_seed, model, policy = self._first
            if (first_seed, policy) == (seed, _dtype_policy()):
                self._first = None
                return model
        info = self.dataset.info
        if self.packing is not None:
            info = replace(info, input_shape=self.packing.input_shapes)
        if self.front is not None and self.raw_shape is not None:
            info = replace(info, input_shape=self.raw_shape)
        model = self.source.build(info, self.options, seed=seed)
        if self.packing is not None:
            return self.packing.wrap(model)
        if self.front is not None:  # the rest after the front, with the first's vocabularies
            model = self.front.attach(model)
        adapt_preprocessing(model, self.dataset.x_train)
        return model


def prepare_workload(model: Any = "seed_mlp", data: Any = "digits", *, x: Any = None,
                     y: Any = None, validation_data: Any = None, label: str | None = None,
                     image_size: tuple[int, int] | None = None,
                     validation_fraction: float = 0.1, seed: int = 0,
                     data_dir: str | None = None, options: ModelOptions | None = None,
                     target_metric: str | None = None, unsafe_deserialization: bool = False,
                     from_weights: bool = False) -> Workload:
    """The workload of ``model`` (a name, a ``.keras`` path, ``FILE.py:FUNCTION``, a
    ``keras.Model`` or a builder) on ``data`` (a built-in dataset name or a data source string,
    ``kbackend.data.user``) or on arrays / a ``tf.data.Dataset`` given as ``x`` (and ``y``,
    ``validation_data``). ``target_metric`` (``val_mae``, ...) picks the metric the engines
    report among the model's compiled ones. Raises a one-line ``KBackendError`` on bad input."""
    options = options or ModelOptions(seed=seed)
    packing, x, validation_data = _packed(x, y, validation_data)
    source = parse_model_source(model, unsafe_deserialization=unsafe_deserialization,
                                from_weights=from_weights)
    read = _read(source, data, x, y, validation_data, label=label, image_size=image_size,
                 options=options, validation_fraction=validation_fraction, data_dir=data_dir)
    splits, name, kind, notes = dict(read.splits), read.name, read.kind, list(read.notes)
    metric = None if target_metric in (None, "val_loss") else str(target_metric)[len("val_"):]
    if source.layout == "flat":  # a built-in MLP takes rows of features
        splits = {k: (np.reshape(v[0], (len(v[0]), -1)), v[1]) for k, v in splits.items()}
    splits = _text_shaped(splits, source)
    first, front, splits = _first_model(source, splits, name, options, packing, notes,
                                        read.info)
    raw_shape = tuple(int(d) for d in splits["train"][0].shape[1:])
    x_train, y_train = splits["train"]
    check_label_outputs(first, y_train, source.name)
    task = source.task(first, y_train, metric)
    if front is not None:  # the splits now hold what the front gives, the rest trains on them
        splits = through_front(front, splits, validation_fraction, notes)
        x_train = splits["train"][0]
    full, first = first, front.rest(first) if front is not None else first
    if packing is not None:
        first = packing.wrap(first)
    _model_notes(first, task, x_train, source.name, notes)
    splits = checked_splits(full, task, splits, name, source.name)
    dataset = dataset_of(name, kind, splits, task, output_units(full), validation_fraction,
                         notes, owned=read.owned, known=read.info)
    # The built-in task on a built-in dataset goes without saying.
    says_task = not (task is CLASSIFICATION and read.info is not None)
    return Workload(source, dataset, task, options, packing=packing, front=front,
                    raw_shape=raw_shape if front is not None else None, notes=notes,
                    says_task=says_task, _first=(options.seed, first, _dtype_policy()))


def _dtype_policy() -> str:
    """The name of Keras's global dtype policy (layers built now take it)."""
    return str(import_keras().config.dtype_policy().name)


def _read(source: ModelSource, data: Any, x: Any, y: Any, validation_data: Any, *,
          label: str | None, image_size: tuple[int, int] | None, options: ModelOptions,
          validation_fraction: float, data_dir: str | None) -> user_data.UserData:
    """The data read: the Python objects ``x`` (``y``, ``validation_data``), the user's data
    source, or a built-in dataset, read in the layout ``source`` takes (a built-in model's own;
    else the data's own shape, which a model's Reshape adapts, reshaped to a saved model's
    declared input where the sizes match) with its description (``UserData.info``)."""
    if x is not None:
        return user_data.from_python(x, y, validation_data=validation_data)
    if not (isinstance(data, str) and data in data_module.DATASETS):
        return user_data.load_source(data, label=label, seed=SPLIT_SEED, image_size=image_size,
                                     raw_text=True)
    dataset = data_module.load(data, layout=source.layout,
                               data_format=source.data_format(options),
                               validation_fraction=validation_fraction, seed=SPLIT_SEED,
                               data_dir=data_dir)
    notes: list[str] = []
    # A validation split that is the test split (fraction 0) is not one of the data's own.
    names = ("train", "test") if dataset.info.val_is_test else ("train", "val", "test")
    splits = _in_model_shape({split: dataset.split(split) for split in names},
                             source.input_shape(), data, notes)
    shape = tuple(int(d) for d in splits["train"][0].shape[1:])
    info = dataset.info if shape == dataset.info.input_shape else replace(  # reshaped for a model
        dataset.info, input_shape=shape, layout="flat" if len(shape) == 1 else "spatial",
        data_format=None)
    return user_data.UserData(data, data, splits, "builtin", notes=tuple(notes), info=info)


def _packed(x: Any, y: Any, validation_data: Any) -> tuple[InputPacking | None, Any, Any]:
    """(the packing of a model's named inputs given as a dict, else None; ``x`` and
    ``validation_data`` packed side by side)."""
    if not (isinstance(x, dict) and y is not None):
        return None, x, validation_data
    packing = InputPacking.of(x)
    x = packing.pack(x, "train")
    if validation_data is not None:
        validation_data = (packing.pack(validation_data[0], "validation"),
                           *tuple(validation_data)[1:])
    return packing, x, validation_data


def _model_notes(model: Any, task: Task, x_train: np.ndarray, name: str,
                 notes: list[str]) -> None:
    """The notes on the model to train (an output squashed twice, a task inferred), and its
    input's Normalization layers adapted on the training split (``adapt_preprocessing``)."""
    notes.extend(check_activation(model, task, name))
    if task.source == "inferred":
        notes.append(f"task inferred from the labels (the model is not compiled): "
                     f"{task.describe()}")
    adapted = adapt_preprocessing(model, x_train)
    if adapted:
        notes.append(f"adapted on the training split: {', '.join(adapted)}")


def _in_model_shape(splits: dict[str, tuple[np.ndarray, np.ndarray]],
                    shape: tuple[int | None, ...] | None, name: str,
                    notes: list[str]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """A built-in dataset's inputs reshaped to the sample shape a saved or given model takes
    (``(64,)`` for digits saved from an MLP) when the sizes match; else as they are (and
    ``check_model_matches`` names both shapes)."""
    have = tuple(splits["train"][0].shape[1:])
    if shape is None or None in shape:
        return splits
    want = tuple(int(d) for d in shape if d is not None)
    if want == have or math.prod(want) != math.prod(have):
        return splits
    notes.append(f"{name} reshaped from {have} to the model's input shape {want}")
    return {k: (np.reshape(x, (len(x), *want)), y) for k, (x, y) in splits.items()}


def check_activation(model: Any, task: Task, name: str) -> list[str]:
    """A warning (a note) when a loss compiled with ``from_logits=True`` follows an output
    that is already a softmax or sigmoid: the loss squashes the probabilities a second time,
    which trains, but slowly and towards the wrong optimum. Training goes on."""
    layers = getattr(model, "layers", None)
    layer = layers[-1] if layers else None
    activation = getattr(getattr(layer, "activation", None), "__name__", None)
    if layer is None or not task.from_logits or activation not in ("softmax", "sigmoid"):
        return []
    return [f"{WARNING}model {name!r} ends in a {activation} ({layer.name}) but its loss "
            f"{task.loss_name} is compiled with from_logits=True: it treats the probabilities "
            "as logits (drop the activation, or compile with from_logits=False)"]


def _text_shaped(splits: dict[str, tuple[Any, Any]], source: ModelSource
                 ) -> dict[str, tuple[Any, Any]]:
    """Texts (N,) as (N, 1), the shape of ``keras.Input(shape=(1,), dtype="string")``, unless the
    saved or given model declares (N,) itself."""
    x = splits["train"][0]
    if not (isinstance(x, np.ndarray) and x.dtype.kind in "OU" and x.ndim == 1):
        return splits
    if source.input_shape() == ():  # a saved or given model declaring (N,) itself
        return splits
    return {k: (np.reshape(v[0], (len(v[0]), 1)), v[1]) for k, v in splits.items()}


def _first_model(source: ModelSource, splits: dict[str, tuple[Any, Any]], name: str,
                 options: ModelOptions, packing: InputPacking | None, notes: list[str],
                 known: data_module.DatasetInfo | None = None
                 ) -> tuple[Any, HostFront | None, dict[str, tuple[Any, Any]]]:
    """(the model built for the data, its string front or None, the splits). Texts for a
    model without a string front of its own are vectorized by kbackend's built-in layer
    (``user_data.vectorize_text``, said in a note) and the model built for the token ids.
    ``known``: the data's description where its source gives one (a built-in dataset's)."""
    x_train, y_train = splits["train"]
    text = x_train.dtype.kind in "OU"
    info = known or _provisional_info(name, x_train, y_train)
    if packing is not None:
        info = replace(info, input_shape=packing.input_shapes)
    try:
        first = source.build(info, options, seed=options.seed)
    except ModelError:
        if not text:
            raise
        first = None  # a model that does not take strings: built again for token ids
    front = HostFront.of(first, source.name) if first is not None else None
    if text and front is None:
        splits, note = user_data.vectorize_text(
            {k: (np.reshape(x, (len(x), -1))[:, 0], y) for k, (x, y) in splits.items()})
        notes.append(note)
        x_train, y_train = splits["train"]
        first = source.build(_provisional_info(name, x_train, y_train), options,
                             seed=options.seed)
        front = HostFront.of(first, source.name)
    return first, front, splits


def through_front(front: HostFront, splits: dict[str, tuple[Any, Any]],
                  validation_fraction: float, notes: list[str]
                  ) -> dict[str, tuple[np.ndarray, Any]]:
    """The raw splits held out as ``dataset_of`` and ``from_arrays`` would hold them out (the
    same draws), the front adapted on the training split only (where it holds no vocabulary
    yet), and every split run through it on the host, once (``HostFront.apply``, cached)."""
    splits = dict(splits)
    x, y = _test_held_out(splits, validation_fraction, notes)
    if "val" not in splits and validation_fraction:
        keep, val = data_module.validation_indices(len(x), validation_fraction, SPLIT_SEED)
        splits["val"], (x, y) = (x[val], y[val]), (x[keep], y[keep])
    splits["train"] = (x, y)
    adapted = front.adapt(front.inputs(x, "inputs of the train split"))
    if adapted:
        notes.append(f"adapted on the training split: {', '.join(adapted)}")
    layers = ", ".join(type(layer).__name__ for layer in front.layers)
    notes.append(f"string preprocessing ({layers}) run on the host once per split; the "
                 "saved model takes raw strings")
    return {k: (front.apply(v[0], f"inputs of the {k} split"), v[1]) for k, v in splits.items()}


def _test_held_out(splits: dict[str, tuple[Any, Any]], validation_fraction: float,
                   notes: list[str], owned: bool = False) -> tuple[Any, Any]:
    """The training split's ``(x, y)``, a test split first held out of it into ``splits`` (a
    fixed draw, said in a note) where there is none; ``owned``: taken out of ``x`` in place."""
    x, y = splits["train"]
    if "test" in splits:
        return x, y
    keep, test = _held_out(len(x), validation_fraction or 0.1, TEST_SPLIT_SEED)
    splits["test"] = (x[test], y[test])  # copied out first
    notes.append(f"no test split in the data: {len(test)} samples held out as one (a fixed "
                 "draw, the same for every seed)")
    return data_module.take_rows(x, keep, in_place=owned), y[keep]


def adapt_preprocessing(model: Any, x_train: np.ndarray) -> list[str]:
    """Adapt the model's ``Normalization`` layers that read its input and were never adapted
    (a fresh clone's statistics are the initial zeros and ones) on the training split, never
    on validation or test data; the names of the layers adapted."""
    keras = import_keras()
    adapted = []
    inputs = getattr(model, "inputs", None) or []
    for layer in model._flatten_layers(include_self=False):
        if not isinstance(layer, keras.layers.Normalization) or layer.input_mean is not None:
            continue
        fresh = (not np.any(keras.ops.convert_to_numpy(layer.adapt_mean))
                 and np.all(keras.ops.convert_to_numpy(layer.adapt_variance) == 1))
        reads_input = any(node.parent_nodes == [] or any(
            t is i for t in node.input_tensors for i in inputs)
            for node in getattr(layer, "_inbound_nodes", []))
        if fresh and reads_input:
            layer.adapt(x_train)
            adapted.append(layer.name)
    return adapted


def checked_splits(model: Any, task: Task, splits: dict[str, tuple[Any, Any]], data: str,
                   name: str) -> dict[str, tuple[Any, np.ndarray]]:
    """Every split's labels checked against ``task`` and the model's output (``check_labels``,
    ``check_output_shape``, ``check_classes``); a multi-output task's packed (``output_labels``)."""
    if isinstance(task, MultiOutputTask):
        return {k: (x, output_labels(model, task, y, k, data)) for k, (x, y) in splits.items()}
    units = output_units(model)
    checked = {k: (x, check_labels(task, y, units, k)) for k, (x, y) in splits.items()}
    check_output_shape(model, task, checked["train"][1], name)
    check_classes(task, checked["train"][1], data)
    return checked


def check_label_outputs(model: Any, y: Any, name: str) -> None:
    """A one-line ``DataError`` where the labels' form does not fit the model's outputs: one
    array for a model with several outputs, or labels per output for a model with one."""
    names = output_names(model)
    if len(names) > 1 and not isinstance(y, dict):
        raise DataError(f"Model {name!r} has {len(names)} outputs {list(names)}: give labels per "
                        "output, .npz keys y_train_<output> (y_val_<output>, y_test_<output>) "
                        "or a dict keyed by output name.")
    if len(names) <= 1 and isinstance(y, dict):
        raise DataError(f"Labels per output ({sorted(y)}) for model {name!r}, which has one "
                        "output: give one label array (y_train).")


def output_labels(model: Any, task: MultiOutputTask, y: Any, split: str,
                  data: str) -> np.ndarray:
    """A multi-output model's labels of one split (a dict by output name), each checked as its
    output's loss takes it (``check_labels``), packed into one float32 array (``task.pack``).
    One-line ``DataError`` for an output name the model lacks or an output without labels."""
    names = task.names  # the user's model's (``model`` may be an InputPacking wrapper)
    unknown = sorted(set(y) - set(names))
    if unknown:
        raise DataError(f"Labels for output {unknown[0]!r} in the {split} split: the model has "
                        f"no such output (its outputs: {list(names)}).")
    missing = [head.name for head in task.heads if head.name not in y]
    if missing:
        trained = [head.name for head in task.heads]
        raise DataError(f"Labels missing for output {missing[0]!r} in the {split} split: "
                        f"expected labels for each output with a loss ({trained}), .npz key "
                        f"y_{split}_{missing[0]} or the dict key {missing[0]!r}.")
    checked = {}
    for i, head in zip(task.index or (), task.heads, strict=True):
        units = int(model.outputs[i].shape[-1] or 1) if len(model.outputs[i].shape) > 1 else 1
        checked[head.name] = check_labels(head.task, y[head.name], units,
                                          f"{split} ({head.name!r} output)")
        check_output_shape(model, head.task, checked[head.name], f"{data}: {head.name}", i)
        if split == "train":
            check_classes(head.task, checked[head.name], f"{data}: {head.name}")
    return task.pack(checked)


def _provisional_info(name: str, x: np.ndarray, y: np.ndarray) -> data_module.DatasetInfo:
    """What a builder is told before the task is known: the input shape, and the classes the
    labels name (integer labels: max + 1; one-hot rows: their width; else 1)."""
    y = np.asarray(y)
    if y.ndim >= 2 and y.shape[-1] > 1:
        classes = int(y.shape[-1])
    elif y.size and np.issubdtype(y.dtype, np.integer):
        classes = int(y.max()) + 1
    else:
        classes = 1
    return data_module.DatasetInfo(name, tuple(int(d) for d in np.shape(x)[1:]), classes,
                                   "user", "spatial", None, len(x), 0, 0)


def check_labels(task: Task, y: Any, units: int, split: str) -> np.ndarray:
    """``y`` as ``task``'s loss takes it (int32 classes, or float32 shaped as the output), or a
    one-line ``DataError`` naming what is wrong: floats for a sparse loss, a class >= the
    output's units, binary labels outside [0, 1], one-hot rows of the wrong width."""
    y = np.asarray(y)
    where = f"in the {split} split"
    if y.dtype == object:
        raise DataError(f"Invalid labels {where}: expected an array of numbers. Received "
                        f"{type(y.item()).__name__ if y.ndim == 0 else 'objects'}.")
    if not (np.issubdtype(y.dtype, np.number) or np.issubdtype(y.dtype, np.bool_)):
        raise DataError(f"Invalid labels {where}: dtype {y.dtype} is not numeric.")
    if np.issubdtype(y.dtype, np.floating) and not np.isfinite(y).all():
        raise DataError(f"Non-finite labels (NaN or Inf) {where}: clean or drop them.")
    if task.sparse_labels:
        if y.ndim == 2 and y.shape[1] == 1:
            y = y[:, 0]
        if y.ndim != 1:
            raise DataError(f"Invalid labels {where} for {task.loss_name}: expected class "
                            f"indices, one per sample. Received shape {y.shape}.")
        if np.issubdtype(y.dtype, np.floating) and not np.all(np.mod(y, 1) == 0):
            raise DataError(f"Invalid labels {where} for {task.loss_name}: expected integer "
                            f"class indices. Received floats such as {y[np.mod(y, 1) != 0][0]!r} "
                            "(a regression target needs a regression loss, e.g. mse).")
        if y.size and (y.min() < 0 or y.max() >= units):
            raise DataError(f"Invalid label {int(y.max() if y.max() >= units else y.min())} "
                            f"{where}: the model's output has {units} units, so labels must lie "
                            f"in [0, {units}).")
        return y.astype(np.int32)
    y = y.astype(np.float32)
    if y.ndim == 1:
        y = y[:, None]
    if y.shape[-1] != units:
        raise DataError(f"Invalid labels {where} for {task.loss_name}: each label has "
                        f"{y.shape[-1]} values but the model's output has {units} units.")
    if "crossentropy" in task.loss_name.lower() and y.size and (y.min() < 0 or y.max() > 1):
        raise DataError(f"Invalid labels {where} for {task.loss_name}: expected values in "
                        f"[0, 1]. Received values in [{y.min():g}, {y.max():g}].")
    return y


def check_output_shape(model: Any, task: Task, y: np.ndarray, name: str, index: int = 0) -> None:
    """A one-line ``ConfigError`` unless the model's output has the labels' shape (as
    ``check_labels`` returns them): one row of class scores per sample for class indices, else
    the label's own shape. A Dense head on images (no Flatten) gives one row per pixel."""
    outputs = getattr(model, "outputs", None)
    if not outputs:
        return
    got = tuple(outputs[index].shape[1:])
    want = (got[-1] if got else None,) if task.sparse_labels else tuple(y.shape[1:])
    if takes_shape(got, want):
        return
    labels = "class indices, one per sample" if task.sparse_labels else \
        f"labels of shape (N, {', '.join(map(str, want))})"
    shown = ", ".join("N" if d is None else str(d) for d in (None, *got))
    raise ConfigError(f"Model {name!r} gives outputs of shape ({shown}), and its loss "
                      f"{task.loss_name} takes {labels}: expected an output of shape "
                      f"(N, {', '.join(str(d) for d in want)}) (a Flatten or pooling layer "
                      "before the last Dense layer makes one row per sample).")


def check_classes(task: Task, y: np.ndarray, name: str) -> None:
    """A one-line ``DataError`` when a classification task's training labels (as
    ``check_labels`` returns them) hold a single class: a one-class model learns nothing and
    scores 0.0 or 1.0."""
    loss = task.loss_name.lower()
    if not (task.sparse_labels or "crossentropy" in loss or "hinge" in loss) or not len(y):
        return
    classes = np.argmax(y, axis=-1) if not task.sparse_labels and y.shape[-1] > 1 else y
    found = np.unique(classes)
    if len(found) < 2:
        raise DataError(f"Invalid data {name!r}: every training label is class "
                        f"{found[0].item():g}, and {task.loss_name} needs at least two classes.")


def _held_out(n: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(kept rows, held-out test rows): ``data.validation_indices``'s draw."""
    if max(1, round(n * fraction)) >= n:
        raise DataError(f"Too little data to hold out a split: {n} samples.")
    return data_module.validation_indices(n, fraction, seed)


def dataset_of(name: str, kind: str, splits: dict[str, tuple[np.ndarray, np.ndarray]],
               task: Task, units: int, validation_fraction: float,
               notes: list[str], owned: bool = False,
               known: data_module.DatasetInfo | None = None) -> data_module.Dataset:
    """The ``Dataset`` of the checked ``splits``: a test split held out when there is none,
    the validation split from ``validation_fraction``. ``owned``: the arrays were read from a
    file (``UserData.owned``), so the splits are taken out of them in place, not copied.
    ``known``: the data's description where its source gives one (a built-in dataset's source,
    layout and data format)."""
    x_train, y_train = _test_held_out(splits, validation_fraction, notes, owned)
    x_val, y_val = splits.get("val", (None, None))
    x_test, y_test = splits["test"]
    layout = "flat" if np.ndim(x_train) == 2 else "spatial"
    return data_module.from_arrays(
        name, x_train, y_train, x_test, y_test, num_classes=units,
        validation_fraction=validation_fraction, seed=SPLIT_SEED,
        source=known.source if known else kind, layout=known.layout if known else layout,
        data_format=known.data_format if known else None,
        sparse_labels=task.sparse_labels, x_val=x_val, y_val=y_val, owned=owned)

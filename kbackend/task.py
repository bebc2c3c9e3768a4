"""What a model is trained to do: its loss, the metric the engines report, and which way is better.

Every engine (Keras ``fit``, the native fused loops, data parallel, populations) trains
``Task.loss`` and reports ``Task.metric``, so a model compiled with
``BinaryCrossentropy(from_logits=True)`` trains that loss everywhere, not kbackend's default.
The task comes from the model's ``compile()`` when it has one (Keras's own convention: the
compiled loss is the task) and is otherwise inferred from the labels and the model's output
(``infer_task``), which the caller prints.

The native engines compute the loss and one metric per sample, in their compiled programs
(a mean over samples: accuracies and errors). Metrics that are not a mean over samples (AUC,
precision, recall) need state across batches and are refused with the list of those supported.

``metric_direction`` is the one answer to "is larger better?" for a metric name: targets,
early stopping, best values and the study's reports all ask it.

Keras is imported inside the functions that need it (this module is imported by the backend-free
layers, before the backend is chosen).
"""

from __future__ import annotations

import functools
import json
import operator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kbackend.errors import ConfigError

# Metrics that are a mean over samples, by the names Keras logs them under -> Keras's function.
MEAN_METRICS = {
    "sparse_categorical_accuracy": "sparse_categorical_accuracy",
    "categorical_accuracy": "categorical_accuracy",
    "binary_accuracy": "binary_accuracy",
    "mean_absolute_error": "mean_absolute_error",
    "mae": "mean_absolute_error",
    "mean_squared_error": "mean_squared_error",
    "mse": "mean_squared_error",
    "mean_absolute_percentage_error": "mean_absolute_percentage_error",
    "mape": "mean_absolute_percentage_error",
    "mean_squared_logarithmic_error": "mean_squared_logarithmic_error",
    "msle": "mean_squared_logarithmic_error",
}
# Per-sample metrics with an argument (k), by the name Keras logs them under by default and
# by their class -> Keras's function, which takes the argument.
TOP_K_METRICS = {
    "sparse_top_k_categorical_accuracy": "sparse_top_k_categorical_accuracy",
    "top_k_categorical_accuracy": "top_k_categorical_accuracy",
}
_TOP_K_CLASSES = {"SparseTopKCategoricalAccuracy": "sparse_top_k_categorical_accuracy",
                  "TopKCategoricalAccuracy": "top_k_categorical_accuracy"}
# Keras resolves "accuracy" by the labels and the output (keras.trainers.compile_utils).
ACCURACY_ALIASES = ("accuracy", "acc")
SUPPORTED_METRICS = (*ACCURACY_ALIASES, *MEAN_METRICS, *TOP_K_METRICS)

# Losses whose labels are class indices (stored as int32); every other loss takes float targets.
SPARSE_LOSSES = ("sparse_categorical_crossentropy", "SparseCategoricalCrossentropy")
_CLASSIFICATION_LOSSES = ("crossentropy", "hinge", "focal", "poisson", "kl_divergence",
                          "kldivergence")

# Which way is better, by the metric's name once its split prefix is gone.
_HIGHER_IS_BETTER = ("accuracy", "acc", "auc", "precision", "recall", "r2", "f1", "iou")
_LOWER_IS_BETTER = ("loss", "error", "mae", "mse", "mape", "msle", "rmse", "crossentropy",
                    "hinge", "huber", "logcosh", "poisson", "divergence")
_SPLITS = ("val_", "test_", "train_")


def metric_direction(name: str) -> str:
    """``"max"`` where larger values of metric ``name`` are better (accuracy, AUC, ...), ``"min"``
    where smaller are (losses and errors); a split prefix (``val_``, ``test_``) is ignored.
    An unknown name is a ``ConfigError``: a target's direction is never guessed."""
    base = next((name[len(prefix):] for prefix in _SPLITS if name.startswith(prefix)), name)
    words = base.lower().replace("-", "_").split("_")
    if any(word in _HIGHER_IS_BETTER for word in words) or base.lower().endswith("accuracy"):
        return "max"
    if any(word in _LOWER_IS_BETTER for word in words) or base.lower().endswith("loss"):
        return "min"
    raise ConfigError(f"Unknown direction for metric {name!r}: expected a loss or error (lower is "
                      "better) or an accuracy, AUC, precision or recall (higher is better).")


def better(name: str, value: float, than: float) -> bool:
    """Whether ``value`` of metric ``name`` is strictly better than ``than``."""
    return value > than if metric_direction(name) == "max" else value < than


def best_of(name: str, values: list[float]) -> float:
    """The best of ``values`` of metric ``name`` (max or min by ``metric_direction``)."""
    return max(values) if metric_direction(name) == "max" else min(values)


def reaches(name: str, value: float, target: float) -> bool:
    """Whether ``value`` of metric ``name`` meets ``target`` (>= or <= by its direction)."""
    return value >= target if metric_direction(name) == "max" else value <= target


@dataclass(frozen=True)
class Task:
    """A loss (a Keras loss identifier, serialized) and the one metric the engines report.

    ``loss`` is the JSON of ``keras.losses.serialize`` (or a loss name): hashable, so trainers
    compiled for one task are keyed by it, and stored with every history. ``metric`` is the name
    the metric is logged under (``val_<metric>``); ``metric_fn`` the Keras function computing it
    per sample. ``sparse_labels``: labels are int32 class indices (else float32 arrays shaped as
    the model's output). ``source``: ``"compiled"``, ``"inferred"`` or ``"builtin"``.
    """

    loss: str
    metric: str
    metric_fn: str
    sparse_labels: bool
    source: str = "builtin"
    # Keyword arguments of ``metric_fn`` (a top-k accuracy's ``k``), as sorted pairs (hashable).
    metric_args: tuple[tuple[str, Any], ...] = ()
    # The compiled ``Loss`` object itself where there is one: some losses' configs leave out
    # their arguments (Keras 3.15's ``Huber`` drops ``delta``), so the object is what trains.
    loss_instance: Any = field(default=None, compare=False, repr=False)

    @property
    def loss_name(self) -> str:
        """The loss as a person names it (``binary_crossentropy``, ``Huber``, ...)."""
        config = _loss_identifier(self.loss)
        if isinstance(config, dict):
            inner = config.get("config") or {}
            return str(inner.get("name") or config.get("class_name") or self.loss)
        return str(config)

    def describe(self) -> str:
        """One line: ``loss binary_crossentropy (from_logits), metric binary_accuracy``."""
        logits = " (from_logits)" if self.from_logits else ""
        args = "".join(f" ({key}={value})" for key, value in self.metric_args)
        return f"loss {self.loss_name}{logits}, metric {self.metric}{args}"

    @property
    def from_logits(self) -> bool:
        config = _loss_identifier(self.loss)
        return bool(isinstance(config, dict) and (config.get("config") or {}).get("from_logits"))

    def loss_object(self) -> Any:
        """The Keras ``Loss`` (a function loss wrapped as ``compile`` wraps it)."""
        return self.loss_instance if self.loss_instance is not None else _loss_object(self.loss)

    def per_sample_loss(self, y: Any, outputs: Any) -> Any:
        """The loss of each sample, shape ``(batch,)`` (before the mean ``compile`` takes), in
        float32 as Keras computes it (``Loss.__call__`` casts a mixed-precision model's
        float16 / bfloat16 outputs to the loss's float32)."""
        import keras  # deferred: Keras is imported once the backend is chosen

        if keras.backend.standardize_dtype(outputs.dtype) in ("float16", "bfloat16"):
            outputs = keras.ops.cast(outputs, "float32")
        return _per_sample(self.loss_object().call(y, outputs))

    def per_sample_metric(self, y: Any, outputs: Any) -> Any:
        """The metric of each sample, shape ``(batch,)``, as float32."""
        import keras  # deferred: Keras is imported once the backend is chosen

        values = getattr(keras.metrics, self.metric_fn)(y, outputs, **dict(self.metric_args))
        return _per_sample(keras.ops.cast(values, "float32"))

    def fit_labels(self, y: np.ndarray) -> Any:
        """Labels as Keras ``fit`` and ``evaluate`` take them (a multi-output task unpacks)."""
        return y

    def as_outputs(self, y: np.ndarray) -> Any:
        """Label-shaped values (a constant guess) as the model's outputs, for
        ``per_sample_metric``: a multi-output task's as one array per output."""
        return y

    def to_dict(self) -> dict[str, Any]:
        return {"loss": self.loss_name, "loss_config": self.loss, "metric": self.metric,
                "metric_fn": self.metric_fn, "metric_args": dict(self.metric_args),
                "sparse_labels": self.sparse_labels,
                "source": self.source, "from_logits": self.from_logits}


def _per_sample(values: Any) -> Any:
    """``values`` as one number per sample: the mean over any axes after the batch's (a
    multi-output regression's per-sample loss or a binary accuracy of shape ``(batch, 1)``)."""
    import keras  # deferred: Keras is imported once the backend is chosen

    if len(values.shape) <= 1:
        return values
    # Over the trailing axes, not a reshape to (batch, -1): a trace with an unknown batch size
    # (TF's adaptive trainer traces once for every size) has no static batch to reshape to.
    return keras.ops.mean(values, axis=tuple(range(1, len(values.shape))))


def _loss_identifier(loss: str) -> Any:
    """A stored ``Task.loss`` as Keras takes it: its JSON config (of ``[config, function
    arguments]``, the config), or the loss name itself."""
    try:
        identifier = json.loads(loss)
    except ValueError:
        return loss
    return identifier[0] if isinstance(identifier, list) else identifier


def _as_loss(obj: Any) -> Any:
    """``obj`` as a Keras ``Loss``: a function loss wrapped as ``compile`` wraps it."""
    import keras  # deferred: Keras is imported once the backend is chosen
    from keras.src.losses.losses import LossFunctionWrapper  # deferred: as above

    if isinstance(obj, keras.losses.Loss):
        return obj
    return LossFunctionWrapper(obj, name=getattr(obj, "__name__", None))


@functools.cache
def _loss_object(loss: str) -> Any:
    import keras  # deferred: Keras is imported once the backend is chosen

    return _as_loss(keras.losses.get(_loss_identifier(loss)))


# kbackend's own models end in a softmax over integer classes.
CLASSIFICATION = Task("sparse_categorical_crossentropy", "accuracy",
                      "sparse_categorical_accuracy", sparse_labels=True, source="builtin")


def _accuracy_fn(loss_name: str, output_units: int, sparse: bool) -> str:
    """The accuracy Keras's ``compile`` means by ``"accuracy"`` for this loss and output."""
    if "binary" in loss_name.lower() or (output_units == 1 and not sparse):
        return "binary_accuracy"
    return "sparse_categorical_accuracy" if sparse else "categorical_accuracy"


def _is_sparse(loss_name: str) -> bool:
    return loss_name in SPARSE_LOSSES or loss_name.lower().replace("_", "") == \
        "sparsecategoricalcrossentropy"


def _default_metric(loss_name: str) -> str:
    lowered = loss_name.lower()
    if any(word in lowered for word in _CLASSIFICATION_LOSSES):
        return "accuracy"
    return "mae" if "absolute" not in lowered and lowered != "mae" else "mse"


def make_task(loss: Any, metrics: list[Any] | None, output_units: int, *, source: str,
              prefer_metric: str | None = None) -> Task:
    """The task of a loss and metrics as ``compile`` takes them (names, configs or objects).

    ``prefer_metric`` (e.g. a target's ``mae``) picks which compiled metric the engines report;
    by default the first supported one, else the loss family's default (accuracy for
    cross-entropies, MAE for other regression losses). One-line ``ConfigError`` for a loss
    Keras does not know or a metric that is not a mean over samples."""
    import keras  # deferred: Keras is imported once the backend is chosen
    from keras.src.losses.losses import LossFunctionWrapper  # deferred: as above

    if isinstance(loss, (list, tuple, dict)) and not (isinstance(loss, dict) and
                                                      "class_name" in loss):
        raise ConfigError("Invalid loss: kbackend trains models with one output and one loss. "
                          f"Received: {loss!r}.")
    try:
        obj = keras.losses.get(loss)
    except (ValueError, TypeError) as error:
        raise ConfigError(f"Unknown loss {loss!r}: {' '.join(str(error).split())[:200]}") from None
    if obj is None:
        raise ConfigError("The model has no loss: compile it with one, or leave it uncompiled "
                          "and kbackend infers it from the labels.")
    obj = _as_loss(obj)
    key = loss if isinstance(loss, str) else json.dumps(
        [keras.losses.serialize(obj), getattr(obj, "_fn_kwargs", {})], sort_keys=True,
        default=str)
    name = type(obj).__name__ if type(obj) is not LossFunctionWrapper else \
        str(getattr(obj.fn, "__name__", obj.name))
    sparse = _is_sparse(name) or _is_sparse(getattr(getattr(obj, "fn", None), "__name__", ""))
    compiled = {_metric_name(m): _metric_args(m) for m in (metrics or [])}
    unsupported = [m for m in compiled if m not in SUPPORTED_METRICS]
    if compiled and len(unsupported) == len(compiled) and prefer_metric is None:
        chosen = unsupported[0]  # the model's own metric, never another in its place
    else:
        chosen = prefer_metric or next((m for m in compiled if m in SUPPORTED_METRICS), None) \
            or _default_metric(name)
    if chosen not in SUPPORTED_METRICS:
        raise ConfigError(
            f"Unsupported metric {chosen!r}: kbackend's engines compute metrics that are a mean "
            f"over samples: {', '.join(SUPPORTED_METRICS)}.")
    fn = (_accuracy_fn(name, output_units, sparse) if chosen in ACCURACY_ALIASES
          else MEAN_METRICS.get(chosen) or TOP_K_METRICS[chosen])
    classifier = any(w in name.lower() for w in _CLASSIFICATION_LOSSES)
    if (chosen in ACCURACY_ALIASES or chosen in TOP_K_METRICS) and not classifier:
        raise ConfigError(f"Invalid metric {chosen!r} for the regression loss {name}: use an "
                          "error metric such as mae or mse.")
    if sparse and chosen in MEAN_METRICS:
        raise ConfigError(f"Invalid metric {chosen!r} for the classifier's loss {name}: its "
                          "labels are class indices, which an error metric cannot compare with "
                          f"the {output_units} class probabilities; use accuracy.")
    instance = loss if isinstance(loss, keras.losses.Loss) else None
    return Task(key, "accuracy" if chosen == "acc" else chosen, fn, sparse, source,
                tuple(sorted(compiled.get(chosen, {}).items())), instance)


def _metric_args(metric: Any) -> dict[str, Any]:
    """The arguments a compiled per-sample metric passes its function (a top-k's ``k``)."""
    if isinstance(metric, dict):
        config = metric.get("config") or {}
    elif isinstance(metric, str):
        config = {}
    else:
        config = metric.get_config() if hasattr(metric, "get_config") else {}
    return {"k": int(config["k"])} if "k" in config else {}


def _metric_name(metric: Any) -> str:
    """The name Keras logs a compiled metric under."""
    if isinstance(metric, str):
        return metric
    if isinstance(metric, dict):
        if metric.get("class_name") in _TOP_K_CLASSES:  # under its function's name
            return _TOP_K_CLASSES[metric["class_name"]]
        return str((metric.get("config") or {}).get("name") or metric.get("class_name"))
    if type(metric).__name__ in _TOP_K_CLASSES:
        return _TOP_K_CLASSES[type(metric).__name__]
    name = getattr(metric, "name", None) or getattr(metric, "__name__", None)
    return str(name)


def task_of_model(model: Any, y: np.ndarray, *, prefer_metric: str | None = None) -> Task:
    """The task of ``model``: its compiled loss and metrics, else inferred from labels ``y``.
    A model with several outputs gets a ``MultiOutputTask`` (its compiled loss per output)."""
    if len(output_names(model)) > 1:
        return multi_output_task(model, prefer_metric=prefer_metric)
    units = output_units(model)
    loss = getattr(model, "loss", None) if getattr(model, "compiled", False) else None
    if loss is not None:
        config = model.get_compile_config() or {}
        return make_task(loss, _flat_metrics(config.get("metrics")), units,
                         source="compiled", prefer_metric=prefer_metric)
    return infer_task(y, units, prefer_metric=prefer_metric)


def _flat_metrics(metrics: Any) -> list[Any]:
    if metrics is None:
        return []
    if isinstance(metrics, dict):  # per output name: one output, so its list
        metrics = next(iter(metrics.values()), [])
    return list(metrics) if isinstance(metrics, (list, tuple)) else [metrics]


def output_units(model: Any) -> int:
    """The size of the model's last output axis (1 for a scalar output)."""
    shape = model.outputs[0].shape if getattr(model, "outputs", None) else model.output_shape
    return int(shape[-1]) if len(shape) > 1 and shape[-1] is not None else 1


def infer_task(y: np.ndarray, units: int, *, prefer_metric: str | None = None) -> Task:
    """The task of an uncompiled model, from its labels and output width: integer classes ->
    sparse categorical cross-entropy + accuracy; one output unit with 0/1 labels -> binary
    cross-entropy + binary accuracy; one-hot rows -> categorical cross-entropy; float targets
    -> MSE + MAE. ``from_logits`` is never assumed: give a compiled model for logits."""
    y = np.asarray(y)
    integral = np.issubdtype(y.dtype, np.integer) or np.issubdtype(y.dtype, np.bool_) or (
        np.issubdtype(y.dtype, np.floating) and y.size and bool(np.all(np.mod(y, 1) == 0)))
    binary = integral and y.size and set(np.unique(y).tolist()) <= {0, 1}
    if units == 1 and binary:
        loss, metric = "binary_crossentropy", "binary_accuracy"
    elif integral and (y.ndim == 1 or y.shape[-1] == 1) and units > 1:
        loss, metric = "sparse_categorical_crossentropy", "accuracy"
    elif binary and y.ndim == 2 and y.shape[-1] == units and np.all(y.sum(-1) == 1):
        loss, metric = "categorical_crossentropy", "accuracy"
    else:
        loss, metric = "mean_squared_error", "mae"
    return make_task(loss, [prefer_metric or metric], units, source="inferred")


# --- models with several outputs ---------------------------------------------------------------


def output_names(model: Any) -> tuple[str, ...]:
    """The names a model's outputs go by in ``compile``'s loss dict and in Keras's logs
    (``val_<output>_<metric>``): a functional model's ``output_names`` (its output layers'
    names, in output order); a model without them has one unnamed output, ``()``."""
    return tuple(str(name) for name in (getattr(model, "output_names", None) or ()))


@dataclass(frozen=True)
class OutputHead:
    """One output of a multi-output task: its name, its own task (loss, metric), the weight of
    its loss in the total, and where its labels lie in the packed label rows (``start``,
    ``shape``: one column of class indices for a sparse loss, else the label's own shape)."""

    name: str
    task: Task
    weight: float
    start: int
    shape: tuple[int, ...]

    @property
    def width(self) -> int:
        return int(np.prod(self.shape)) if self.shape else 1


@dataclass(frozen=True)
class MultiOutputTask(Task):
    """A model with several outputs, compiled with a loss per output (a dict or list, with
    ``loss_weights``). Every engine handles one label array: the outputs' labels are packed side
    by side into float32 rows (``pack``; class indices are exact up to 2**24), and the loss is
    Keras's total, the weighted sum of the outputs' losses (``per_sample_loss``); the metric the
    engines report is one output's (``metric_head``), named as Keras logs it (``cls_accuracy``).
    ``index``: the position of each head's output in the model's outputs (a list), or None
    where the model returns a dict keyed by the names."""

    heads: tuple[OutputHead, ...] = ()
    metric_head: str = ""
    index: tuple[int, ...] | None = None
    names: tuple[str, ...] = ()  # every output of the model, with a loss or not

    def describe(self) -> str:
        parts = ", ".join(f"{h.name}: {h.task.loss_name}"
                          f"{' (from_logits)' if h.task.from_logits else ''} x {h.weight:g}"
                          for h in self.heads)
        return f"loss {parts}; metric {self.metric}"

    @property
    def loss_name(self) -> str:
        return " + ".join(f"{h.weight:g} {h.task.loss_name}" for h in self.heads)

    @property
    def from_logits(self) -> bool:
        return False  # per output: each head's own task says

    def _output(self, outputs: Any, head: int) -> Any:
        if isinstance(outputs, dict):
            return outputs[self.heads[head].name]
        return outputs[self.index[head] if self.index is not None else head]

    def _labels(self, y: Any, head: OutputHead) -> Any:
        import keras  # deferred: Keras is imported once the backend is chosen

        part = y[:, head.start:head.start + head.width]
        if head.task.sparse_labels:
            return keras.ops.cast(part[:, 0], "int32")
        return keras.ops.reshape(part, (-1, *head.shape))

    def per_sample_loss(self, y: Any, outputs: Any) -> Any:
        """The weighted sum of the outputs' per-sample losses (Keras's total, before the mean)."""
        # A comprehension, not a loop with a running total: TensorFlow's autograph rewrites
        # loops and conditional expressions in a traced function (and got this one wrong).
        terms = [head.task.per_sample_loss(self._labels(y, head), self._output(outputs, i))
                 * head.weight for i, head in enumerate(self.heads)]
        return functools.reduce(operator.add, terms)

    def per_sample_metric(self, y: Any, outputs: Any) -> Any:
        i = next(i for i, head in enumerate(self.heads) if head.name == self.metric_head)
        head = self.heads[i]
        return head.task.per_sample_metric(self._labels(y, head), self._output(outputs, i))

    def output_results(self, outputs: Any, y: np.ndarray, prefix: str) -> dict[str, float]:
        """Each output's mean loss and metric on packed labels ``y`` given the model's
        ``outputs`` (host arrays, ``model.predict``'s), named as Keras's ``evaluate`` names them:
        ``<prefix>_<output>_loss``, ``<prefix>_<output>_<metric>`` (unweighted)."""
        import keras  # deferred: Keras is imported once the backend is chosen

        results = {}
        for i, head in enumerate(self.heads):
            labels, out = self._labels(y, head), self._output(outputs, i)
            for name, values in (("loss", head.task.per_sample_loss(labels, out)),
                                 (head.task.metric, head.task.per_sample_metric(labels, out))):
                mean = np.mean(keras.ops.convert_to_numpy(values))
                results[f"{prefix}_{head.name}_{name}"] = float(mean)
        return results

    def pack(self, labels: dict[str, np.ndarray]) -> np.ndarray:
        """Checked labels per output (``workload.check_labels``) as one float32 array."""
        return np.concatenate([np.asarray(labels[h.name], np.float32).reshape(
            len(labels[h.name]), h.width) for h in self.heads], axis=1)

    def fit_labels(self, y: np.ndarray) -> Any:
        return self.unpack(y)

    def as_outputs(self, y: np.ndarray) -> Any:
        outputs: list[Any] = [None] * max(len(self.names), len(self.heads))
        for i, head in enumerate(self.heads):
            part = np.asarray(y[:, head.start:head.start + head.width], np.float32)
            outputs[self.index[i] if self.index is not None else i] = \
                part.reshape(len(y), *head.shape) if head.shape else part
        return outputs

    def loss_object(self) -> Any:
        """The outputs' Keras losses, a dict by output name (as ``compile`` takes them)."""
        return {head.name: head.task.loss_object() for head in self.heads}

    def unpack(self, y: np.ndarray) -> dict[str, np.ndarray]:
        """Packed label rows as the dict of arrays Keras ``fit`` takes, keyed by output."""
        out = {}
        for head in self.heads:
            part = y[:, head.start:head.start + head.width]
            out[head.name] = part[:, 0].astype(np.int32) if head.task.sparse_labels else \
                part.reshape(len(y), *head.shape)
        return out

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "metric_output": self.metric_head,
                "outputs": {h.name: {**h.task.to_dict(), "weight": h.weight}
                            for h in self.heads}}


def _per_output(value: Any, names: tuple[str, ...], what: str) -> dict[str, Any]:
    """A compile setting given per output (a dict by name, or a list in output order) as a
    dict by name; a name no output has is a one-line ``ConfigError``."""
    if value is None:
        return {}
    if isinstance(value, dict) and "class_name" not in value:
        unknown = [key for key in value if key not in names]
        if unknown:
            raise ConfigError(f"Invalid {what}: output {unknown[0]!r} is not an output of the "
                              f"model, whose outputs are {list(names)}.")
        return dict(value)
    if isinstance(value, (list, tuple)):
        if len(value) != len(names):
            raise ConfigError(f"Invalid {what}: {len(value)} entries for the model's "
                              f"{len(names)} outputs {list(names)}.")
        return dict(zip(names, value, strict=True))
    return {name: value for name in names}  # one setting for every output, as Keras does


def split_metric(metric: str | None, names: tuple[str, ...]) -> tuple[str | None, str | None]:
    """``cls_accuracy`` -> (``cls``, ``accuracy``) for a model with outputs ``names`` (the
    longest name that prefixes it); ``None`` -> (None, None). A metric that names no output is
    a one-line ``ConfigError``."""
    if metric is None:
        return None, None
    for name in sorted(names, key=len, reverse=True):
        if metric.startswith(name + "_") and len(metric) > len(name) + 1:
            return name, metric[len(name) + 1:]
    raise ConfigError(f"Invalid target metric 'val_{metric}': a model with several outputs "
                      f"names one output's metric, val_<output>_<metric>, with <output> one of "
                      f"{list(names)} (or val_loss, the total).")


def multi_output_task(model: Any, *, prefer_metric: str | None = None) -> MultiOutputTask:
    """The task of a compiled model with several outputs: a head per output that has a loss
    (Keras trains nothing for an output left out of the loss dict), weighted by
    ``loss_weights`` (default 1). ``prefer_metric`` (``cls_accuracy``) picks the output and
    metric the engines report; by default the first output's first supported compiled metric,
    else the first output's default. One-line ``ConfigError`` for an uncompiled model, an
    output name no output has, or an output whose shape is not fixed."""
    names = output_names(model)
    if not getattr(model, "compiled", False) or getattr(model, "loss", None) is None:
        raise ConfigError(f"The model has {len(names)} outputs {list(names)} and no compiled "
                          "loss: compile it with a loss per output (a dict keyed by output name, "
                          "with loss_weights); kbackend infers a loss only for one output.")
    config = model.get_compile_config() or {}
    losses = {k: v for k, v in _per_output(model.loss, names, "loss").items() if v is not None}
    weights = _per_output(config.get("loss_weights"), names, "loss_weights")
    metrics = _output_metrics(config.get("metrics"), names)
    wanted, metric = split_metric(prefer_metric, names)
    if wanted is not None and wanted not in losses:
        raise ConfigError(f"Invalid target metric 'val_{prefer_metric}': output {wanted!r} has "
                          "no loss, so it is not trained.")
    chosen = wanted or next((n for n in names if n in losses and any(
        _metric_name(m) in SUPPORTED_METRICS for m in metrics.get(n, []))),
        next(n for n in names if n in losses))
    heads, start = [], 0
    for name in (n for n in names if n in losses):
        output = model.outputs[names.index(name)]
        units = int(output.shape[-1]) if len(output.shape) > 1 and output.shape[-1] else 1
        # Another output's metric is reported beside the target's where the engines can
        # compute it (its first supported one, else its loss family's default).
        supported = [m for m in metrics.get(name, []) if _metric_name(m) in SUPPORTED_METRICS]
        task = make_task(losses[name], metrics.get(name, []) if name == chosen else supported,
                         units, source="compiled",
                         prefer_metric=metric if name == chosen else None)
        shape = () if task.sparse_labels else tuple(output.shape[1:]) or (1,)
        if any(d is None for d in shape):
            raise ConfigError(f"Output {name!r} has shape {tuple(output.shape)}: kbackend packs "
                              "each output's labels in fixed-size rows; give it a fixed shape.")
        heads.append(OutputHead(name, task, float(weights.get(name, 1.0)), start, shape))
        start += heads[-1].width
    head = next(h for h in heads if h.name == chosen)
    key = json.dumps({"outputs": [[h.name, h.task.loss, h.weight, list(h.shape)] for h in heads],
                      "metric": [chosen, head.task.metric_fn, head.task.metric_args]},
                     sort_keys=True, default=str)
    index = tuple(names.index(h.name) for h in heads)
    return MultiOutputTask(key, f"{chosen}_{head.task.metric}", head.task.metric_fn, False,
                           "compiled", head.task.metric_args, None, tuple(heads), chosen, index,
                           names)


def _output_metrics(metrics: Any, names: tuple[str, ...]) -> dict[str, list[Any]]:
    """Compiled metrics per output: a dict by name, a list of lists in output order, or one
    flat list that Keras applies to every output."""
    if isinstance(metrics, (list, tuple)) and not all(isinstance(m, (list, tuple))
                                                      for m in metrics):
        metrics = {name: list(metrics) for name in names}
    return {name: _flat_metrics(value)
            for name, value in _per_output(metrics, names, "metrics").items()}

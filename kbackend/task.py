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
    base = name
    for prefix in _SPLITS:
        if base.startswith(prefix):
            base = base[len(prefix):]
            break
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
        try:
            config = json.loads(self.loss)
        except ValueError:
            return self.loss
        if isinstance(config, list):
            config = config[0]
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
        try:
            config = json.loads(self.loss)
        except ValueError:
            return False
        config = config[0] if isinstance(config, list) else config
        return bool(isinstance(config, dict) and (config.get("config") or {}).get("from_logits"))

    @property
    def label_dtype(self) -> type:
        return np.int32 if self.sparse_labels else np.float32

    def loss_object(self) -> Any:
        """The Keras ``Loss`` (a function loss wrapped as ``compile`` wraps it)."""
        return self.loss_instance if self.loss_instance is not None else _loss_object(self.loss)

    def per_sample_loss(self, y: Any, outputs: Any) -> Any:
        """The loss of each sample, shape ``(batch,)`` (before the mean ``compile`` takes)."""
        return _per_sample(self.loss_object().call(y, outputs))

    def per_sample_metric(self, y: Any, outputs: Any) -> Any:
        """The metric of each sample, shape ``(batch,)``, as float32."""
        import keras  # deferred: Keras is imported once the backend is chosen

        values = getattr(keras.metrics, self.metric_fn)(y, outputs, **dict(self.metric_args))
        return _per_sample(keras.ops.cast(values, "float32"))

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
    return keras.ops.mean(keras.ops.reshape(values, (values.shape[0], -1)), axis=1)


@functools.cache
def _loss_object(loss: str) -> Any:
    import keras  # deferred: Keras is imported once the backend is chosen
    from keras.src.losses.losses import LossFunctionWrapper  # deferred: as above

    try:
        identifier = json.loads(loss)
    except ValueError:
        identifier = loss
    if isinstance(identifier, list):  # [config, function arguments]
        identifier = identifier[0]
    obj = keras.losses.get(identifier)
    if not isinstance(obj, keras.losses.Loss):
        obj = LossFunctionWrapper(obj, name=getattr(obj, "__name__", None))
    return obj


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
    if not isinstance(obj, keras.losses.Loss):
        obj = LossFunctionWrapper(obj, name=getattr(obj, "__name__", None))
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
    """The task of ``model``: its compiled loss and metrics, else inferred from labels ``y``."""
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

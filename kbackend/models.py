"""Model builders that adapt to a dataset's input shape and class count.

Every builder takes the same options: ``dropout`` (rate after each hidden block, 0 for none),
``batch_norm`` (after each hidden layer, before its activation), ``l2`` (kernel
regularization factor, 0 for none) and ``seed``. Outputs are class probabilities (softmax,
kept in float32 so mixed-precision policies stay numerically safe).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil

from kbackend.backend_choice import keras as import_keras
from kbackend.backends import impl
from kbackend.data import DATA_FORMATS, DatasetInfo
from kbackend.errors import ConfigError, check_field_types, check_int_sequence

SEED_MLP_WIDTHS = (786, 256, 160)
READOUTS = ("last", "all")
# The most hidden layers --widths / --filters may list.
MAX_LAYERS = 256


def _is_real(value: Any) -> bool:
    """Whether ``value`` is a real number (not a bool, a string or NaN)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and not math.isnan(value)


@dataclass(frozen=True)
class ModelOptions:
    """Options shared by every builder."""

    dropout: float = 0.0
    batch_norm: bool = False
    l2: float = 0.0
    seed: int = 0
    data_format: str = "channels_last"
    widths: tuple[int, ...] = (256, 128)
    filters: tuple[int, ...] = (32, 64)
    units: int = 64
    # Dense stacks: add each hidden block's input to its output where the widths match.
    residual: bool = False
    # GRU: read the sequence both ways, and feed the classifier the last state ("last") or
    # every step's state, flattened ("all", the MNIST-1D paper's GRU).
    bidirectional: bool = False
    readout: str = "last"

    def __post_init__(self) -> None:
        check_field_types(self, {"batch_norm": bool, "seed": numbers.Integral,
                                 "data_format": str, "units": numbers.Integral,
                                 "residual": bool, "bidirectional": bool, "readout": str})
        check_int_sequence(self, "widths")
        check_int_sequence(self, "filters")
        # NaN passes every comparison test, so each number is checked to be a finite real first.
        if not (_is_real(self.dropout) and 0.0 <= self.dropout < 1.0):
            raise ConfigError(
                f"Invalid dropout: expected a rate in [0, 1). Received: {self.dropout!r}."
            )
        if not (_is_real(self.l2) and math.isfinite(self.l2) and self.l2 >= 0):
            raise ConfigError(
                f"Invalid l2: expected a finite factor >= 0. Received: {self.l2!r}."
            )
        for name, choices in (("data_format", DATA_FORMATS), ("readout", READOUTS)):
            if getattr(self, name) not in choices:
                raise ConfigError(f"Invalid {name}. Expected one of {list(choices)}. "
                                  f"Received: {getattr(self, name)!r}.")
        for name, what in (("widths", "layer widths"), ("filters", "channel counts")):
            sizes = getattr(self, name)
            if not sizes or any(size < 1 for size in sizes):
                raise ConfigError(f"Invalid {name} {sizes!r}: expected positive {what}.")
            if len(sizes) > MAX_LAYERS:  # depth is a size too: each layer is built in Python
                raise ConfigError(f"Invalid {name}: expected at most {MAX_LAYERS} layers. "
                                  f"Received: {len(sizes)}.")
        if not isinstance(self.units, int) or self.units < 1:
            raise ConfigError(f"Invalid units {self.units!r}: expected a positive integer.")

    def key(self) -> dict[str, Any]:
        """The options as a dict for store keys: the fields added after stores existed appear
        only when set, so the keys of runs stored before them stay valid."""
        return {name: value for name, value in asdict(self).items()
                if name not in _ADDED_LATER or value != _ADDED_LATER[name]}


# ModelOptions fields added after study stores existed, with their defaults (ModelOptions.key).
_ADDED_LATER = {"residual": False, "bidirectional": False, "readout": "last"}


_LAYOUT_OF_RANK = {1: "flat", 2: "sequence", 3: "image"}


def _require_rank(info: DatasetInfo, rank: int, name: str) -> tuple[int, ...]:
    """The input shape, or a ``ConfigError`` unless model ``name`` gets one input array of
    ``rank`` dimensions (its layout)."""
    if isinstance(info.input_shape, dict):
        raise ConfigError(
            f"Model {name!r} takes one input array; the data has named inputs "
            f"{sorted(info.input_shape)}."
        )
    if len(info.input_shape) != rank:
        layout = _LAYOUT_OF_RANK[rank]
        raise ConfigError(
            f"Model {name!r} needs {layout} inputs (layout {layout!r}). "
            f"Received input shape {info.input_shape}."
        )
    return info.input_shape


def _hidden_block(x: Any, layer: Any, options: ModelOptions, activation: str = "relu") -> Any:
    keras = import_keras()
    x = layer(x)
    if options.batch_norm:
        axis = 1 if options.data_format == "channels_first" and len(x.shape) >= 3 else -1
        x = keras.layers.BatchNormalization(axis=axis)(x)
    x = keras.layers.Activation(activation)(x)
    if options.dropout > 0:
        x = keras.layers.Dropout(options.dropout, seed=options.seed)(x)
    return x


def _regularizer(options: ModelOptions) -> Any:
    keras = import_keras()
    return keras.regularizers.L2(options.l2) if options.l2 > 0 else None


def _classifier_head(x: Any, info: DatasetInfo, options: ModelOptions) -> Any:
    keras = import_keras()
    x = keras.layers.Dense(info.num_classes, kernel_regularizer=_regularizer(options))(x)
    return keras.layers.Activation("softmax", dtype="float32", name="probabilities")(x)


# Parameter counts, computed from the same options as the builders without building anything:
# one ``<builder>_params(info, options) -> int`` next to each builder (exact Python integers, so
# no size overflows), tested to equal ``model.count_params()`` (tests/test_model_size.py).
def _hidden_params(fan_in: int, units: int, options: ModelOptions, bias: bool | None = None) -> int:
    """A hidden layer's kernel, its bias (none under batch norm unless ``bias``) and batch norm's
    four per-unit values (gamma, beta, moving mean and variance)."""
    with_bias = not options.batch_norm if bias is None else bias
    return fan_in * units + (units if with_bias else 0) + (4 * units if options.batch_norm else 0)


def _head_params(features: int, info: DatasetInfo) -> int:
    return features * info.num_classes + info.num_classes


def _dense_stack(info: DatasetInfo, widths: Sequence[int], options: ModelOptions, name: str) -> Any:
    keras = import_keras()
    shape = _require_rank(info, 1, name)
    inputs = keras.Input(shape=shape, name="inputs")
    x = inputs
    for width in widths:
        layer = keras.layers.Dense(width, kernel_regularizer=_regularizer(options),
                                   use_bias=not options.batch_norm)
        h = _hidden_block(x, layer, options)
        x = keras.layers.Add()([x, h]) if options.residual and x.shape[-1] == width else h
    return keras.Model(inputs, _classifier_head(x, info, options), name=name)


def _dense_stack_params(info: DatasetInfo, widths: Sequence[int], options: ModelOptions,
                        name: str) -> int:
    shape = _require_rank(info, 1, name)
    total, fan_in = 0, shape[0]
    for width in widths:
        total, fan_in = total + _hidden_params(fan_in, width, options), width
    return total + _head_params(fan_in, info)


def logistic(info: DatasetInfo, options: ModelOptions) -> Any:
    """Multinomial logistic regression: the flat inputs straight into the softmax classifier."""
    keras = import_keras()
    shape = _require_rank(info, 1, "logistic")
    inputs = keras.Input(shape=shape, name="inputs")
    return keras.Model(inputs, _classifier_head(inputs, info, options), name="logistic")


def logistic_params(info: DatasetInfo, options: ModelOptions) -> int:
    shape = _require_rank(info, 1, "logistic")
    return _head_params(shape[0], info)


def seed_mlp(info: DatasetInfo, options: ModelOptions) -> Any:
    """The classic MNIST network: inputs -> 786 -> 256 -> 160 -> classes, ReLU, softmax."""
    return _dense_stack(info, SEED_MLP_WIDTHS, options, "seed_mlp")


def seed_mlp_params(info: DatasetInfo, options: ModelOptions) -> int:
    return _dense_stack_params(info, SEED_MLP_WIDTHS, options, "seed_mlp")


def mlp(info: DatasetInfo, options: ModelOptions) -> Any:
    """A dense ReLU network with hidden widths ``options.widths``."""
    return _dense_stack(info, options.widths, options, "mlp")


def mlp_params(info: DatasetInfo, options: ModelOptions) -> int:
    return _dense_stack_params(info, options.widths, options, "mlp")


def _check_conv_format(options: ModelOptions) -> None:
    if options.data_format == "channels_first" and not impl().supports_channels_first_conv():
        raise ConfigError(
            "channels_first convolutions are not supported by this TensorFlow build on a CPU "
            "(only channels_last is); use data_format='channels_last' or the JAX backend."
        )


def cnn(info: DatasetInfo, options: ModelOptions) -> Any:
    """The conv net that fits the data: ``cnn2d`` for images, ``cnn1d`` for sequences."""
    return (cnn1d if len(info.input_shape) == 2 else cnn2d)(info, options, name="cnn")


def cnn_params(info: DatasetInfo, options: ModelOptions) -> int:
    count = cnn1d_params if len(info.input_shape) == 2 else cnn2d_params
    return count(info, options, name="cnn")


def cnn2d(info: DatasetInfo, options: ModelOptions, name: str = "cnn2d") -> Any:
    """Conv + max-pool blocks (``options.filters`` channels) and a dense layer, in
    ``options.data_format``.

    Older TensorFlow CPU builds implement Conv2D only for channels_last; where a probe
    (``supports_channels_first_conv``) finds that, channels_first raises ``ConfigError``
    (kbackend does not transpose behind your back). TF 2.21 runs NCHW on the CPU.
    """
    keras = import_keras()
    shape = _require_rank(info, 3, name)
    _check_conv_format(options)
    if info.data_format not in (None, options.data_format):
        raise ConfigError(
            f"Model data_format {options.data_format!r} does not match the dataset's "
            f"{info.data_format!r}: load the dataset with the same data_format."
        )
    inputs = keras.Input(shape=shape, name="inputs")
    x = inputs
    for filters in options.filters:
        conv = keras.layers.Conv2D(filters, 3, padding="same", data_format=options.data_format,
                                   kernel_regularizer=_regularizer(options),
                                   use_bias=not options.batch_norm)
        x = _hidden_block(x, conv, options)
        if min(x.shape[1:3] if options.data_format == "channels_last" else x.shape[2:4]) >= 2:
            x = keras.layers.MaxPooling2D(2, data_format=options.data_format)(x)
    x = keras.layers.Flatten(data_format=options.data_format)(x)
    x = _hidden_block(x, keras.layers.Dense(128, kernel_regularizer=_regularizer(options)), options)
    return keras.Model(inputs, _classifier_head(x, info, options), name=name)


def cnn2d_params(info: DatasetInfo, options: ModelOptions, name: str = "cnn2d") -> int:
    shape = _require_rank(info, 3, name)
    if options.data_format == "channels_last":
        height, width, channels = shape
    else:
        channels, height, width = shape
    total = 0
    for filters in options.filters:  # 3x3, "same" padding, then a 2x2 pool while both sides >= 2
        total, channels = total + _hidden_params(9 * channels, filters, options), filters
        if min(height, width) >= 2:
            height, width = height // 2, width // 2
    total += _hidden_params(height * width * channels, 128, options, bias=True)
    return total + _head_params(128, info)


def cnn1d(info: DatasetInfo, options: ModelOptions, name: str = "cnn1d") -> Any:
    """The MNIST-1D paper's conv net over a (steps, features) sequence: per ``options.filters``
    entry a strided 1-D convolution (kernel 5 first, then 3; stride 2; one step of zero padding
    each side) and ReLU, then the flattened features into the classifier.

    ``--filters 25,25,25`` is the paper's network (Greydanus 2020, ``ConvBase``). The inputs stay
    (N, steps, features) in either data format; ``channels_first`` transposes them inside the
    model and convolves in NCW (the layout choice, not the data, is what it measures).
    """
    keras = import_keras()
    shape = _require_rank(info, 2, name)
    _check_conv_format(options)
    inputs = keras.Input(shape=shape, name="inputs")
    x = inputs
    if options.data_format == "channels_first":
        x = keras.layers.Permute((2, 1))(x)
    for index, filters in enumerate(options.filters):
        x = keras.layers.ZeroPadding1D(1, data_format=options.data_format)(x)
        conv = keras.layers.Conv1D(filters, 5 if index == 0 else 3, strides=2,
                                   data_format=options.data_format,
                                   kernel_regularizer=_regularizer(options),
                                   use_bias=not options.batch_norm)
        x = _hidden_block(x, conv, options)
    x = keras.layers.Flatten(data_format=options.data_format)(x)
    return keras.Model(inputs, _classifier_head(x, info, options), name=name)


def cnn1d_params(info: DatasetInfo, options: ModelOptions, name: str = "cnn1d") -> int:
    shape = _require_rank(info, 2, name)
    steps, channels = shape
    total = 0
    for index, filters in enumerate(options.filters):  # pad 1 each side, kernel 5 then 3, stride 2
        kernel = 5 if index == 0 else 3
        total += _hidden_params(kernel * channels, filters, options)
        steps, channels = max((steps + 2 - kernel) // 2 + 1, 0), filters
    return total + _head_params(steps * channels, info)


def gru(info: DatasetInfo, options: ModelOptions) -> Any:
    """A GRU of ``options.units`` over a sequence (image rows as time steps) into a softmax.

    ``options.bidirectional`` reads the sequence both ways (states concatenated); ``readout``
    "last" feeds the classifier the final state, "all" every step's state flattened (with
    ``--units 6 --bidirectional``, the MNIST-1D paper's ``GRUBase``).
    """
    keras = import_keras()
    shape = _require_rank(info, 2, "gru")
    inputs = keras.Input(shape=shape, name="inputs")
    layer = keras.layers.GRU(options.units, kernel_regularizer=_regularizer(options),
                             seed=options.seed, return_sequences=options.readout == "all")
    if options.bidirectional:
        layer = keras.layers.Bidirectional(layer)
    x = layer(inputs)
    if options.readout == "all":
        x = keras.layers.Flatten()(x)
    if options.batch_norm:
        x = keras.layers.BatchNormalization()(x)
    if options.dropout > 0:
        x = keras.layers.Dropout(options.dropout, seed=options.seed)(x)
    return keras.Model(inputs, _classifier_head(x, info, options), name="gru")


def gru_params(info: DatasetInfo, options: ModelOptions) -> int:
    """Keras 3's GRU (``reset_after=True``): kernel (features, 3u), recurrent kernel (u, 3u) and
    bias (2, 3u), per direction."""
    shape = _require_rank(info, 2, "gru")
    steps, features = shape
    units, directions = options.units, 2 if options.bidirectional else 1
    total = directions * 3 * units * (features + units + 2)
    out = directions * units * (steps if options.readout == "all" else 1)
    return total + (4 * out if options.batch_norm else 0) + _head_params(out, info)


# name -> (builder, the data layout it takes)
MODELS: dict[str, tuple[Callable[[DatasetInfo, ModelOptions], Any], str]] = {
    "logistic": (logistic, "flat"),
    "seed_mlp": (seed_mlp, "flat"),
    "mlp": (mlp, "flat"),
    "cnn": (cnn, "spatial"),
    "cnn1d": (cnn1d, "sequence"),
    "cnn2d": (cnn2d, "image"),
    "gru": (gru, "sequence"),
}


# name -> its parameter count from the options, without building it (one per builder above).
PARAM_COUNTS: dict[str, Callable[[DatasetInfo, ModelOptions], int]] = {
    "logistic": logistic_params,
    "seed_mlp": seed_mlp_params,
    "mlp": mlp_params,
    "cnn": cnn_params,
    "cnn1d": cnn1d_params,
    "cnn2d": cnn2d_params,
    "gru": gru_params,
}
# name -> the option that sets its size (named in the refusal); the others are set by the data.
SIZE_OPTIONS = {"mlp": "widths", "cnn": "filters", "cnn1d": "filters", "cnn2d": "filters",
                "gru": "units"}
# What training keeps per parameter: float32 parameters, gradients and two optimizer slots
# (Adam's first and second moments): 4 copies of 4 bytes. Activations and data come on top.
TRAINING_COPIES = 4
BYTES_PER_TRAINING_PARAM = TRAINING_COPIES * 4


def count_params(name: str, info: DatasetInfo, options: ModelOptions | None = None) -> int:
    """Model ``name``'s parameter count (``model.count_params()``, non-trainable included),
    computed from ``info`` and ``options`` alone: nothing is built or allocated."""
    model_layout(name)
    return PARAM_COUNTS[name](info, options or ModelOptions())


def available_memory() -> int:
    """Bytes this process can still allocate: the system's available memory, or less where a
    cgroup (a container's memory limit) leaves less."""
    available = psutil.virtual_memory().available
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            limit = Path(limit_file).read_text().strip()
            usage = int(Path(usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit():
            available = min(available, max(int(limit) - usage, 0))
        break
    return available


def _size(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if nbytes < 1024 or unit == "PiB":
            return f"{nbytes:.3g} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")


def check_model_fits(name: str, info: DatasetInfo, options: ModelOptions | None = None,
                     *, available: int | None = None) -> int:
    """Model ``name``'s parameter count, or a one-line ``ConfigError`` (naming the option that
    sets its size) if its training state (``TRAINING_COPIES`` float32 copies of the parameters)
    would not fit in ``available`` bytes (default: ``available_memory()``). Nothing is built:
    a model of 10^18 parameters is refused in microseconds, not by the allocator."""
    options = options or ModelOptions()
    params = count_params(name, info, options)
    needed = params * BYTES_PER_TRAINING_PARAM
    available = available_memory() if available is None else available
    if needed > available:
        option = SIZE_OPTIONS.get(name)
        value = getattr(options, option) if option else None
        text = ",".join(map(str, value)) if isinstance(value, (tuple, list)) else str(value)
        shown = f"--{option} {text if len(text) <= 60 else text[:57] + '...'}" if option \
            else f"--model {name}"
        raise ConfigError(
            f"Invalid {shown}: model {name!r} on {info.name} {info.input_shape} is too large to "
            f"train here. Expected a training state (parameters, gradients and two optimizer "
            f"slots: {TRAINING_COPIES} float32 copies) within the available memory, "
            f"{_size(available)}. Received: {params:.3g} parameters, {_size(needed)}.")
    return params


def model_layout(name: str) -> str:
    """The data layout model ``name`` takes: flat, image, sequence, or spatial (the data's own:
    images as images, sequences as sequences)."""
    if name not in MODELS:
        raise ConfigError(f"Unknown model. Expected one of {sorted(MODELS)}. Received: {name!r}.")
    return MODELS[name][1]


def build_model(name: str, info: DatasetInfo, options: ModelOptions | None = None) -> Any:
    """Build model ``name`` for a dataset described by ``info``, seeded by ``options.seed``."""
    options = options or ModelOptions()
    check_model_fits(name, info, options)  # before any variable exists
    impl().set_random_seed(options.seed)
    return MODELS[name][0](info, options)

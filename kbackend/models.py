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
from dataclasses import dataclass
from typing import Any

from kbackend.backend_choice import keras as import_keras
from kbackend.backends import impl
from kbackend.data import DatasetInfo
from kbackend.errors import ConfigError

SEED_MLP_WIDTHS = (786, 256, 160)


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

    def __post_init__(self) -> None:
        # NaN passes every comparison test, so each number is checked to be a finite real first.
        if not (_is_real(self.dropout) and 0.0 <= self.dropout < 1.0):
            raise ConfigError(
                f"Invalid dropout: expected a rate in [0, 1). Received: {self.dropout!r}."
            )
        if not (_is_real(self.l2) and math.isfinite(self.l2) and self.l2 >= 0):
            raise ConfigError(
                f"Invalid l2: expected a finite factor >= 0. Received: {self.l2!r}."
            )
        if self.data_format not in ("channels_last", "channels_first"):
            raise ConfigError(
                "Invalid data_format. Expected one of ['channels_last', 'channels_first']. "
                f"Received: {self.data_format!r}."
            )
        if not self.widths or any(w < 1 for w in self.widths):
            raise ConfigError(f"Invalid widths {self.widths!r}: expected positive layer widths.")


def _hidden_block(x: Any, layer: Any, options: ModelOptions, activation: str = "relu") -> Any:
    keras = import_keras()
    x = layer(x)
    if options.batch_norm:
        axis = 1 if options.data_format == "channels_first" and len(x.shape) == 4 else -1
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


def _dense_stack(info: DatasetInfo, widths: Sequence[int], options: ModelOptions, name: str) -> Any:
    keras = import_keras()
    if len(info.input_shape) != 1:
        raise ConfigError(
            f"Model {name!r} needs flat inputs (layout 'flat'). Received input shape {info.input_shape}."
        )
    inputs = keras.Input(shape=info.input_shape, name="inputs")
    x = inputs
    for width in widths:
        layer = keras.layers.Dense(width, kernel_regularizer=_regularizer(options),
                                   use_bias=not options.batch_norm)
        x = _hidden_block(x, layer, options)
    return keras.Model(inputs, _classifier_head(x, info, options), name=name)


def seed_mlp(info: DatasetInfo, options: ModelOptions) -> Any:
    """The classic MNIST network: inputs -> 786 -> 256 -> 160 -> classes, ReLU, softmax."""
    return _dense_stack(info, SEED_MLP_WIDTHS, options, "seed_mlp")


def mlp(info: DatasetInfo, options: ModelOptions) -> Any:
    """A dense ReLU network with hidden widths ``options.widths``."""
    return _dense_stack(info, options.widths, options, "mlp")


def cnn(info: DatasetInfo, options: ModelOptions) -> Any:
    """Two conv + max-pool blocks and a dense layer, in ``options.data_format``.

    Older TensorFlow CPU builds implement Conv2D only for channels_last; where a probe
    (``supports_channels_first_conv``) finds that, channels_first raises ``ConfigError``
    (kbackend does not transpose behind your back). TF 2.21 runs NCHW on the CPU.
    """
    keras = import_keras()
    if len(info.input_shape) != 3:
        raise ConfigError(
            f"Model 'cnn' needs image inputs (layout 'image'). Received input shape {info.input_shape}."
        )
    if options.data_format == "channels_first" and not impl().supports_channels_first_conv():
        raise ConfigError(
            "channels_first convolutions are not supported by this TensorFlow build on a CPU "
            "(only channels_last is); use data_format='channels_last' or the JAX backend."
        )
    if info.data_format not in (None, options.data_format):
        raise ConfigError(
            f"Model data_format {options.data_format!r} does not match the dataset's "
            f"{info.data_format!r}: load the dataset with the same data_format."
        )
    inputs = keras.Input(shape=info.input_shape, name="inputs")
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
    return keras.Model(inputs, _classifier_head(x, info, options), name="cnn")


def gru(info: DatasetInfo, options: ModelOptions) -> Any:
    """A GRU over a sequence (image rows as time steps), its last state into a softmax."""
    keras = import_keras()
    if len(info.input_shape) != 2:
        raise ConfigError(
            f"Model 'gru' needs sequence inputs (layout 'sequence'). Received input shape {info.input_shape}."
        )
    inputs = keras.Input(shape=info.input_shape, name="inputs")
    x = keras.layers.GRU(options.units, kernel_regularizer=_regularizer(options), seed=options.seed)(inputs)
    if options.batch_norm:
        x = keras.layers.BatchNormalization()(x)
    if options.dropout > 0:
        x = keras.layers.Dropout(options.dropout, seed=options.seed)(x)
    return keras.Model(inputs, _classifier_head(x, info, options), name="gru")


# name -> (builder, the data layout it takes)
MODELS: dict[str, tuple[Callable[[DatasetInfo, ModelOptions], Any], str]] = {
    "seed_mlp": (seed_mlp, "flat"),
    "mlp": (mlp, "flat"),
    "cnn": (cnn, "image"),
    "gru": (gru, "sequence"),
}


def model_layout(name: str) -> str:
    """The data layout (flat, image, sequence) model ``name`` takes."""
    if name not in MODELS:
        raise ConfigError(f"Unknown model. Expected one of {sorted(MODELS)}. Received: {name!r}.")
    return MODELS[name][1]


def build_model(name: str, info: DatasetInfo, options: ModelOptions | None = None) -> Any:
    """Build model ``name`` for a dataset described by ``info``, seeded by ``options.seed``."""
    options = options or ModelOptions()
    model_layout(name)
    impl().set_random_seed(options.seed)
    return MODELS[name][0](info, options)

"""A small grammar of Keras architectures as JSON-able dicts, and the builder that realizes them.

The property suite draws architectures (``tests/equivalence/strategies.py``) as plain dicts, so a
failing example prints as readable JSON and is rebuilt identically in every worker process.
An architecture::

    {"input": {"shape": [8, 8, 3], "dtype": "float32"},      # or int32 with "vocab": n
     "data_format": "channels_last",
     "layers": [{"type": "conv2d", "filters": 4, "kernel": 3, "padding": "same",
                 "activation": "relu"}, {"type": "maxpool"}, {"type": "flatten"}],
     "outputs": 3}

Layer types: dense, conv1d, conv2d, maxpool, avgpool, batchnorm, layernorm, dropout, activation,
embedding, gru, lstm, flatten, gap (global average pooling), residual (``body``: layers that keep
the shape; a body conv/dense with ``"filters"``/``"units"`` of ``"same"`` keeps the channel
count). ``"output_activation"`` (e.g. softmax) follows the head. Every layer gets a fixed name
(``l<index>_<type>``) so weight paths read the same in every process. The head is a Dense layer
with ``outputs`` units (logits). ``data_format`` applies to convolutions, pooling, flatten and to
the channel axis of batch and layer normalization.
"""

from __future__ import annotations

from typing import Any

from kbackend.backend_choice import keras as import_keras
from kbackend.errors import ConfigError

LAYER_TYPES = ("dense", "conv1d", "conv2d", "maxpool", "avgpool", "batchnorm", "layernorm",
               "dropout", "activation", "embedding", "gru", "lstm", "flatten", "gap", "residual")


def _channel_axis(data_format: str, rank: int) -> int:
    return 1 if data_format == "channels_first" and rank >= 3 else -1


def _layer(spec: dict[str, Any], name: str, x: Any, data_format: str) -> Any:
    """Apply the layer ``spec`` to the symbolic tensor ``x``."""
    keras = import_keras()
    kind = spec["type"]
    rank = len(x.shape)
    channels = x.shape[_channel_axis(data_format, rank)]
    if kind == "dense":
        units = channels if spec["units"] == "same" else spec["units"]
        return keras.layers.Dense(units, activation=spec.get("activation"), name=name)(x)
    if kind in ("conv1d", "conv2d"):
        filters = channels if spec["filters"] == "same" else spec["filters"]
        layer = keras.layers.Conv1D if kind == "conv1d" else keras.layers.Conv2D
        return layer(filters, spec["kernel"], padding=spec.get("padding", "valid"),
                     activation=spec.get("activation"), data_format=data_format, name=name)(x)
    if kind in ("maxpool", "avgpool"):
        pool = {("maxpool", 3): keras.layers.MaxPooling1D,
                ("maxpool", 4): keras.layers.MaxPooling2D,
                ("avgpool", 3): keras.layers.AveragePooling1D,
                ("avgpool", 4): keras.layers.AveragePooling2D}[(kind, rank)]
        return pool(spec.get("pool", 2), data_format=data_format, name=name)(x)
    if kind == "batchnorm":
        return keras.layers.BatchNormalization(axis=_channel_axis(data_format, rank),
                                               momentum=spec.get("momentum", 0.9), name=name)(x)
    if kind == "layernorm":
        return keras.layers.LayerNormalization(axis=_channel_axis(data_format, rank), name=name)(x)
    if kind == "dropout":
        return keras.layers.Dropout(spec.get("rate", 0.5), seed=0, name=name)(x)
    if kind == "activation":
        if spec["activation"] == "softmax":  # over the channels, whatever the data format
            return keras.layers.Softmax(axis=_channel_axis(data_format, rank), name=name)(x)
        return keras.layers.Activation(spec["activation"], name=name)(x)
    if kind == "embedding":
        return keras.layers.Embedding(spec["input_dim"], spec["output_dim"], name=name)(x)
    if kind in ("gru", "lstm"):
        layer = keras.layers.GRU if kind == "gru" else keras.layers.LSTM
        return layer(spec["units"], return_sequences=spec.get("return_sequences", False),
                     name=name)(x)
    if kind == "flatten":
        return keras.layers.Flatten(data_format=data_format, name=name)(x)
    if kind == "gap":
        pool = (keras.layers.GlobalAveragePooling1D if rank == 3
                else keras.layers.GlobalAveragePooling2D)
        return pool(data_format=data_format, name=name)(x)
    if kind == "residual":
        y = x
        for index, inner in enumerate(spec["body"]):
            y = _layer(inner, f"{name}_{index}_{inner['type']}", y, data_format)
        if tuple(y.shape) != tuple(x.shape):
            raise ConfigError(f"Residual block {name!r} changes the shape {tuple(x.shape)} -> "
                              f"{tuple(y.shape)}: its body must keep the shape.")
        return keras.layers.Add(name=f"{name}_add")([x, y])
    raise ConfigError(f"Unknown layer type. Expected one of {list(LAYER_TYPES)}. "
                      f"Received: {kind!r}.")


def build_model(arch: dict[str, Any]) -> Any:
    """The Keras functional model ``arch`` describes (weights freshly initialized)."""
    keras = import_keras()
    data_format = arch.get("data_format", "channels_last")
    spec_in = arch["input"]
    inputs = keras.Input(shape=tuple(spec_in["shape"]), dtype=spec_in.get("dtype", "float32"),
                         name="inputs")
    x = inputs
    for index, spec in enumerate(arch["layers"]):
        x = _layer(spec, f"l{index}_{spec['type']}", x, data_format)
    outputs = keras.layers.Dense(arch["outputs"], activation=arch.get("output_activation"),
                                 name="head")(x)
    return keras.Model(inputs, outputs, name=arch.get("name", "arch"))

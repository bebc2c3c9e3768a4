"""Hypothesis strategies: random valid Keras models (as ``grammar`` architectures) and data.

``cases()`` draws a ``ModelCase``: an architecture from a grammar of layers (Dense, Conv1D, Conv2D,
pooling, BatchNormalization, LayerNormalization, Dropout, Embedding, GRU, LSTM, activations,
residual adds), a batch size, a loss, and seeds and magnitudes for weights and inputs (tiny,
unit and large). Everything is plain JSON, so a failing example shrinks to a small model and
prints as a reproducer. Weights and data are made with NumPy in the calling process
(``materialize``) and copied to every backend.

Needs hypothesis (a test dependency): test code, kept beside the tests that draw from it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from hypothesis import strategies as st

from kbackend.equivalence.randomdata import random_inputs, random_targets, random_weights

FAMILIES = ("dense", "conv1d", "conv2d", "sequence", "tokens")
IMAGE_FAMILIES = ("conv1d", "conv2d")
# Simplest first: hypothesis shrinks a sampled_from towards its first element.
ACTIVATIONS = ("relu", "tanh", "sigmoid", "gelu", "softplus", "elu", "selu", "swish", "softmax")
MAGNITUDES = (1.0, 1e-3, 1e3)
WEIGHT_SCALES = (1.0, 0.01, 10.0)
LOSSES = ("mse", "sparse_categorical_crossentropy_from_logits")


@dataclass(frozen=True)
class ModelCase:
    """One drawn example: architecture, data sizes and the seeds / scales of weights and data."""

    arch: dict[str, Any]
    batch_size: int
    loss: str
    weight_seed: int
    weight_scale: float
    data_seed: int
    input_scale: float

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @property
    def source(self) -> dict[str, Any]:
        return {"kind": "arch", "arch": self.arch}

    def keras_loss(self) -> Any:
        """The loss as ``keras.losses.get`` takes it."""
        if self.loss.endswith("_from_logits"):
            return {"class_name": "SparseCategoricalCrossentropy", "config": {"from_logits": True}}
        return self.loss


def _spatial_options(family: str, spatial: list[int], data_format: str,
                     dropout: bool = True) -> list[str]:
    options = ["activation", "batchnorm", "layernorm"] + (["dropout"] if dropout else [])
    if not spatial:
        return [*options, "dense", "residual"]
    options += ["conv", "residual"]
    if data_format == "channels_last":
        options.append("dense")  # Dense acts on the last axis: the channels only in channels_last
    if min(spatial) >= 2:
        options += ["maxpool", "avgpool"]
    if family in ("sequence", "tokens"):
        options += ["gru", "lstm"]
    return options


@st.composite
def _conv(draw: Any, spatial: list[int], filters: Any = None) -> tuple[dict[str, Any], list[int]]:
    padding = draw(st.sampled_from(["same", "valid"])) if filters is None else "same"
    kernel = draw(st.integers(1, min(3, *spatial)))
    spec = {"type": "conv1d" if len(spatial) == 1 else "conv2d",
            "filters": filters if filters is not None else draw(st.integers(1, 4)),
            "kernel": kernel, "padding": padding,
            "activation": draw(st.sampled_from([None, "relu", "tanh"]))}
    new_spatial = spatial if padding == "same" else [d - kernel + 1 for d in spatial]
    return spec, new_spatial


def _input(draw: Any, family: str, data_format: str
           ) -> tuple[dict[str, Any], list[dict[str, Any]], list[int], int]:
    """The input of an architecture of ``family``: its spec, the layers it starts with (a
    token family's embedding), its spatial sizes and channels."""
    if family == "dense":
        channels = draw(st.integers(1, 6))
        return {"shape": [channels], "dtype": "float32"}, [], [], channels
    if family == "tokens":
        length, vocab = draw(st.integers(2, 6)), draw(st.integers(2, 10))
        channels = draw(st.integers(1, 4))
        return ({"shape": [length], "dtype": "int32", "vocab": vocab},
                [{"type": "embedding", "input_dim": vocab, "output_dim": channels}],
                [length], channels)
    rank = 2 if family == "conv2d" else 1
    spatial = [draw(st.integers(2, 7)) for _ in range(rank)]
    channels = draw(st.integers(1, 3))
    shape = [channels, *spatial] if data_format == "channels_first" else [*spatial, channels]
    return {"shape": shape, "dtype": "float32"}, [], spatial, channels


def _layer(draw: Any, kind: str, spatial: list[int],
           channels: int) -> tuple[dict[str, Any], list[int], int]:
    """One hidden layer of ``kind`` after an output of ``spatial`` sizes and ``channels``: its
    spec and the spatial sizes and channels after it."""
    if kind == "activation":
        return {"type": "activation", "activation": draw(st.sampled_from(ACTIVATIONS))}, \
            spatial, channels
    if kind in ("batchnorm", "layernorm"):
        return {"type": kind}, spatial, channels
    if kind == "dropout":
        return {"type": "dropout", "rate": draw(st.sampled_from([0.5, 0.1]))}, spatial, channels
    if kind == "dense":
        channels = draw(st.integers(1, 6))
        return {"type": "dense", "units": channels,
                "activation": draw(st.sampled_from([None, "relu", "tanh"]))}, spatial, channels
    if kind == "conv":
        spec, spatial = draw(_conv(spatial))
        return spec, spatial, spec["filters"]
    if kind in ("maxpool", "avgpool"):
        return {"type": kind, "pool": 2}, [d // 2 for d in spatial], channels
    if kind in ("gru", "lstm"):
        channels = draw(st.integers(1, 4))
        return {"type": kind, "units": channels, "return_sequences": True}, spatial, channels
    # residual: a conv (or dense) body keeping the shape, maybe a normalization after it
    body = ([draw(_conv(spatial, filters="same"))[0]] if spatial else
            [{"type": "dense", "units": "same",
              "activation": draw(st.sampled_from([None, "relu", "tanh"]))}])
    if draw(st.booleans()):
        body.append({"type": draw(st.sampled_from(["batchnorm", "layernorm"]))})
    return {"type": "residual", "body": body}, spatial, channels


@st.composite
def architectures(draw: Any, families: tuple[str, ...] = FAMILIES,
                  data_format: str = "channels_last", max_layers: int = 4,
                  output_activation: str | None = None, dropout: bool = True) -> dict[str, Any]:
    """A random valid architecture of ``kbackend.equivalence.grammar`` (head: Dense logits,
    or ``output_activation`` after it). ``dropout=False`` leaves out Dropout layers (for
    comparisons of training runs, where two engines draw different masks)."""
    family = draw(st.sampled_from(families))
    input_spec, layers, spatial, channels = _input(draw, family, data_format)
    for _ in range(draw(st.integers(0, max_layers))):
        kind = draw(st.sampled_from(_spatial_options(family, spatial, data_format, dropout)))
        spec, spatial, channels = _layer(draw, kind, spatial, channels)
        layers.append(spec)
    if spatial:
        heads = ["flatten", "gap"]
        if family in ("sequence", "tokens"):
            heads += ["gru", "lstm"]
        head = draw(st.sampled_from(heads))
        layers.append({"type": head, "units": draw(st.integers(1, 4))} if head in ("gru", "lstm")
                      else {"type": head})
    arch = {"input": input_spec, "data_format": data_format, "layers": layers,
            "outputs": draw(st.integers(1, 4))}
    if output_activation:
        arch["output_activation"] = output_activation
    return arch


@st.composite
def cases(draw: Any, families: tuple[str, ...] = FAMILIES, data_format: str = "channels_last",
          losses: tuple[str, ...] = LOSSES, max_layers: int = 4) -> ModelCase:
    """A ``ModelCase``: architecture, batch size, loss, seeds and magnitudes."""
    arch = draw(architectures(families, data_format, max_layers))
    return ModelCase(
        arch=arch, batch_size=draw(st.integers(1, 5)), loss=draw(st.sampled_from(losses)),
        weight_seed=draw(st.integers(0, 2**16)), weight_scale=draw(st.sampled_from(WEIGHT_SCALES)),
        data_seed=draw(st.integers(0, 2**16)), input_scale=draw(st.sampled_from(MAGNITUDES)),
    )


def materialize(case: ModelCase, description: dict[str, Any]) -> tuple[list, list, list]:
    """Weights, inputs and targets of ``case`` for the model a worker described."""
    weights = random_weights(description["weight_names"], [w.shape for w in description["weights"]],
                             case.weight_seed, case.weight_scale)
    x = random_inputs(description, case.batch_size, case.data_seed, case.input_scale)
    y = random_targets(description, case.batch_size, case.data_seed,
                       sparse_classes=case.loss.startswith("sparse"))
    return weights, x, y


def with_data_format(arch: dict[str, Any], data_format: str) -> dict[str, Any]:
    """``arch`` with its input shape and ``data_format`` switched to ``data_format``."""
    current = arch.get("data_format", "channels_last")
    shape = list(arch["input"]["shape"])
    if current != data_format and len(shape) >= 2:
        shape = ([shape[-1], *shape[:-1]] if data_format == "channels_first"
                 else [*shape[1:], shape[0]])
    return {**arch, "data_format": data_format, "input": {**arch["input"], "shape": shape}}

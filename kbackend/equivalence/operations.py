"""What a worker does with a model on its own backend (imported only inside worker processes).

Every operation starts from a *source* (where the model comes from) and explicit weights, so
both backends always compute with the very same float32 values, copied, never re-seeded:

- a model source as JSON (``ModelSource.to_json``): a saved ``.keras`` file (loaded with its
  weights; its ``unsafe_deserialization`` loads ``Lambda`` layers), or a builder with
  ``"input_shape": [...]`` and ``"num_classes": n`` beside it, built for that data;
- ``{"kind": "config", "config": json}``: a Keras model config (``model.to_json()``);
- ``{"kind": "arch", "arch": {...}}``: an architecture of ``kbackend.equivalence.grammar``.

Stochastic layers cannot draw the same random numbers on two backends (different RNGs), so
training-mode computations run with them made inert (Dropout rate 0 and the like): Dropout is
compared in inference mode, as documented in docs/equivalence.md.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kbackend import data
from kbackend.backend_choice import keras as import_keras
from kbackend.backends import impl
from kbackend.engines import get_engine
from kbackend.equivalence.grammar import build_model
from kbackend.io import atomic_write
from kbackend.model_sources import ModelSource, load_model
from kbackend.optim import OptimizerSpec
from kbackend.training import TrainConfig

# Attributes that make a layer stochastic in training mode, and the inert value of each.
_STOCHASTIC_ATTRIBUTES = {"rate": 0.0, "stddev": 0.0, "dropout": 0.0, "recurrent_dropout": 0.0}


def _model(source: dict[str, Any], compile: bool = False) -> Any:
    """The Keras model ``source`` describes: an architecture built here, any other kind loaded
    by ``kbackend.model_sources.load_model`` (a builder's compiled as its builder compiles it;
    ``compile``: a ``.keras`` file's with its saved compile settings)."""
    if source["kind"] == "arch":
        return build_model(source["arch"])
    if source["kind"] == "config":
        return load_model(source["config"], compile=compile)
    model = ModelSource.from_json(source)
    if "input_shape" not in source:  # a file: loaded with its weights
        return load_model(model.path, compile=compile,
                          unsafe_deserialization=model.unsafe_deserialization)
    info = data.DatasetInfo("equivalence", tuple(int(d) for d in source["input_shape"]),
                            int(source["num_classes"]), "arrays", "spatial", None, 1, 0, 0)
    return load_model(model, info=info)


def compiled_loss(source: dict[str, Any], model: Any = None) -> Any:
    """The loss the model of ``source`` was compiled with (serialized), or None: a ``.keras``
    file's, or the one its builder compiled ``model`` (as built by ``_model``) with."""
    keras = import_keras()
    if source["kind"] == "keras_file":
        try:
            model = _model(source, compile=True)
        except Exception:  # a compile config that does not load: the caller chooses a loss
            return None
    elif source["kind"] != "builder" or not getattr(model, "compiled", False):
        return None
    loss = getattr(model, "loss", None)
    if loss is None:
        return None
    return loss if isinstance(loss, str) else keras.losses.serialize(loss)


def weight_names(model: Any) -> list[str]:
    """A unique, readable name for each of ``model.weights`` (its variable path)."""
    names, seen = [], set()
    for index, variable in enumerate(model.weights):
        name = getattr(variable, "path", None) or variable.name
        if name in seen:
            name = f"{name}#{index}"
        seen.add(name)
        names.append(name)
    return names


def output_names(model: Any) -> list[str]:
    """A name for each of ``model.outputs``: a functional model's ``output_names``; a
    ``Sequential`` model has none, and its one output is its last layer's."""
    names = getattr(model, "output_names", None)
    if names:
        return list(names)
    if len(model.outputs) == 1 and model.layers:
        return [model.layers[-1].name]
    return [f"output_{index}" for index in range(len(model.outputs))]


def inert_stochastic_layers(model: Any) -> list[str]:
    """Make Dropout-like layers (and RNN dropout) deterministic; return their names."""
    changed = []
    for layer in model._flatten_layers(include_self=False, recursive=True):
        for owner in (layer, getattr(layer, "cell", None)):
            if owner is None:
                continue
            for attribute, inert in _STOCHASTIC_ATTRIBUTES.items():
                value = getattr(owner, attribute, None)
                if (isinstance(value, int | float) and not isinstance(value, bool)
                        and value != inert):
                    setattr(owner, attribute, inert)
                    changed.append(f"{layer.name}.{attribute}")
    return changed


def _inputs(model: Any, x: list[np.ndarray]) -> Any:
    return x if len(model.inputs) > 1 else x[0]


def forward(model: Any, x: list[np.ndarray]) -> list[np.ndarray]:
    """Inference-mode outputs of ``model`` on ``x``, one array per output."""
    keras = import_keras()
    outputs = model(_inputs(model, x), training=False)
    return [np.asarray(keras.ops.convert_to_numpy(o)) for o in keras.tree.flatten(outputs)]


def describe(source: dict[str, Any], seed: int = 0) -> dict[str, Any]:
    """Config, weights, and input / output signatures of the model ``source`` describes.

    A model built from an architecture gets its initial weights from ``seed`` (not from whatever
    state the worker's generator was left in), so a case is the same in every run."""
    keras = import_keras()
    impl().set_random_seed(seed)
    model = _model(source)
    inputs = []
    for tensor in model.inputs:
        dtype = str(keras.backend.standardize_dtype(tensor.dtype))
        inputs.append({"shape": [None if d is None else int(d) for d in tensor.shape],
                       "dtype": dtype, "int_high": _integer_input_bound(model, tensor)})
    return {
        "config": model.to_json(),
        "weights": [np.asarray(w) for w in model.get_weights()],
        "weight_names": weight_names(model),
        "trainable": [any(v is t for t in model.trainable_variables) for v in model.weights],
        "inputs": inputs,
        "outputs": [{"name": name, "shape": [None if d is None else int(d) for d in t.shape]}
                    for name, t in zip(output_names(model), model.outputs, strict=True)],
        "loss": compiled_loss(source, model),
    }


def _integer_input_bound(model: Any, tensor: Any) -> int | None:
    """For an integer input feeding an Embedding layer: its ``input_dim`` (valid ids < it)."""
    keras = import_keras()
    if "int" not in str(tensor.dtype):
        return None
    bounds = [layer.input_dim for layer in model._flatten_layers(include_self=False, recursive=True)
              if isinstance(layer, keras.layers.Embedding)]
    return min(bounds) if bounds else 2


def batchnorm_input_spread(model: Any, x: Any) -> dict[str, float]:
    """For each BatchNormalization layer: the smallest, over its channels, spread of its input
    batch relative to its size, std(x) / max|x| (training mode uses these batch statistics).

    A tiny value means ``x - mean`` cancels: the input's round-off (one ulp of max|x|) becomes
    a relative error of about ulp / std in everything the training-mode layer computes.
    Functional models only (others return an empty dict).
    """
    keras = import_keras()
    layers = [layer for layer in model._flatten_layers(include_self=False, recursive=True)
              if isinstance(layer, keras.layers.BatchNormalization)]
    if not layers:
        return {}
    try:
        probe = keras.Model(model.inputs, [layer.input for layer in layers])
        values = probe(x, training=False)
    except Exception:  # subclassed or shared layers: no symbolic inputs to tap
        return {}
    values = values if isinstance(values, list | tuple) else [values]
    spread = {}
    for layer, value in zip(layers, values, strict=True):
        array = np.asarray(keras.ops.convert_to_numpy(value), np.float64)
        axis = layer.axis if isinstance(layer.axis, int) else layer.axis[0]
        channels = np.moveaxis(array, axis, -1).reshape(-1, array.shape[axis])
        size = np.abs(channels).max(axis=0)
        std = channels.std(axis=0)
        ratio = np.where(size > 0, std / np.where(size > 0, size, 1.0), 1.0)
        spread[layer.name] = float(ratio.min())
    return spread


def make_optimizer(spec: OptimizerSpec) -> Any:
    """The optimizer a spec trains with in the step comparisons (one place to switch to optax)."""
    return spec.to_keras()


def _compile(model: Any, loss: Any) -> None:
    """Compile ``model`` for ``loss`` (one loss per output), so Keras computes the loss."""
    keras = import_keras()
    loss = keras.losses.get(loss) if isinstance(loss, dict) else loss
    losses = [loss] * len(model.outputs) if len(model.outputs) > 1 else loss
    model.compile(optimizer="sgd", loss=losses)


def run_optimizer_steps(model: Any, weights: list[np.ndarray], spec: OptimizerSpec, x: Any, y: Any,
                        steps: int) -> dict[str, Any]:
    """``steps`` train steps on one batch from ``weights``; the weights after step 1 and after K.

    Each step is Keras' train step on this backend: training-mode gradients of the compiled
    loss (state updates applied), then ``optimizer.apply_gradients`` with the gradients exactly
    as the backend produces them (sparse on TF for an Embedding, as in ``fit``). The gradient
    function is compiled once per model and reused by every optimizer.
    """
    model.set_weights(weights)
    optimizer = make_optimizer(spec)
    snapshots, losses, sparse = {}, [], []
    for step in range(1, steps + 1):
        loss, grads = impl().gradients(model, x, y, as_numpy=False)
        # A sparse gradient (tf.IndexedSlices for an Embedding on TF) is applied as it comes.
        sparse = [i for i, g in enumerate(grads) if hasattr(g, "indices")]
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        losses.append(float(np.asarray(loss)))
        if step in (1, steps):
            snapshots[step] = [np.asarray(w) for w in model.get_weights()]
    return {"losses": losses, "params": snapshots, "sparse_gradients": sparse}


def evaluate(source: dict[str, Any], weights: list[np.ndarray], x: list[np.ndarray],
             y: list[np.ndarray] | None, loss: Any, optimizers: list[dict[str, Any]],
             steps: int = 3, save_path: str | None = None) -> dict[str, Any]:
    """Every quantity the harness compares, computed on this worker's backend.

    Returns inference-mode ``outputs``; the training-mode ``loss`` and ``gradients`` (in the
    order of ``trainable_names``); for each optimizer spec, the weights after step 1 and after
    ``steps`` steps. With ``save_path``, the model (with ``weights``) is saved there first.
    """
    model = _model(source)
    model.set_weights(weights)
    result: dict[str, Any] = {"backend": import_keras().backend.backend(),
                              "weight_names": weight_names(model)}
    if save_path is not None:
        atomic_write(save_path, lambda tmp: model.save(tmp))
    xs = _inputs(model, x)
    result["outputs"] = forward(model, x)
    result["misrouted_adds"] = impl().bias_add_misroutes(model, xs)
    if y is None:
        return result
    result["inert"] = inert_stochastic_layers(model)
    result["batchnorm_spread"] = batchnorm_input_spread(model, xs)
    ys = y if len(model.outputs) > 1 else y[0]
    _compile(model, loss)
    trainable_ids = {id(v) for v in model.trainable_variables}
    result["trainable_names"] = [
        n for n, v in zip(result["weight_names"], model.weights, strict=True)
        if id(v) in trainable_ids]
    result["loss"], result["gradients"] = impl().gradients(model, xs, ys)
    model.set_weights(weights)  # the TF training call moved BatchNormalization's statistics
    result["steps"] = {}
    for spec_dict in optimizers:
        spec = OptimizerSpec(**{k: v for k, v in spec_dict.items() if k != "label"})
        label = spec_dict.get("label", spec.name)
        result["steps"][label] = run_optimizer_steps(model, weights, spec, xs, ys, steps)
        result["sparse_gradients"] = [result["trainable_names"][i]
                                      for i in result["steps"][label]["sparse_gradients"]]
    return result


def channels_first_probe() -> str | None:
    """Run Conv1D, Conv2D and pooling in channels_first, forward and backward, on this backend.

    Returns None when they run, else the error. kbackend's ``supports_channels_first_conv`` states
    what a backend is documented to support; this checks what this installation actually does.
    """
    keras = import_keras()
    try:
        for rank, conv, pool in ((1, keras.layers.Conv1D, keras.layers.MaxPooling1D),
                                 (2, keras.layers.Conv2D, keras.layers.AveragePooling2D)):
            inputs = keras.Input((2, *([4] * rank)))
            x = pool(2, data_format="channels_first")(conv(3, 3, padding="same",
                                                           data_format="channels_first")(inputs))
            model = keras.Model(inputs, keras.layers.Dense(1)(keras.layers.Flatten()(x)))
            _compile(model, "mse")
            data = np.ones((2, 2, *([4] * rank)), np.float32)
            impl().gradients(model, data, np.ones((2, 1), np.float32))
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return None


def predict_saved(path: str, x: list[np.ndarray], safe_mode: bool = True) -> dict[str, Any]:
    """Load a ``.keras`` file saved by another backend; its weights and inference outputs."""
    keras = import_keras()
    model = load_model(path, unsafe_deserialization=not safe_mode)
    return {"backend": keras.backend.backend(), "outputs": forward(model, x),
            "weights": [np.asarray(w) for w in model.get_weights()]}


def engine_run(source: dict[str, Any], weights: list[np.ndarray], x: np.ndarray, y: np.ndarray,
               engine: str, spec: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """Train with a kbackend engine on ``(x, y)``; the per-step losses and final weights."""
    model = _model(source)
    model.set_weights(weights)
    num_classes = int(model.outputs[0].shape[-1])
    info = data.DatasetInfo("equivalence", tuple(int(d) for d in x.shape[1:]), num_classes,
                            "arrays", "flat", None, len(x), len(x), len(x))
    dataset = data.Dataset(x, y, x, y, x, y, info)
    train_config = TrainConfig(engine=engine, optimizer=OptimizerSpec(**spec), **config)
    runner = get_engine(engine)
    plan = runner.plan(train_config, len(x), optimizer=OptimizerSpec(**spec))
    history = runner(model, dataset, plan, train_config, None)
    return {"loss": list(history.loss), "step": list(history.step),
            "weights": [np.asarray(w) for w in model.get_weights()]}

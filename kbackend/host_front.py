"""A model's string front: the preprocessing layers at its input that take strings or need a
lookup table (``TextVectorization``, ``StringLookup``, ``IntegerLookup``, ``Hashing``), run on
the host instead of in the compiled step (XLA holds no strings, and JAX runs these layers only
in ``tf.data``).

``HostFront.of(model)`` finds the front of a Sequential or functional model: the chain of such
layers from its one input. It is refused in one line for a subclassed model that holds one, for
such a layer anywhere else (after a layer that is not string preprocessing), and for a model of
several inputs. ``adapt`` adapts the front's layers that hold no vocabulary yet, on the data it
is given (the caller gives the training split only); ``apply`` runs the front on the host, in
``tf.data`` batches, deterministic, and keeps the result on disk keyed by the front's digest
(classes, configs, vocabularies, IDF weights) and the split's (``kbackend.digests``), so a
resumed study or a second process reads it back. ``rest`` is the model after the front: the same
layers and variables, trained by every engine; ``unwrap`` (``kbackend.workload``) gives back the
user's whole model, which is what is saved, so the saved file takes raw strings.

``Normalization`` and ``Discretization`` are not front layers: they take numbers and stay in the
model (adapted as before).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from kbackend.backend_choice import keras as import_keras
from kbackend.data.sources import cache_dir
from kbackend.data.user import text_array
from kbackend.digests import arrays_digest, json_digest
from kbackend.errors import DataError
from kbackend.io import atomic_write_npy
from kbackend.model_sources import (
    STRING_FRONT_LAYERS,
    ModelError,
    copy_layer_state,
    holds_vocabulary,
    is_graph_model,
    layer_state,
)

# Rows per tf.data batch when the front runs on the host.
HOST_BATCH = 1024
# Front outputs are held as float32 by the engines: exact integers up to 2**24 (token ids).
MAX_EXACT_ID = 2**24
CACHE_PREFIX = "front-"


def front_types() -> tuple[type, ...]:
    """The Keras classes of ``STRING_FRONT_LAYERS``."""
    keras = import_keras()
    return tuple(getattr(keras.layers, name) for name in STRING_FRONT_LAYERS)


def _graph(model: Any) -> Any:
    """The functional graph of a Sequential or functional model."""
    return getattr(model, "_functional", None) or model


def _consumers(graph: Any, tensor: Any) -> list[Any]:
    """The nodes of ``graph`` that take ``tensor`` as an input."""
    nodes = [node for depth in graph._nodes_by_depth.values() for node in depth]
    return [node for node in nodes if any(t is tensor for t in node.input_tensors)]


def _chain(model: Any) -> tuple[list[Any], Any]:
    """(the front layers from the model's input, in order; the tensor after them)."""
    kinds = front_types()
    graph = _graph(model)
    tensor = graph.inputs[0]
    layers: list[Any] = []
    while True:
        nodes = _consumers(graph, tensor)
        if len(nodes) != 1 or not isinstance(nodes[0].operation, kinds) \
                or len(nodes[0].input_tensors) != 1 or len(nodes[0].output_tensors) != 1:
            return layers, tensor
        layers.append(nodes[0].operation)
        tensor = nodes[0].output_tensors[0]


def front_layers(model: Any) -> list[Any]:
    """Every front layer in ``model`` and the models nested in it (not the lookup layer a
    ``TextVectorization`` holds inside it)."""
    found: list[Any] = []
    for layer in model._flatten_layers(include_self=False, recursive=False):
        if isinstance(layer, front_types()):
            found.append(layer)
        elif hasattr(layer, "_flatten_layers"):
            found.extend(front_layers(layer))
    return found


def _misplaced(model: Any, front: list[Any], name: str) -> ModelError:
    layer = next(layer for layer in front_layers(model) if not any(layer is f for f in front))
    return ModelError(
        f"Model {name!r} has a {type(layer).__name__} layer ({layer.name}) that is not at its "
        "input: string preprocessing runs on the host before the model, so it must come first "
        "(before any layer that is not TextVectorization, StringLookup, IntegerLookup or "
        "Hashing), or move it to the input pipeline.")


@dataclass
class HostFront:
    """The string front of one model: its layers, in order, from the model's input."""

    layers: tuple[Any, ...]
    input_shape: tuple[int | None, ...]
    name: str
    # The model's input dtype: "string" for raw text; an IntegerLookup or Hashing front may
    # take integers.
    input_dtype: str = "string"

    @property
    def takes_text(self) -> bool:
        """Whether the front takes strings (else numbers, in ``input_dtype``)."""
        return self.input_dtype == "string"

    @classmethod
    def of(cls, model: Any, name: str = "model") -> HostFront | None:
        """The front of ``model``; None if it has no front layer anywhere. A one-line
        ``ModelError`` for a front it cannot split off."""
        if not front_layers(model):
            return None
        if not is_graph_model(model):
            raise ModelError(
                f"Model {name!r} is subclassed ({type(model).__qualname__}) and holds string "
                "preprocessing layers: kbackend splits them off only from a Sequential or "
                "functional model (keras.Input(shape=(1,), dtype='string') first).")
        if len(_graph(model).inputs) != 1:
            raise ModelError(f"Model {name!r} has {len(model.inputs)} inputs and string "
                             "preprocessing layers: a string front is split off a model of "
                             "one input.")
        layers, _ = _chain(model)
        if len(layers) != len(front_layers(model)):
            raise _misplaced(model, layers, name)
        tensor = _graph(model).inputs[0]
        return cls(tuple(layers), tuple(tensor.shape[1:]), name, str(tensor.dtype))

    def rest(self, model: Any) -> Any:
        """The model after the front (the same layers and variables), which the engines train;
        ``unwrap`` gives back ``model``, which is saved."""
        keras = import_keras()
        _, tensor = _chain(model)
        graph = _graph(model)
        rest = keras.Model(tensor, graph.outputs[0] if len(graph.outputs) == 1
                           else graph.outputs, name=f"{model.name}_after_front")
        object.__setattr__(rest, "_kbackend_inner", model)  # what is saved
        return rest

    def attach(self, model: Any) -> Any:
        """``model`` (another build of the same source) given this front's vocabularies, as
        its ``rest``: every seed's saved model then takes strings as the data was prepared."""
        other = HostFront.of(model, self.name)
        if other is None or [type(a) for a in other.layers] != [type(b) for b in self.layers]:
            raise ModelError(f"Model {self.name!r}: a second build has another string front "
                             "than the first (a builder must return the same layers).")
        for source, target in zip(self.layers, other.layers, strict=True):
            if source is not target:
                copy_layer_state(source, target)
        return other.rest(model)

    def inputs(self, x: Any, what: str) -> np.ndarray:
        """``x`` checked as the front's inputs (strings, or numbers in ``input_dtype``), in the
        sample shape the model's input declares ((N,) <-> (N, 1)); a one-line ``DataError``."""
        if self.takes_text:
            x = text_array(x, DataError, f"Invalid {what}: the model takes strings; the input")
        else:
            x = np.asarray(x)
            if x.dtype.kind not in "biuf":
                raise DataError(f"Invalid {what}: model {self.name!r} takes numbers "
                                f"({self.input_dtype}), received dtype {x.dtype}.")
            x = x.astype(self.input_dtype)
        return self._shaped(x, what)

    def _shaped(self, x: np.ndarray, what: str) -> np.ndarray:
        want = self.input_shape
        if tuple(x.shape[1:]) == want:
            return x
        fixed = [int(d) for d in want if d is not None]
        if len(fixed) == len(want) and math.prod(fixed) == math.prod(x.shape[1:]):
            return x.reshape(len(x), *fixed)
        kind = "strings" if self.takes_text else "inputs"
        raise DataError(f"Invalid {what}: model {self.name!r} takes {kind} of shape "
                        f"(N, {', '.join(map(str, want))}), received {x.shape}.")

    def adapt(self, x_train: np.ndarray) -> list[str]:
        """Adapt the layers holding no vocabulary yet on ``x_train`` (the training split: the
        input each layer sees there); the names of the layers adapted."""
        adapted: list[str] = []
        for index, layer in enumerate(self.layers):
            if hasattr(layer, "vocabulary_size") and not holds_vocabulary(layer):
                layer.adapt(self._run(x_train, self.layers[:index]))
                adapted.append(layer.name)
        return adapted

    def digest(self) -> str:
        """A hex digest of what the front computes: each layer's class, config, vocabulary
        files and variables (names are not content)."""
        described = []
        for layer in self.layers:
            config = {k: v for k, v in layer.get_config().items() if k != "name"}
            store, assets = layer_state(layer)
            described.append([type(layer).__qualname__, config, arrays_digest(
                {**{f"v{k}": np.asarray(v) for k, v in store.items()},
                 **{f"a{k}": np.frombuffer(v, np.uint8) for k, v in assets.items()}})])
        return json_digest({"front": described, "input": list(self.input_shape)})

    def apply(self, x: np.ndarray, what: str = "inputs", *, cache: bool = True) -> np.ndarray:
        """The front's output for the strings ``x``, computed on the host (and kept on disk,
        keyed by the front's and ``x``'s digests, when ``cache``)."""
        x = self.inputs(x, what)
        if not cache:
            return self._checked(self._run(x, self.layers), what)
        keras = import_keras()
        key = json_digest({"front": self.digest(), "x": arrays_digest({"x": x}),
                           "keras": keras.__version__})
        path = cache_dir() / f"{CACHE_PREFIX}{key}.npy"
        try:
            return np.load(path, allow_pickle=False)
        except (OSError, ValueError, EOFError):
            pass  # absent or damaged: computed again
        result = self._checked(self._run(x, self.layers), what)
        with contextlib.suppress(OSError):  # unwritable: the next run computes it again
            atomic_write_npy(path, result)
        return result

    def _run(self, x: np.ndarray, layers: tuple[Any, ...]) -> np.ndarray:
        """``layers`` applied in order to ``x``, in ``tf.data`` batches on the host."""
        if not layers:
            return x
        import tensorflow as tf  # deferred: these layers need TensorFlow on every backend

        def front(batch: Any) -> Any:
            for layer in layers:
                batch = layer(batch)
            return batch

        dataset = tf.data.Dataset.from_tensor_slices(x).batch(HOST_BATCH).map(front)
        parts = [np.asarray(part) for part in dataset.as_numpy_iterator()]
        return np.concatenate(parts) if parts else np.zeros((0,), np.float32)

    def _checked(self, values: np.ndarray, what: str) -> np.ndarray:
        if values.dtype.kind in "iu" and values.size and np.abs(values).max() >= MAX_EXACT_ID:
            raise DataError(f"Invalid {what}: model {self.name!r}'s string front gives ids "
                            "beyond 2**24, which float32 cannot hold exactly (fewer tokens or "
                            "hash bins).")
        return values

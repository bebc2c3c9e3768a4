"""TensorFlow implementations of kbackend's backend-specific operations."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import tensorflow as tf


def framework_versions() -> dict[str, str]:
    """Versions of the framework packages behind this backend."""
    return {"tensorflow": tf.__version__}


def devices() -> list[dict[str, Any]]:
    """The logical devices computations can run on: kind, platform and id of each."""
    found = []
    for index, device in enumerate(tf.config.list_logical_devices()):
        details = {}
        physical = [p for p in tf.config.list_physical_devices(device.device_type)]
        if physical:
            details = tf.config.experimental.get_device_details(physical[0]) or {}
        found.append(
            {
                "id": index,
                "platform": device.device_type.lower(),
                "kind": details.get("device_name", device.device_type),
                "name": device.name,
            }
        )
    return found


def block_until_ready(value: Any) -> Any:
    """TF eager ops are synchronous once their values are read; materialize them."""
    return tf.nest.map_structure(lambda t: t.numpy() if hasattr(t, "numpy") else t, value)


def to_numpy(value: Any) -> np.ndarray:
    """A NumPy copy of a backend array."""
    return np.asarray(value)


@functools.cache
def supports_channels_first_conv() -> bool:
    """Whether this TF build runs NCHW Conv2D forward and backward here (probed once).

    Older TF CPU kernels implement Conv2D only for NHWC (keras issues 20414, 19591); TF 2.21 with
    oneDNN runs NCHW on the CPU too. A probe tells the truth for the installed build.
    """
    if tf.config.list_physical_devices("GPU"):
        return True
    try:
        inputs, kernel = tf.ones((1, 2, 5, 5)), tf.ones((3, 3, 2, 3))
        with tf.GradientTape() as tape:
            tape.watch(kernel)
            total = tf.reduce_sum(tf.nn.conv2d(inputs, kernel, 1, "SAME", data_format="NCHW"))
        gradient = tape.gradient(total, kernel)
        # 3 filters x 2 channels x (sum over positions of the in-bounds 3x3 window: 169) = 1014.
        return float(total) == 1014.0 and gradient is not None
    except (tf.errors.OpError, ValueError, RuntimeError):
        return False


def native_trainer(model: Any, spec: Any, dataset: Any) -> Any:
    """The fused native train loop for this backend (driven by ``kbackend.engines.native``)."""
    from kbackend.backends.tf_native import NativeTrainer

    return NativeTrainer(model, spec, dataset)


# --- parallel (issue 6) ---
# Device counts, virtual devices, data-parallel scopes and multi-process start-up for TensorFlow.
# kbackend.parallel calls these through ``impl()``; jax_backend has the same functions.

import os as _os  # noqa: E402
from collections.abc import Iterator as _Iterator  # noqa: E402
from contextlib import contextmanager as _contextmanager  # noqa: E402
from contextlib import suppress as _suppress  # noqa: E402

VIRTUAL_DEVICES_ENV = "KBACKEND_VIRTUAL_DEVICES"


def setup_virtual_devices(count: int) -> None:
    """Split the host CPU into ``count`` logical devices (must run before TF starts its runtime)."""
    from kbackend.errors import ConfigError

    cpu = tf.config.list_physical_devices("CPU")[0]
    current = tf.config.get_logical_device_configuration(cpu)
    if current is not None and len(current) == count:
        return
    try:
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(int(count))])
    except RuntimeError:
        have = len(tf.config.list_logical_devices("CPU"))
        if have == count:
            return
        raise ConfigError(
            f"Cannot create {count} virtual CPU devices: TensorFlow already started with {have}. "
            f"Set {VIRTUAL_DEVICES_ENV}={count} before starting Python."
        ) from None


def _compute_devices() -> list[Any]:
    gpus = tf.config.list_logical_devices("GPU")
    return gpus or tf.config.list_logical_devices("CPU")


def device_count() -> int:
    """How many devices (all processes together) computations can run on."""
    return len(_compute_devices())


def local_device_count() -> int:
    """How many devices this process drives."""
    return len(_compute_devices())


def platform() -> str:
    """The platform of the devices computations run on (cpu or gpu)."""
    return _compute_devices()[0].device_type.lower()


@_contextmanager
def data_parallel_scope(count: int) -> _Iterator[Any]:
    """A scope in which Keras models built, compiled and fit run data parallel on ``count`` devices.

    ``tf.distribute.MirroredStrategy`` (Keras's own TF distribution is an unfinished prototype).
    """
    strategy = tf.distribute.MirroredStrategy(
        devices=[d.name for d in _compute_devices()[:count]],
        cross_device_ops=tf.distribute.ReductionToOneDevice())
    with strategy.scope():
        yield strategy


def initialize_processes(coordinator: str, num_processes: int, process_id: int,
                         timeout_s: int, heartbeat_s: int) -> None:
    """Multi-process training is not available on TensorFlow with Keras 3.15 (raises).

    ``MultiWorkerMirroredStrategy`` starts and connects the workers, but Keras 3.15's TF
    trainer cannot run ``fit`` under it: its symbolic build MEAN-reduces a PerReplica input
    ("Attempt to convert a value (PerReplica...) to a Tensor") and, past that, its
    ``reduce_per_replica`` concatenates scalar metrics across workers ("Invalid reduction
    dimension 0 for input with 0 dimensions"). Single-process ``MirroredStrategy`` works.
    """
    from kbackend.errors import ConfigError

    raise ConfigError(
        "Multi-process training needs KERAS_BACKEND=jax: Keras 3.15's TensorFlow trainer fails "
        "under MultiWorkerMirroredStrategy. On TensorFlow use one process with --data-parallel "
        "(MirroredStrategy over the local devices)."
    )


def process_index() -> int:
    """This process's index: always 0 (TF runs single-process jobs, see initialize_processes)."""
    return 0


def process_count() -> int:
    """How many processes the job has: always 1 on TensorFlow."""
    return 1


def native_data_parallel_train(model: Any, dataset: Any, spec: Any, config: Any,
                               reporter: Any = None) -> Any:
    """The native data-parallel engine is JAX-only; TF data parallelism runs through Keras fit."""
    from kbackend.errors import ConfigError

    raise ConfigError(
        "The data_parallel engine (jax.shard_map) needs KERAS_BACKEND=jax. On TensorFlow use "
        "--engine keras --data-parallel (tf.distribute.MirroredStrategy)."
    )


if _os.environ.get(VIRTUAL_DEVICES_ENV):
    # Honour the request as early as possible, so ``kbackend info`` and every run see the devices.
    # A failure is reported by kbackend.parallel.prepare when a run asks for the devices.
    with _suppress(Exception):
        setup_virtual_devices(int(_os.environ[VIRTUAL_DEVICES_ENV]))


def keras_fit_inputs(x: Any, y: Any, batch_size: int) -> tuple[Any, Any, int]:
    """What this process passes to ``fit``: all of it, with the global batch size
    (``MirroredStrategy`` splits every batch over the local devices itself)."""
    return x, y, batch_size


def data_parallel_jit_compile(requested: bool) -> bool:
    """False: XLA-compiled Keras steps cannot read the per-replica variables of a
    ``MirroredStrategy`` on other devices (TF's XLA known issue "tf.Variable on a different
    device"), so mirrored training runs as a plain ``tf.function`` graph."""
    return False



def data_parallel_clone_layer(layer: Any) -> Any:
    """A fresh copy of ``layer`` for a data-parallel replica of its model.

    Each ``MirroredStrategy`` replica runs its own forward pass, so BatchNormalization is copied
    with ``synchronized=True``: its batch statistics are all-reduced across replicas, as in the
    single-device run over the global batch.
    """
    import keras

    config = layer.get_config()
    if isinstance(layer, keras.layers.BatchNormalization):
        config["synchronized"] = True
    return layer.__class__.from_config(config)



def training_gradients(model: Any, x: Any, y: Any) -> tuple[Any, list[Any]]:
    """One training-mode loss and its gradients for a compiled Keras model (backend tensors).

    The computation of Keras' TF ``train_step``: a ``GradientTape`` around the training call and
    ``compute_loss``. The training call updates BatchNormalization's moving statistics in place,
    as a train step does. Gradients come in the order of ``model.trainable_variables``, as TF
    returns them (an Embedding's gradient is a sparse ``tf.IndexedSlices``; None where the loss
    does not depend on a variable).
    """
    with tf.GradientTape() as tape:
        y_pred = model(x, training=True)
        loss = model.compute_loss(x=x, y=y, y_pred=y_pred, training=True)
    return loss, tape.gradient(loss, model.trainable_variables)


def loss_and_gradients(model: Any, x: Any, y: Any) -> tuple[float, list[np.ndarray]]:
    """``training_gradients`` as a float and dense NumPy arrays (zeros for None)."""
    loss, grads = training_gradients(model, x, y)
    return float(loss), [
        np.zeros(v.shape, v.dtype) if g is None else np.asarray(tf.convert_to_tensor(g))
        for g, v in zip(grads, model.trainable_variables, strict=True)
    ]


def bias_add_misroutes(model: Any, x: Any) -> list[str]:
    """The additions in an inference call of ``model`` that Keras' TF ``add`` gets wrong.

    Keras 3's TF ``ops.add`` (keras/src/backend/tensorflow/numpy.py) turns ``x1 + x2`` into
    ``tf.nn.bias_add`` when ``x2`` squeezes to a vector, guessing the channel axis from shapes:
    NHWC whenever ``x1.shape[-1]`` equals the vector's length. For a channels_first bias
    (shape ``(1, C, 1, ...)``) on an output whose last spatial size happens to equal C, that adds
    the bias along the wrong axis, silently. Returns one ``"x1 shape + x2 shape"`` per such add.
    """
    import keras.src.backend.tensorflow.numpy as tf_numpy

    found: list[str] = []
    original = tf_numpy.add

    def recording_add(x1: Any, x2: Any) -> Any:
        s1, s2 = getattr(x1, "shape", ()), getattr(x2, "shape", ())
        if len(s2) > 1 and len(s1) == len(s2):
            big = [i for i, d in enumerate(s2) if d is None or d > 1]
            if (len(big) == 1 and big[0] != len(s2) - 1 and s2[big[0]] is not None
                    and s1[-1] == s2[big[0]]):
                found.append(f"{tuple(s1)} + {tuple(s2)}")
        return original(x1, x2)

    tf_numpy.add = recording_add
    try:
        model(x, training=False)
    finally:
        tf_numpy.add = original
    return found


    """TF's CPU kernels implement Conv2D and pooling only for NHWC (keras issues 20414, 19591)."""
    return bool(tf.config.list_physical_devices("GPU"))


# --- study (issue 4) ---
_GRADIENT_FUNCTIONS: Any = None


def batch_gradients(model: Any, x: np.ndarray, y: np.ndarray) -> list[np.ndarray]:
    """Gradient of the mean sparse categorical cross-entropy of ``model`` on the batch ``(x, y)``
    with respect to its trainable variables, one NumPy array per variable.

    The forward pass runs with ``training=False`` (no dropout noise, batch-norm moving
    statistics), so the gradient is a function of the weights and the batch alone. One XLA
    ``tf.function`` per model, traced once per batch shape.
    """
    import weakref

    import keras

    global _GRADIENT_FUNCTIONS
    if _GRADIENT_FUNCTIONS is None:
        _GRADIENT_FUNCTIONS = weakref.WeakKeyDictionary()
    gradient = _GRADIENT_FUNCTIONS.get(model)
    if gradient is None:
        @tf.function(jit_compile=True)
        def gradient(inputs, labels):
            with tf.GradientTape() as tape:
                probabilities = model(inputs, training=False)
                loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(labels, probabilities))
            return tape.gradient(loss, model.trainable_variables)

        _GRADIENT_FUNCTIONS[model] = gradient
    grads = gradient(tf.convert_to_tensor(x), tf.convert_to_tensor(y))
    return [g.numpy() for g in grads]


# --- hardware (issue 7) ---
# Device memory, device transfer, mixed-precision support and matmul peak, used by
# kbackend.hardware (monitor, benchmarks, advise). jax_backend.py has the same functions.


def _first_gpu() -> str | None:
    gpus = tf.config.list_logical_devices("GPU")
    return gpus[0].name if gpus else None


def device_memory_in_use() -> int | None:
    """Bytes in use on the first GPU, or None where TF does not report it (CPU)."""
    gpu = _first_gpu()
    if gpu is None:
        return None
    return int(tf.config.experimental.get_memory_info(gpu.split("device:")[-1])["current"])


def to_device(batch: Any) -> Any:
    """Copy ``batch`` (a nest of arrays) to the default device as tensors."""
    with tf.device(_first_gpu() or "/CPU:0"):
        return tf.nest.map_structure(tf.identity, tf.nest.map_structure(tf.convert_to_tensor, batch))


def device_scope(platform: str) -> Any:
    """A context manager placing new tensors and ops on the first ``platform`` device."""
    return tf.device(f"/{platform.upper()}:0")


def precision_support() -> dict[str, dict[str, bool]]:
    """For each Keras dtype policy: whether it runs here and whether the hardware accelerates it."""
    from kbackend.hardware.device import cpu_accelerates, gpu_accelerates

    gpus = tf.config.list_physical_devices("GPU")
    capability = None
    if gpus:
        capability = (tf.config.experimental.get_device_details(gpus[0]) or {}).get("compute_capability")
    result = {}
    for policy, dtype in (("mixed_bfloat16", tf.bfloat16), ("mixed_float16", tf.float16)):
        try:
            x = tf.ones((8, 8), dtype)
            tf.linalg.matmul(x, x).numpy()
            runs = True
        except Exception:  # an unsupported kernel fails in many ways across devices
            runs = False
        accelerated = gpu_accelerates(policy, capability) if gpus else cpu_accelerates(policy)
        result[policy] = {"runs": runs, "accelerated": bool(runs and accelerated)}
    result["float32"] = {"runs": True, "accelerated": True}
    return result


def matmul_flops(n: int = 1024, dtype: str = "float32", repeats: int = 10,
                 jit: bool = True) -> dict[str, float]:
    """Measured FLOP/s of an ``n x n`` matmul (XLA-compiled or TF's own kernel): median of ``repeats``."""
    import time

    a = tf.random.stateless_normal((n, n), seed=(0, 1), dtype=dtype)
    b = tf.random.stateless_normal((n, n), seed=(0, 2), dtype=dtype)
    matmul = tf.function(tf.linalg.matmul, jit_compile=jit)
    start = time.perf_counter()
    matmul(a, b).numpy()
    compile_s = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        # Reading one element waits for the whole product without copying n*n values.
        matmul(a, b)[0, 0].numpy()
        times.append(time.perf_counter() - start)
    median = float(np.median(times))
    return {"n": n, "dtype": dtype, "jit": jit, "median_s": median, "flops": 2.0 * n**3 / median,
            "best_flops": 2.0 * n**3 / min(times), "compile_s": compile_s}

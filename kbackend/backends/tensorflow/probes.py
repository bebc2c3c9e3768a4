"""TensorFlow: what this build and its hardware support (data formats, precisions, matmul peak,
a train step's memory)."""

from __future__ import annotations

import functools
import time
from typing import Any

import numpy as np
import tensorflow as tf

from kbackend.backends.capabilities import precision_accelerated
from kbackend.backends.tensorflow.ops import compute_devices


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


def supports_populations() -> bool:
    """No population trainer on TensorFlow (``population.py`` says why)."""
    return False


def precision_support() -> dict[str, dict[str, bool]]:
    """For each Keras dtype policy: whether it runs here and whether the hardware accelerates it."""
    gpus = tf.config.list_physical_devices("GPU")
    capability = None
    if gpus:
        details = tf.config.experimental.get_device_details(gpus[0]) or {}
        capability = details.get("compute_capability")
    result = {}
    for policy, dtype in (("mixed_bfloat16", tf.bfloat16), ("mixed_float16", tf.float16)):
        try:
            x = tf.ones((8, 8), dtype)
            tf.linalg.matmul(x, x).numpy()
            runs = True
        except Exception:  # an unsupported kernel fails in many ways across devices
            runs = False
        accelerated = precision_accelerated(policy, "gpu" if gpus else "cpu", capability)
        result[policy] = {"runs": runs, "accelerated": bool(runs and accelerated)}
    result["float32"] = {"runs": True, "accelerated": True}
    return result


def matmul_flops(n: int = 1024, dtype: str = "float32", repeats: int = 10,
                 jit: bool = True) -> dict[str, Any]:
    """Measured FLOP/s of an ``n x n`` matmul (XLA-compiled or TF's own kernel): median of
    ``repeats``."""
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


# TensorFlow's CPU allocator keeps statistics only where it is a BFC allocator: oneDNN's, on the
# CPUs TensorFlow turns oneDNN on for (the Intel Xeons here), or any CPU's with this variable set
# before TensorFlow starts. Elsewhere (the AMD EPYCs here) reading them raises ValueError.
ALLOCATOR_STATS_ENV = {"TF_CPU_ALLOCATOR_USE_BFC": "true"}


def train_step_memory(model: Any, x: np.ndarray, y: np.ndarray) -> dict[str, Any]:
    """Bytes one train step of the compiled Keras ``model`` on the batch ``(x, y)`` allocates
    beyond what was in use before it: the peak of TensorFlow's allocator on the compute device
    over one ``train_on_batch``, after a first one has compiled the step and built the
    optimizer's slots. Where this process's allocator keeps no statistics, ``None`` bytes and
    ``stats_env``: the environment under which a fresh process's allocator keeps them."""
    device = compute_devices()[0].name.split("device:")[-1]
    try:  # asked before the first step: no compilation spent where nothing can be measured
        tf.config.experimental.get_memory_info(device)
    except ValueError:
        return {"step_memory_bytes": None, "stats_env": ALLOCATOR_STATS_ENV,
                "memory_source": f"not measured: TensorFlow's allocator on {device} keeps no "
                                 "statistics in this process"}
    model.train_on_batch(x, y)
    tf.config.experimental.reset_memory_stats(device)
    before = tf.config.experimental.get_memory_info(device)["current"]
    model.train_on_batch(x, y)
    peak = tf.config.experimental.get_memory_info(device)["peak"]
    return {"step_memory_bytes": int(peak - before),
            "memory_source": "TensorFlow allocator peak over one train step"}

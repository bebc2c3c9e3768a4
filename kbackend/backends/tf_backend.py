"""TensorFlow implementations of kbackend's backend-specific operations."""

from __future__ import annotations

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


def supports_channels_first_conv() -> bool:
    """TF's CPU kernels implement Conv2D and pooling only for NHWC (keras issues 20414, 19591)."""
    return bool(tf.config.list_physical_devices("GPU"))


def native_trainer(model: Any, spec: Any, dataset: Any) -> Any:
    """The fused native train loop for this backend (driven by ``kbackend.engines.native``)."""
    from kbackend.backends.tf_native import NativeTrainer

    return NativeTrainer(model, spec, dataset)


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

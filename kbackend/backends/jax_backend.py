"""JAX implementations of kbackend's backend-specific operations."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


def framework_versions() -> dict[str, str]:
    """Versions of the framework packages behind this backend."""
    import jaxlib

    return {"jax": jax.__version__, "jaxlib": jaxlib.__version__}


def devices() -> list[dict[str, Any]]:
    """The devices computations can run on: kind, platform and id of each."""
    return [
        {"id": d.id, "platform": d.platform, "kind": d.device_kind, "process": d.process_index}
        for d in jax.devices()
    ]


def block_until_ready(value: Any) -> Any:
    """Wait for every array in ``value`` to be computed (for honest timing)."""
    return jax.block_until_ready(value)


def to_numpy(value: Any) -> np.ndarray:
    """A NumPy copy of a backend array."""
    return np.asarray(value)


def supports_channels_first_conv() -> bool:
    """XLA on every JAX platform implements NCHW convolutions."""
    return True


def native_trainer(model: Any, spec: Any, dataset: Any) -> Any:
    """The fused native train loop for this backend (driven by ``kbackend.engines.native``)."""
    from kbackend.backends.jax_native import NativeTrainer

    return NativeTrainer(model, spec, dataset)


# --- hardware (issue 7) ---
# Device memory, device transfer, mixed-precision support and matmul peak, used by
# kbackend.hardware (monitor, benchmarks, advise). tf_backend.py has the same functions.


def device_memory_in_use() -> int | None:
    """Bytes in use on the first device, or None where the platform does not report it (CPU)."""
    stats = jax.devices()[0].memory_stats()
    if not stats or "bytes_in_use" not in stats:
        return None
    return int(stats["bytes_in_use"])


def to_device(batch: Any) -> Any:
    """Start copying ``batch`` (a pytree of arrays) to the default device; returns at once."""
    return jax.device_put(batch)


def device_scope(platform: str) -> Any:
    """A context manager placing new arrays and computations on the first ``platform`` device."""
    return jax.default_device(jax.devices(platform)[0])


def precision_support() -> dict[str, dict[str, bool]]:
    """For each Keras dtype policy: whether it runs here and whether the hardware accelerates it."""
    from kbackend.hardware.device import cpu_accelerates, gpu_accelerates

    platform = jax.devices()[0].platform
    result = {}
    for policy, dtype in (("mixed_bfloat16", jax.numpy.bfloat16), ("mixed_float16", jax.numpy.float16)):
        try:
            x = jax.numpy.ones((8, 8), dtype)
            jax.block_until_ready(x @ x)
            runs = True
        except Exception:  # an unsupported dtype fails in many ways across platforms
            runs = False
        if platform == "gpu":
            accelerated = gpu_accelerates(policy, getattr(jax.devices()[0], "compute_capability", None))
        else:
            accelerated = (platform == "tpu" and policy == "mixed_bfloat16") or (
                platform == "cpu" and cpu_accelerates(policy))
        result[policy] = {"runs": runs, "accelerated": bool(runs and accelerated)}
    result["float32"] = {"runs": True, "accelerated": True}
    return result


def matmul_flops(n: int = 1024, dtype: str = "float32", repeats: int = 10,
                 jit: bool = True) -> dict[str, float]:
    """Measured FLOP/s of an ``n x n`` matmul (jitted or op by op): median over ``repeats`` calls."""
    import time

    import jax.numpy as jnp

    key_a, key_b = jax.random.split(jax.random.PRNGKey(0))
    a = jax.random.normal(key_a, (n, n), dtype=dtype)
    b = jax.random.normal(key_b, (n, n), dtype=dtype)
    matmul = jax.jit(jnp.matmul) if jit else jnp.matmul
    start = time.perf_counter()
    jax.block_until_ready(matmul(a, b))
    compile_s = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(matmul(a, b))
        times.append(time.perf_counter() - start)
    median = float(np.median(times))
    return {"n": n, "dtype": dtype, "jit": jit, "median_s": median, "flops": 2.0 * n**3 / median,
            "best_flops": 2.0 * n**3 / min(times), "compile_s": compile_s}

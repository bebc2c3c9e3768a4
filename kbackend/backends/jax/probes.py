"""JAX: what this installation and its hardware support (data formats, precisions, matmul peak,
a train step's memory)."""

from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from kbackend.backends.capabilities import precision_accelerated
from kbackend.backends.jax.step import initial_state, make_train_step, unrolls_its_loop
from kbackend.errors import InternalError


def supports_channels_first_conv() -> bool:
    """XLA on every JAX platform implements NCHW convolutions."""
    return True


def supports_populations() -> bool:
    """A study's cell can train its runs as one vmapped program (``population.py``)."""
    return True


def precision_support() -> dict[str, dict[str, bool]]:
    """For each Keras dtype policy: whether it runs here and whether the hardware accelerates it."""
    device = jax.devices()[0]
    result = {}
    for policy, dtype in (("mixed_bfloat16", jnp.bfloat16), ("mixed_float16", jnp.float16)):
        try:
            x = jnp.ones((8, 8), dtype)
            jax.block_until_ready(x @ x)
            runs = True
        except Exception:  # an unsupported dtype fails in many ways across platforms
            runs = False
        accelerated = precision_accelerated(policy, device.platform,
                                            getattr(device, "compute_capability", None))
        result[policy] = {"runs": runs, "accelerated": bool(runs and accelerated)}
    result["float32"] = {"runs": True, "accelerated": True}
    return result


def matmul_flops(n: int = 1024, dtype: str = "float32", repeats: int = 10,
                 jit: bool = True) -> dict[str, Any]:
    """Measured FLOP/s of an ``n x n`` matmul (jitted or op by op): median over ``repeats``
    calls."""
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


def train_step_memory(model: Any, x: np.ndarray, y: np.ndarray) -> dict[str, Any]:
    """Bytes one train step of ``model`` on the batch ``(x, y)`` needs beyond its inputs and
    outputs: the temporaries (activations, gradients, workspaces) of XLA's buffer assignment for
    the native engine's compiled step, exact for that program and available on every platform."""
    tx = optax.sgd(0.01)
    step = make_train_step(model, tx, unroll=unrolls_its_loop(model))
    compiled = step.lower(initial_state(model, tx), (x[None], y[None])).compile()
    analysis = compiled.memory_analysis()
    if analysis is None:  # every XLA platform has one; its API allows none
        raise InternalError("XLA gave no memory analysis of the compiled train step.")
    return {"step_memory_bytes": int(analysis.temp_size_in_bytes),
            "memory_source": "XLA buffer assignment: the compiled step's temporaries"}

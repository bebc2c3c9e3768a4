"""Backend-free facts both backends consult: which hardware accelerates which precision.

Lives below the backends so that ``backends/jax`` and ``backends/tensorflow`` share one table
(``kbackend.hardware`` reads it too).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

# Set before Python starts to split the host CPU into N virtual devices (both backends read it).
VIRTUAL_DEVICES_ENV = "KBACKEND_VIRTUAL_DEVICES"

# CPU flags that make a reduced precision faster than float32 on a CPU (Intel AMX / AVX-512).
_CPU_FLAGS = {"mixed_bfloat16": ("amx_bf16", "avx512_bf16"),
              "mixed_float16": ("amx_fp16", "avx512_fp16")}
# Lowest NVIDIA compute capability with tensor cores for each policy (Volta fp16, Ampere bf16).
_GPU_CAPABILITY = {"mixed_float16": (7, 0), "mixed_bfloat16": (8, 0)}


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU feature flags from /proc/cpuinfo (empty where that file does not exist)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def precision_accelerated(policy: str, platform: str, capability: Any = None) -> bool:
    """Whether a device of ``platform`` (cpu, gpu, tpu) computes ``policy`` faster than float32
    (a GPU: an NVIDIA one of compute ``capability``, ``"8.0"`` or ``(8, 0)``, with tensor cores
    for it; a CPU: one with instructions for it)."""
    if platform == "gpu":
        if capability is None or policy not in _GPU_CAPABILITY:
            return False
        if isinstance(capability, str):
            capability = tuple(int(p) for p in capability.split(".")[:2])
        return tuple(capability) >= _GPU_CAPABILITY[policy]
    if platform == "tpu":
        return policy == "mixed_bfloat16"
    return platform == "cpu" and any(flag in cpu_flags() for flag in _CPU_FLAGS.get(policy, ()))


# Most steps written out in one unrolled call (see ``unrolls_its_loop``): the compiled program
# holds one copy of the step per step, so its compile time grows with K; ``--fused-steps auto``
# probes no further than this for such models.
MAX_UNROLLED_STEPS = 8


def has_convolution(model: Any) -> bool:
    """Whether any layer of the Keras ``model`` is a convolution (``Conv1D``/``Conv2D``/...)."""
    return any("Conv" in type(layer).__name__ for layer in model._flatten_layers())


def unrolls_its_loop(model: Any, platform: str, xla: bool = True) -> bool:
    """Whether a K-step compiled call of ``model`` on a ``platform`` device (cpu, gpu, tpu) must
    write its K steps out one after another instead of looping over them (``xla``: whether the
    loop is an XLA program; TensorFlow's graph without XLA, ``--no-jit``, keeps its loop).

    XLA:CPU runs a convolution inside a while loop (JAX ``lax.scan``, a TF ``tf.range`` loop or
    ``tf.cond`` in an XLA function) far slower than the same convolution outside one. Measured
    on the Fashion-MNIST 2-conv CNN at batch 128: JAX 5-6 s per step in the loop, 0.22 s
    unrolled; TF 13-14 s per step in the loop, 11.7 s inside ``tf.cond``, 0.30 s unrolled. Conv
    models on a CPU therefore trade compile time (K copies of the step) for it; elsewhere, and
    for models without convolutions, the loop stays rolled.
    """
    return xla and platform == "cpu" and has_convolution(model)

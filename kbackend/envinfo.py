"""What a run ran on: backend, versions, devices, CPU count and XLA-related flags.

Every benchmark and history file stores this beside its figures.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
from typing import Any

from kbackend.backend import active_backend

_PACKAGES = ("keras", "jax", "jaxlib", "tensorflow-cpu", "tensorflow", "optax", "numpy")
_ENV_PREFIXES = ("XLA_", "JAX_", "TF_", "KERAS_", "KBACKEND_", "CUDA_VISIBLE_DEVICES", "OMP_")


def package_versions() -> dict[str, str]:
    """Installed versions of the packages that decide numerics and speed (None if absent)."""
    versions: dict[str, str] = {}
    for name in _PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions


def relevant_env() -> dict[str, str]:
    """Environment variables that change how XLA, JAX, TF or kbackend behave."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(_ENV_PREFIXES)}


def environment() -> dict[str, Any]:
    """A JSON-ready description of this process's backend, devices and machine."""
    from kbackend.backends import impl

    keras = __import__("keras")
    backend_impl = impl()
    return {
        "backend": active_backend(),
        "versions": package_versions(),
        "devices": backend_impl.devices(),
        "image_data_format": keras.config.image_data_format(),
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "env": relevant_env(),
    }


def device_summary(devices: list[dict[str, Any]]) -> str:
    """E.g. ``'2 x cpu (cpu)'``: count, platform and kind of the devices, grouped."""
    groups: dict[tuple[str, str], int] = {}
    for device in devices:
        key = (device["platform"], str(device["kind"]))
        groups[key] = groups.get(key, 0) + 1
    return ", ".join(f"{n} x {plat} ({kind})" for (plat, kind), n in groups.items())

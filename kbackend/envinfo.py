"""What a run ran on: backend, versions, devices, CPU count and XLA-related flags.

kbackend's one description of the environment. ``environment_identity()`` is the part a result
depends on (backend, versions, device line): the study keys every run by it, so a stored study
is reused only on the same software and hardware. ``environment()`` is that identity plus the
details every benchmark, history file and ``kbackend info`` show beside their figures.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import sys
from collections import Counter
from typing import Any

from kbackend import __version__
from kbackend.backend_choice import keras_config, selected_backend
from kbackend.backends import impl

_PACKAGES = ("keras", "jax", "jaxlib", "tensorflow-cpu", "tensorflow", "optax", "numpy")
# TensorFlow's variables are named one by one: a bare "TF_" prefix also matches other tools'
# (TF_CLI_CONFIG_FILE, TF_VAR_* are Terraform's).
_ENV_PREFIXES = ("XLA_", "JAX_", "KERAS_", "KBACKEND_", "CUDA_VISIBLE_DEVICES", "OMP_",
                 "TF_CPP_", "TF_XLA_", "TF_GPU_", "TF_ENABLE_", "TF_NUM_INTEROP_THREADS",
                 "TF_NUM_INTRAOP_THREADS", "TF_DETERMINISTIC_OPS", "TF_FORCE_GPU_ALLOW_GROWTH",
                 "TF_USE_LEGACY_KERAS")
_ENV_NAMES = ("TF_CONFIG",)


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
    """Environment variables that change how XLA, JAX, TensorFlow, Keras or kbackend behave."""
    return {k: v for k, v in sorted(os.environ.items())
            if k.startswith(_ENV_PREFIXES) or k in _ENV_NAMES}


def environment_identity() -> dict[str, Any]:
    """Backend, package versions (kbackend's included) and a one-line device description.

    Part of every study run's key: changing what it holds makes stored studies re-run.
    """
    backend_impl = impl()
    return {
        "backend": selected_backend(),
        "versions": {**package_versions(), **backend_impl.framework_versions(),
                     "kbackend": __version__},
        "device": (f"{device_summary(backend_impl.devices())}; {os.cpu_count()} cpus; "
                   f"{_processor()}"),
    }


def environment() -> dict[str, Any]:
    """A JSON-ready description of this process's backend, devices and machine: the
    ``environment_identity()`` plus the device list, image data format, machine and flags."""
    return {
        **environment_identity(),
        "devices": impl().devices(),
        "image_data_format": image_data_format(),
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "processor": _processor(),
        "python": platform.python_version(),
        "env": relevant_env(),
    }


def image_data_format() -> str:
    """Keras's ``image_data_format``: from Keras once imported, else from its configuration
    file as Keras reads it at import (``backend_choice.keras_config``; default
    ``channels_last``), so describing the environment does not import Keras."""
    if "keras" in sys.modules:
        return sys.modules["keras"].config.image_data_format()
    value = keras_config().get("image_data_format", "channels_last")
    return value if value in ("channels_last", "channels_first") else "channels_last"


def _processor() -> str:
    return platform.processor() or platform.machine()


def device_summary(devices: list[dict[str, Any]]) -> str:
    """E.g. ``'2 x cpu (cpu)'``: count, platform and kind of the devices, grouped."""
    groups = Counter((device["platform"], str(device["kind"])) for device in devices)
    return ", ".join(f"{n} x {plat} ({kind})" for (plat, kind), n in groups.items())

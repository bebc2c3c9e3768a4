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

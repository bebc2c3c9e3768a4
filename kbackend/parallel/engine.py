"""Engine ``data_parallel``: the native data-parallel engine of the active backend.

On JAX this is the pmap-style ``jax.shard_map`` engine (``kbackend.parallel.jax_engine``); the
TensorFlow backend has no native one and says to use ``--engine keras --data-parallel``.
"""

from __future__ import annotations

from typing import Any

from kbackend.history import History


def train(model: Any, dataset: Any, spec: Any, config: Any, reporter: Any = None) -> History:
    """Train ``model`` data parallel with the backend's native engine and return the history."""
    from kbackend.backends import impl
    from kbackend.parallel import run_guarded

    return run_guarded(impl().native_data_parallel_train, model, dataset, spec, config, reporter)

"""TensorFlow has no population trainer: a study's cell runs its members one after another.

JAX's version (``backends/jax/population.py``) vmaps Keras's stateless call over stacked
parameters and optimizer states. The TensorFlow trainer keeps its state in Keras variables
updated by the Keras optimizer, which has no batched form; ``tf.vectorized_map`` over a
stateless call and a hand-written optimizer would be a second optimizer implementation beside
the one every TF engine shares. So ``supports_populations()`` is False here and the study
records the sequential path with this reason.
"""

from __future__ import annotations

from typing import Any

from kbackend.errors import BackendError

REASON = "TensorFlow has no population trainer (JAX's vmap); runs go one after another"


class PopulationTrainer:
    """Refuses to be built: see the module's docstring."""

    def __init__(self, model: Any, spec: Any, dataset: Any, members: int, task: Any = None) -> None:
        raise BackendError(f"Populations are not available: {REASON}.")

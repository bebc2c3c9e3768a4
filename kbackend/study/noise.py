"""The study's gradient noise scale at fixed weights: ``draws`` pairs of a small and a big batch,
drawn with replacement, their squared gradient norms, and ``kbackend.adaptive``'s estimator
(the one the adaptive batch size uses during training) over them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from kbackend.adaptive import NoiseEstimate, estimate_noise_scale


def squared_norm(arrays: Sequence[np.ndarray]) -> float:
    """Squared L2 norm of a gradient given as a list of arrays (one per variable)."""
    return float(sum(np.sum(np.square(np.asarray(a, dtype=np.float64))) for a in arrays))


def measure_noise_scale(
    gradient: Callable[[np.ndarray, np.ndarray], Sequence[np.ndarray]],
    x: np.ndarray, y: np.ndarray, small_batch: int, big_batch: int, draws: int,
    rng: np.random.Generator,
) -> NoiseEstimate:
    """Estimate the noise scale at the current weights.

    ``gradient(x_batch, y_batch)`` returns the gradient of the mean loss on that batch (one
    NumPy array per trainable variable); ``draws`` independent pairs of batches are drawn with
    replacement from ``(x, y)``.
    """
    small_norms, big_norms = [], []
    for _ in range(draws):
        small_idx = rng.integers(0, len(x), size=small_batch)
        big_idx = rng.integers(0, len(x), size=big_batch)
        small_norms.append(squared_norm(gradient(x[small_idx], y[small_idx])))
        big_norms.append(squared_norm(gradient(x[big_idx], y[big_idx])))
    return estimate_noise_scale(small_norms, big_norms, small_batch, big_batch)

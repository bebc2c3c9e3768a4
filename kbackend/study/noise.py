"""The gradient noise scale B_simple = tr(Sigma) / |G|^2 (McCandlish et al. 2018, appendix A).

For a batch of B examples drawn with replacement, the squared norm of the batch-mean gradient
has expectation ``E|G_B|^2 = |G|^2 + tr(Sigma) / B``, where G is the full-data gradient and
Sigma the per-example gradient covariance. Two batch sizes B_small < B_big give two equations
and so unbiased estimates of both unknowns:

    |G|^2      ~ (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small)
    tr(Sigma)  ~ (|G_small|^2 - |G_big|^2) / (1 / B_small - 1 / B_big)

Each draw's estimates are unbiased but noisy (|G|^2 can come out negative); the noise scale is
the ratio of their averages over many draws, not the average of ratios (which is biased).
Batches are drawn *with* replacement so the identity above is exact for a finite data set.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from kbackend.errors import ConfigError


@dataclass(frozen=True)
class NoiseEstimate:
    """Averaged unbiased estimates at one point of training, with standard errors."""

    grad_sq: float
    trace_sigma: float
    grad_sq_se: float
    trace_sigma_se: float
    small_batch: int
    big_batch: int
    draws: int

    @property
    def b_simple(self) -> float:
        """tr(Sigma) / |G|^2, or ``inf`` when the |G|^2 estimate is not positive."""
        return self.trace_sigma / self.grad_sq if self.grad_sq > 0 else math.inf

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "b_simple": self.b_simple}


def unbiased_estimates(small_sq_norms: Sequence[float] | np.ndarray,
                       big_sq_norms: Sequence[float] | np.ndarray,
                       small_batch: int, big_batch: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-draw unbiased estimates ``(|G|^2, tr(Sigma))`` from paired squared gradient norms."""
    if not 0 < small_batch < big_batch:
        raise ConfigError(
            f"Invalid noise-scale batch sizes ({small_batch}, {big_batch}): expected "
            "0 < small < big."
        )
    small = np.asarray(small_sq_norms, dtype=np.float64)
    big = np.asarray(big_sq_norms, dtype=np.float64)
    if small.shape != big.shape or small.ndim != 1 or small.size == 0:
        raise ConfigError(
            f"Expected two equally long, non-empty 1-D arrays of squared norms. Received shapes "
            f"{small.shape} and {big.shape}."
        )
    grad_sq = (big_batch * big - small_batch * small) / (big_batch - small_batch)
    trace_sigma = (small - big) / (1.0 / small_batch - 1.0 / big_batch)
    return grad_sq, trace_sigma


def estimate_noise_scale(small_sq_norms: Sequence[float] | np.ndarray,
                         big_sq_norms: Sequence[float] | np.ndarray,
                         small_batch: int, big_batch: int) -> NoiseEstimate:
    """Average the per-draw unbiased estimates; standard errors are over draws."""
    grad_sq, trace_sigma = unbiased_estimates(small_sq_norms, big_sq_norms, small_batch, big_batch)
    n = grad_sq.size

    def se(values: np.ndarray) -> float:
        return float(values.std(ddof=1) / math.sqrt(n)) if n > 1 else math.nan

    return NoiseEstimate(float(grad_sq.mean()), float(trace_sigma.mean()), se(grad_sq),
                         se(trace_sigma), int(small_batch), int(big_batch), int(n))


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

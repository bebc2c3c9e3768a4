"""Adaptive batch size: the online noise scale, the growth policy and the learning-rate rules.

Backend-free maths behind ``--batch-size auto[:MIN:MAX]`` (issue 37). The train step splits its
batch of B samples into M equal micro-batches of b = B / M samples and returns, besides the
update (the mean of the micro-batch gradients, so the training maths is unchanged), two numbers:
the mean over micro-batches of their squared gradient norms, ``|G_b|^2``, and the squared norm
of their mean, ``|G_B|^2``. For batches drawn independently, ``E|G_n|^2 = |G|^2 + tr(Sigma) / n``
(McCandlish et al. 2018, appendix A), so the two batch sizes give unbiased estimates of

    |G|^2      ~ (B |G_B|^2 - b |G_b|^2) / (B - b)
    tr(Sigma)  ~ (|G_b|^2 - |G_B|^2) / (1 / b - 1 / B)

Each step's estimates are noisy (|G|^2 often comes out negative), so the numerator and the
denominator are smoothed separately over steps (exponential moving averages) and
``B_simple = tr(Sigma) / |G|^2`` is the ratio of the averages (not the average of ratios,
which is biased). The study measures the same estimates at fixed weights from pairs of batches
drawn with replacement (``estimate_noise_scale``: plain averages over draws, with standard
errors). The epoch's batches are drawn
without replacement from a finite training split, which shrinks ``tr(Sigma)`` by the finite
population factor ``(N - B) / (N - 1)``: negligible while B is much smaller than N.

The policy grows the batch (never shrinks it) to the power of two at or above ``B_simple``,
within ``[MIN, MAX]``, at most once per evaluation interval. The learning rate follows the batch
size by one of ``LR_SCALINGS``; ``adascale`` uses AdaScale's gain (Johnson et al., ICML 2020)
from the same estimate.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, TypeVar

import numpy as np

from kbackend.errors import ConfigError

F = TypeVar("F", float, np.ndarray)  # one step's norms, or one per step or draw
AUTO = "auto"
DEFAULT_MIN_BATCH = 8
DEFAULT_MICRO_BATCHES = 2  # micro-batches per step (b = B / M samples): M backward passes
# Steps between measured steps (the last step of every 16 / K-th fused call of K steps): the
# others run the plain step (M - 1 backward passes fewer). A measured step costs ~1.7 plain
# ones (M = 2), so 1 in 16 keeps the estimator near 1.04x the plain step's time.
DEFAULT_MEASURE_EVERY = 16
DEFAULT_EMA_DECAY = 0.95  # ~20 measurements of memory: B_simple moves over hundreds of steps
# What the estimate remembers and needs before it is trusted, in training steps whatever the
# spacing of the measurements (one every 4 steps with decay 0.95 and 10 measurements before).
EMA_MEMORY_STEPS = 80
WARMUP_TRAIN_STEPS = 40
LR_SCALINGS = ("linear", "sqrt", "adascale", "none")


# ``KBACKEND_ADAPTIVE_AHEAD=1`` compiles the next batch size in the background (JAX). Off by
# default: on a 2-core CPU it made start-up slower (docs/adaptive.md, "Compile ahead").
AHEAD_ENV = "KBACKEND_ADAPTIVE_AHEAD"


def compile_ahead_enabled() -> bool:
    """Whether an adaptive run compiles the next power of two while the current size trains."""
    return os.environ.get(AHEAD_ENV, "0").strip().lower() in ("1", "true", "yes", "on")


# -- parsing -----------------------------------------------------------------------------------
def is_power_of_two(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


@dataclass(frozen=True)
class AutoBatchSize:
    """``--batch-size auto[:MIN:MAX]``: bounds of the adaptive batch size (None: the default,
    decided by the run: MIN 8 or the first size that is not overhead-bound, MAX the knee)."""

    minimum: int | None = None
    maximum: int | None = None

    def __post_init__(self) -> None:
        for name, value in (("MIN", self.minimum), ("MAX", self.maximum)):
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"Invalid --batch-size auto {name} {value!r}: expected a "
                                  "positive integer.")
            if not is_power_of_two(value):
                raise ConfigError(f"Invalid --batch-size auto {name} {value}: the adaptive "
                                  "batch size takes powers of two (e.g. "
                                  f"{1 << (value.bit_length() - 1)}).")
        if self.minimum is not None and self.maximum is not None and self.minimum > self.maximum:
            raise ConfigError(f"Invalid --batch-size auto:{self.minimum}:{self.maximum}: MIN is "
                              "above MAX.")

    def resolved(self, default_minimum: int, default_maximum: int) -> BatchBounds:
        """The bounds with the run's defaults filled in (a given bound wins over a default; a
        default MAX below the given MIN becomes MIN)."""
        minimum = self.minimum if self.minimum is not None else default_minimum
        maximum = self.maximum if self.maximum is not None else max(default_maximum, minimum)
        if self.maximum is not None and self.minimum is None:
            minimum = min(minimum, maximum)
        return BatchBounds(minimum, maximum)

    def __str__(self) -> str:
        if self.minimum is None and self.maximum is None:
            return AUTO
        return f"{AUTO}:{self.minimum or ''}:{self.maximum or ''}"


_AUTO_FORM = re.compile(r"auto(?::([^:]*):([^:]*))?")


def parse_batch_size(text: str | int) -> int | AutoBatchSize:
    """``"32"`` -> 32; ``"auto"``, ``"auto:MIN:MAX"`` (either bound may be empty: its default)
    -> ``AutoBatchSize``. A bad value is a one-line ``ConfigError``."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        text = str(text).strip()
        match = _AUTO_FORM.fullmatch(text.lower())
        if match:
            bounds = [_bound(field, name, text)
                      for field, name in zip(match.groups(), ("MIN", "MAX"), strict=True)]
            return AutoBatchSize(*bounds)
        try:
            value = int(text)
        except ValueError:
            raise ConfigError(f"Invalid --batch-size {text!r}: expected a positive integer, "
                              "'auto' or 'auto:MIN:MAX'.") from None
    if value <= 0:
        raise ConfigError(f"Invalid --batch-size {value}: expected a positive integer.")
    return value


def _bound(field: str | None, name: str, text: str) -> int | None:
    if field is None or field.strip() == "":
        return None
    try:
        return int(field)
    except ValueError:
        raise ConfigError(f"Invalid --batch-size {text!r}: {name} {field!r} is not an integer "
                          "(expected auto:MIN:MAX, powers of two).") from None


# -- the estimator -----------------------------------------------------------------------------
def step_estimates(micro_sq_norm: F, batch_sq_norm: F, micro_batch: int,
                   batch: int) -> tuple[F, F]:
    """The unbiased ``(|G|^2, tr(Sigma))`` from ``|G_b|^2`` (b samples: the mean over a step's
    micro-batches, or a small batch) and ``|G_B|^2`` (B samples): floats for one step, or
    arrays with one value per step or draw."""
    if not 0 < micro_batch < batch:
        raise ConfigError(f"Invalid noise-scale batch sizes ({micro_batch}, {batch}): expected "
                          "0 < micro-batch < batch.")
    grad_sq = (batch * batch_sq_norm - micro_batch * micro_sq_norm) / (batch - micro_batch)
    trace_sigma = (micro_sq_norm - batch_sq_norm) / (1.0 / micro_batch - 1.0 / batch)
    return grad_sq, trace_sigma


@dataclass(frozen=True)
class NoiseEstimate:
    """Averaged unbiased estimates at one point of training, with standard errors over draws."""

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


def estimate_noise_scale(small_sq_norms: Sequence[float] | np.ndarray,
                         big_sq_norms: Sequence[float] | np.ndarray,
                         small_batch: int, big_batch: int) -> NoiseEstimate:
    """Average the per-draw ``step_estimates`` of paired squared norms of a small and a big
    batch (drawn with replacement, so the identity is exact for a finite data set)."""
    small = np.asarray(small_sq_norms, dtype=np.float64)
    big = np.asarray(big_sq_norms, dtype=np.float64)
    if small.shape != big.shape or small.ndim != 1 or small.size == 0:
        raise ConfigError(
            f"Expected two equally long, non-empty 1-D arrays of squared norms. Received shapes "
            f"{small.shape} and {big.shape}."
        )
    grad_sq, trace_sigma = step_estimates(small, big, small_batch, big_batch)
    n = grad_sq.size

    def se(values: np.ndarray) -> float:
        return float(values.std(ddof=1) / math.sqrt(n)) if n > 1 else math.nan

    return NoiseEstimate(float(grad_sq.mean()), float(trace_sigma.mean()), se(grad_sq),
                         se(trace_sigma), int(small_batch), int(big_batch), int(n))


@dataclass(frozen=True)
class NoiseScale:
    """Exponential moving averages of the per-step ``|G|^2`` and ``tr(Sigma)`` estimates.

    Immutable: ``update`` returns the next state. The averages are bias-corrected (as Adam's
    moments) so that the first steps are not pulled towards zero; the correction cancels in
    ``b_simple`` but matters for AdaScale's gain, which uses the values themselves.
    """

    decay: float = DEFAULT_EMA_DECAY
    grad_sq_sum: float = 0.0  # uncorrected EMAs
    trace_sigma_sum: float = 0.0
    steps: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.decay < 1.0:
            raise ConfigError(f"Invalid noise-scale decay {self.decay}: expected 0 <= decay < 1.")

    def update(self, micro_sq_norms: float | Sequence[float] | np.ndarray, batch_sq_norm: float,
               micro_batch: int, batch: int) -> NoiseScale:
        """Fold in one step: ``micro_sq_norms`` (each micro-batch's squared gradient norm, or
        their mean) and ``batch_sq_norm`` (the squared norm of their mean)."""
        micro = float(np.mean(np.asarray(micro_sq_norms, dtype=np.float64)))
        grad_sq, trace_sigma = step_estimates(micro, float(batch_sq_norm), micro_batch, batch)
        if not (math.isfinite(grad_sq) and math.isfinite(trace_sigma)):
            return self  # a diverging step says nothing about the noise
        keep = self.decay
        return replace(self, grad_sq_sum=keep * self.grad_sq_sum + (1 - keep) * grad_sq,
                       trace_sigma_sum=keep * self.trace_sigma_sum + (1 - keep) * trace_sigma,
                       steps=self.steps + 1)

    def update_steps(self, micro_sq_norms: np.ndarray, batch_sq_norms: np.ndarray,
                     micro_batch: int, batch: int) -> NoiseScale:
        """Fold in K steps of a fused call: ``micro_sq_norms`` of shape ``(K, M)`` or ``(K,)``
        (means), ``batch_sq_norms`` of shape ``(K,)``."""
        state = self
        micro = np.asarray(micro_sq_norms, dtype=np.float64)
        for row, big in zip(micro.reshape(len(micro), -1),
                            np.asarray(batch_sq_norms, np.float64).ravel(), strict=True):
            state = state.update(row, big, micro_batch, batch)
        return state

    @property
    def _correction(self) -> float:
        return 1.0 - self.decay ** self.steps if self.steps else 1.0

    @property
    def grad_sq(self) -> float:
        """Smoothed ``|G|^2`` (NaN before the first step)."""
        return self.grad_sq_sum / self._correction if self.steps else math.nan

    @property
    def trace_sigma(self) -> float:
        """Smoothed ``tr(Sigma)``, per-example gradient variance summed over parameters."""
        return self.trace_sigma_sum / self._correction if self.steps else math.nan

    @property
    def b_simple(self) -> float:
        """``tr(Sigma) / |G|^2``; ``inf`` while the smoothed ``|G|^2`` is not positive, NaN
        before any step."""
        if not self.steps:
            return math.nan
        return self.trace_sigma_sum / self.grad_sq_sum if self.grad_sq_sum > 0 else math.inf


def estimator_settings(spacing: int) -> tuple[float, int]:
    """The EMA decay per measurement and the measurements of warm-up when one step in
    ``spacing`` is measured: ``EMA_MEMORY_STEPS`` of memory (1 / (1 - decay) measurements) and
    ``WARMUP_TRAIN_STEPS`` of warm-up (at least 2 measurements), whatever the spacing."""
    if spacing < 1:
        raise ConfigError(f"Invalid measurement spacing {spacing}: expected >= 1 step.")
    decay = max(0.0, 1.0 - spacing / EMA_MEMORY_STEPS)
    return decay, max(2, math.ceil(WARMUP_TRAIN_STEPS / spacing))


# -- the growth policy -------------------------------------------------------------------------
def next_power_of_two(value: float) -> int:
    """The smallest power of two at or above ``value`` (1 for values up to 1)."""
    if value <= 1:
        return 1
    return 1 << math.ceil(math.log2(value))


@dataclass(frozen=True)
class BatchBounds:
    """The adaptive batch size's range, both ends powers of two."""

    minimum: int
    maximum: int

    def __post_init__(self) -> None:
        AutoBatchSize(self.minimum, self.maximum)  # the same one-line checks

    def sizes(self) -> list[int]:
        """Every size a run may use: at most log2(MAX / MIN) + 1 compiled train programs."""
        return [1 << k for k in range(self.minimum.bit_length() - 1, self.maximum.bit_length())]


def target_batch_size(b_simple: float, bounds: BatchBounds) -> int | None:
    """The power of two at or above ``b_simple`` within ``bounds``; None when the estimate says
    nothing (NaN: no step yet; inf: the smoothed ``|G|^2`` is not yet positive)."""
    if not math.isfinite(b_simple):
        return None
    return min(max(next_power_of_two(b_simple), bounds.minimum), bounds.maximum)


@dataclass(frozen=True)
class GrowthPolicy:
    """When and to what the batch grows. ``decide`` is called at each evaluation point.

    ``warmup_steps``: steps the estimate must have seen since the last change before it is
    trusted (a change of batch size changes the noise of the estimates it averages).
    """

    bounds: BatchBounds
    warmup_steps: int = 10

    def decide(self, current: int, noise: NoiseScale, interval: int,
               last_change_interval: int | None) -> int:
        """The batch size for the next interval: larger than ``current`` only if the estimate
        asks for it, it is warm, and no change happened in this ``interval`` yet."""
        changed_here = last_change_interval is not None and interval <= last_change_interval
        if changed_here or noise.steps < self.warmup_steps:
            return current
        target = target_batch_size(noise.b_simple, self.bounds)
        return current if target is None else max(current, target)


# -- learning-rate scaling ---------------------------------------------------------------------
def adascale_gain(grad_sq: float, trace_sigma: float, batch: int, base_batch: int) -> float:
    """AdaScale's gain ratio r = (s2 + |G|^2) / (s2 / S + |G|^2) for scale S = batch /
    base_batch, where s2 = tr(Sigma) / base_batch is the gradient variance at the base batch
    size (Johnson et al. 2020, eq. 3). In [1, S]; 1 where the estimate is not usable yet."""
    scale = batch / base_batch
    if not (math.isfinite(grad_sq) and math.isfinite(trace_sigma)):
        return 1.0
    variance = max(trace_sigma, 0.0) / base_batch
    grad_sq = max(grad_sq, 0.0)
    if variance + grad_sq <= 0:
        return 1.0
    gain = (variance + grad_sq) / (variance / scale + grad_sq)
    return min(max(gain, 1.0), max(scale, 1.0))


def scaled_learning_rate(base_rate: float, batch: int, base_batch: int, scaling: str,
                         noise: NoiseScale | None = None) -> float:
    """The learning rate at ``batch`` for a run tuned at ``base_rate`` and ``base_batch``."""
    check_lr_scaling(scaling)
    scale = batch / base_batch
    if scaling == "linear":
        return base_rate * scale
    if scaling == "sqrt":
        return base_rate * math.sqrt(scale)
    if scaling == "adascale" and noise is not None and noise.steps:
        return base_rate * adascale_gain(noise.grad_sq, noise.trace_sigma, batch, base_batch)
    return base_rate  # "none", or adascale before its first estimate


def check_lr_scaling(scaling: str) -> str:
    if scaling not in LR_SCALINGS:
        raise ConfigError(f"Invalid --lr-scaling {scaling!r}: expected one of "
                          f"{', '.join(LR_SCALINGS)}.")
    return scaling


def micro_batches_for(batch: int, wanted: int = DEFAULT_MICRO_BATCHES) -> int:
    """Micro-batches per step at ``batch``: ``wanted`` where it divides the batch into at least
    one sample each, else the largest power of two that does (at least 2)."""
    if batch < 2:
        raise ConfigError(f"Invalid adaptive batch size {batch}: the noise estimate needs at "
                          "least 2 samples per batch (two micro-batches).")
    count = wanted
    while count > 2 and (batch % count or batch // count < 1):
        count //= 2
    if batch % count:
        raise ConfigError(f"Batch size {batch} does not split into {count} equal micro-batches.")
    return count


@dataclass(frozen=True)
class BatchChange:
    """One step range of an adaptive run: from ``step`` on, ``batch_size`` at
    ``learning_rate``, decided on the estimate ``b_simple``."""

    step: int
    batch_size: int
    learning_rate: float
    b_simple: float

    def describe(self) -> str:
        """The line ``kbackend train`` prints at a change."""
        estimate = f"{self.b_simple:.0f}" if math.isfinite(self.b_simple) else "n/a"
        return (f"step {self.step}: batch size {self.batch_size}, learning rate "
                f"{self.learning_rate:.4g} (B_simple ~ {estimate})")

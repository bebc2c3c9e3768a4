"""The knee of a throughput-vs-batch-size curve: where doubling the batch stops paying off.

This is kbackend's one definition of the throughput knee; ``kbackend advise`` and ``kbackend
study`` both name it from here, so they agree on every curve.

Definition: the smallest batch size from which the next doubling raises samples/s by less than
``DEFAULT_MIN_GAIN`` (10%). It is the one batch-size tuning uses (e.g. Google's Deep Learning
Tuning Playbook: raise the batch size while throughput still rises with it; once a doubling no
longer buys a meaningful gain, the device is saturated and a bigger batch only changes what
training converges to). A fraction-of-the-best rule ("the smallest batch reaching 80% of the
best samples/s", which ``kbackend study`` used before) is not used: it moves whenever the grid
is extended to larger batches, names a batch that still gains fast on a slowly saturating curve,
and cannot tell whether the curve flattened at all. The per-doubling gain is local, compares
uneven grids fairly and says when no plateau was reached.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from kbackend.errors import ConfigError
from kbackend.hardware.measure import Timing, paired_ratios
from kbackend.stats import median_coverage, median_interval

# Doubling the batch must raise samples/s by at least this fraction to count as worth it.
DEFAULT_MIN_GAIN = 0.10
# A gain's interval covers its median at least as often as [min, max] of five rounds does.
GAIN_LEVEL = median_coverage(5)


@dataclass(frozen=True)
class Knee:
    """The knee batch size, its throughput and whether the curve actually flattened."""

    batch_size: int
    throughput: float
    index: int
    plateau_reached: bool
    min_gain: float
    gains: tuple[float, ...]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def find_knee(batch_sizes: Sequence[int], throughputs: Sequence[float],
              min_gain: float = DEFAULT_MIN_GAIN) -> Knee:
    """The smallest batch size after which the next larger batch raises throughput by
    < ``min_gain``.

    ``batch_sizes`` must be increasing (usually powers of two); gains are normalized per doubling
    (``(t2 / t1) ** (1 / log2(b2 / b1)) - 1``) so uneven grids compare fairly. When every step
    gains at least ``min_gain``, the knee is the largest batch and ``plateau_reached`` is False:
    the hardware might still be filled further.
    """
    if len(batch_sizes) != len(throughputs) or not batch_sizes:
        raise ConfigError(
            "Invalid throughput curve: expected equally long, non-empty batch sizes and "
            "throughputs. "
            f"Received {len(batch_sizes)} batch sizes and {len(throughputs)} throughputs."
        )
    if any(b2 <= b1 for b1, b2 in itertools.pairwise(batch_sizes)) or batch_sizes[0] < 1:
        raise ConfigError(f"Invalid batch sizes {list(batch_sizes)}: expected positive, "
                          "increasing values.")
    if any(not (t > 0 and math.isfinite(t)) for t in throughputs):
        raise ConfigError(f"Invalid throughputs {list(throughputs)}: expected finite values > 0.")
    gains = tuple(
        (throughputs[i + 1] / throughputs[i])
        ** (1.0 / math.log2(batch_sizes[i + 1] / batch_sizes[i])) - 1.0
        for i in range(len(batch_sizes) - 1)
    )
    index = next((i for i, gain in enumerate(gains) if gain < min_gain), len(gains))
    return Knee(int(batch_sizes[index]), float(throughputs[index]), index, index < len(gains),
                min_gain, gains)


def curve_knee(curve: Sequence[Mapping[str, Any]], min_gain: float = DEFAULT_MIN_GAIN) -> Knee:
    """The knee of measured rows, each with ``batch_size`` and ``samples_per_s``, in batch order."""
    return find_knee([int(row["batch_size"]) for row in curve],
                     [float(row["samples_per_s"]) for row in curve], min_gain)


@dataclass(frozen=True)
class MeasuredGain:
    """The gain in samples/s of one step up the curve (per doubling), from interleaved timings:
    the median over rounds of each round's paired gain and its [low, high] (order statistics
    that cover the median at ``GAIN_LEVEL`` at least once there are five rounds: [min, max] at
    five, narrower with more; per look: re-measuring until it clears is a sequential rule that
    covers somewhat less). ``steady``: both sizes' repeats vary by 10 % at most (robust cv);
    ``straddles``: the interval holds ``min_gain``; ``noisy``: either. The knee probe re-measures
    a straddling gain, and an unsteady one once; a gain whose interval clears ``min_gain``
    decides the doubling even from unsteady repeats (the pairing cancels what slows both sizes
    alike), and a steady one that still straddles it lies near it, where either side of the
    doubling serves about as well (``decided``)."""

    median: float
    low: float
    high: float
    rounds: int
    steady: bool
    straddles: bool

    @property
    def noisy(self) -> bool:
        return not self.steady or self.straddles

    @property
    def decided(self) -> bool:
        """Whether the doubling can be decided on (by the median): steady or clear of
        ``min_gain``."""
        return self.steady or not self.straddles

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "noisy": self.noisy}


def measured_gain(small: Timing, large: Timing, small_samples: int, large_samples: int,
                  min_gain: float = DEFAULT_MIN_GAIN) -> MeasuredGain:
    """``MeasuredGain`` of going from ``small`` to ``large``: interleaved timings of calls that
    train ``small_samples`` and ``large_samples`` samples (``measure.time_interleaved``)."""
    exponent = 1.0 / math.log2(large_samples / small_samples) if large_samples != small_samples \
        else 1.0
    gains = [(large_samples / small_samples * ratio) ** exponent - 1.0
             for ratio in paired_ratios(small, large)]  # t_small / t_large, round by round
    interval = median_interval(gains, level=GAIN_LEVEL)
    straddles = not gains or interval["low"] < min_gain < interval["high"]
    steady = bool(gains) and not (small.noisy or large.noisy)
    return MeasuredGain(float(interval["median"]), float(interval["low"]),
                        float(interval["high"]), len(gains), steady, straddles)

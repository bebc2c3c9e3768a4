"""Batch plans: which samples each step takes (kbackend's one batch order), in which compiled call.

The native engines keep the training split on the device and gather each batch there from a
matrix of sample indices (one row per step). These helpers build those matrices on the host,
deterministically from the seed, and split an epoch into fused calls of at most K steps.

The Keras engine reads the same order through ``kbackend.hardware.inputs`` (monitored or not).

In the native engines every batch has the same shape (a fused loop needs one shape): the last
``n % batch_size`` samples of each epoch's shuffled order are dropped. Because the order is
reshuffled every epoch, a different few are dropped each time, so no sample is left out for good.
"""

from __future__ import annotations

import numpy as np

from kbackend.data.validation import check_batch_size
from kbackend.errors import ConfigError


def steps_per_epoch(num_samples: int, batch_size: int, *, drops_last: bool = True) -> int:
    """Steps in one epoch: ``floor(n / batch_size)``, the remainder dropped (the native
    engines), or ``ceil``, the last batch partial (Keras fit)."""
    check_batch_size(batch_size, num_samples)
    return num_samples // batch_size if drops_last else -(-num_samples // batch_size)


def epochs_for_steps(steps: int, per_epoch: int) -> int:
    """Whole epochs (at least one) that hold ``steps`` steps of ``per_epoch`` each."""
    return max(1, -(-steps // per_epoch))


def epoch_order(num_samples: int, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """The sample order of ``epoch``: a permutation fixed by ``(seed, epoch)``, or 0..n-1."""
    if not shuffle:
        return np.arange(num_samples, dtype=np.int32)
    return np.random.default_rng([seed, epoch]).permutation(num_samples).astype(np.int32)


def epoch_batches(num_samples: int, batch_size: int, seed: int, epoch: int,
                  shuffle: bool = True) -> np.ndarray:
    """An ``(steps_per_epoch, batch_size)`` int32 matrix: row ``i`` holds step ``i``'s samples."""
    steps = steps_per_epoch(num_samples, batch_size)
    order = epoch_order(num_samples, seed, epoch, shuffle)
    return order[: steps * batch_size].reshape(steps, batch_size)


def epoch_batches_with_remainder(num_samples: int, batch_size: int, seed: int, epoch: int,
                                 shuffle: bool = True) -> list[np.ndarray]:
    """Every batch of ``epoch`` as sample indices, in ``epoch_order``: the rows of
    ``epoch_batches``, then the ``num_samples % batch_size`` left-over samples as one short
    batch (for Keras ``fit``, which takes every sample each epoch)."""
    order = epoch_order(num_samples, seed, epoch, shuffle)
    return [order[start:start + batch_size] for start in range(0, num_samples, batch_size)]


def check_fused_steps(fused_steps: int, steps: int, num_samples: int, batch_size: int) -> None:
    """Refuse a K that does not fit in one epoch (a fused call never spans two epochs)."""
    if not isinstance(fused_steps, int) or not 1 <= fused_steps <= steps:
        raise ConfigError(
            f"Invalid fused_steps {fused_steps!r}: one epoch of {num_samples} samples holds only "
            f"{steps} full batches of {batch_size}; expected an integer in [1, {steps}]."
        )


def call_lengths(steps: int, fused_steps: int) -> list[int]:
    """Split an epoch of ``steps`` steps into fused calls of ``fused_steps`` (the last shorter).

    At most two distinct lengths appear, so a run compiles at most two loops (plus one more
    if ``max_steps`` cuts the last call short).
    """
    full, rest = divmod(steps, fused_steps)
    return [fused_steps] * full + ([rest] if rest else [])


def pad_to_chunks(x: np.ndarray, y: np.ndarray, chunk: int) -> tuple[np.ndarray, ...]:
    """``(x, y, mask)`` padded to whole chunks of at most ``chunk`` samples and shaped
    ``(chunks, size, ...)``.

    Used for evaluation only (inference has no cross-sample statistics, so padding rows with
    zero weight in ``mask`` changes nothing), letting one compiled loop cover any split size.
    The chunks are as even as the split allows: fewest chunks of at most ``chunk``, each of
    ``ceil(n / chunks)`` samples, so at most ``chunks - 1`` rows are padding (1,200 samples are
    two chunks of 600, not two of 1,024 with 848 wasted rows evaluated every time).
    """
    chunks = max(1, -(-len(x) // max(1, chunk)))
    chunk = max(1, -(-len(x) // chunks))
    pad = chunks * chunk - len(x)
    mask = np.concatenate([np.ones(len(x), np.float32), np.zeros(pad, np.float32)])
    x = np.concatenate([x, np.zeros((pad, *x.shape[1:]), x.dtype)])
    y = np.concatenate([y, np.zeros((pad, *y.shape[1:]), y.dtype)])
    return tuple(a.reshape(chunks, chunk, *a.shape[1:]) for a in (x, y, mask))

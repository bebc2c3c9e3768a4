"""The backend-free parts of the hand-written Conv1D + BatchNorm reference loops
(``backends/{jax,tensorflow}/reference.py``): the weights' layout, the epoch's split into
calls and the loop object both return. Only set-up: what a loop computes and times is each
backend's own."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import numpy as np

from kbackend.data.batching import call_lengths
from kbackend.errors import InternalError

# Keras's BatchNormalization defaults, which the Conv1D reference matches.
BN_MOMENTUM = 0.99
BN_EPSILON = 1e-3


class ReferenceLoop:
    """A hand-written loop's epoch as a call: ``loop()`` trains one epoch and returns its
    per-step losses (host copies: the epoch has finished); ``loop.weights()`` returns the
    current values in the order the loop was given them."""

    def __init__(self, run_epoch: Callable[[], np.ndarray],
                 weights: Callable[[], list[np.ndarray]]) -> None:
        self._run_epoch, self.weights = run_epoch, weights

    def __call__(self) -> np.ndarray:
        return self._run_epoch()


def conv1d_arrays(params: Sequence[np.ndarray]) -> tuple[list[np.ndarray], int]:
    """``params`` (a Keras model's ``get_weights()``) as float32 arrays, and the number of conv
    blocks: checked to be (kernel, gamma, beta, moving mean, moving variance) per block, then
    the dense kernel and bias."""
    arrays = [np.asarray(p, np.float32) for p in params]
    blocks = (len(arrays) - 2) // 5
    if len(arrays) != 5 * blocks + 2 or blocks < 1:
        raise InternalError(f"Expected (kernel, gamma, beta, moving mean, moving variance) per "
                            f"block and a dense kernel and bias. Received {len(arrays)} arrays.")
    return arrays, blocks


def epoch_spans(n_steps: int, steps_per_call: int) -> list[tuple[int, int]]:
    """``(first, stop)`` step of each call of an epoch of ``n_steps``: one call (``0``), or
    calls of ``steps_per_call`` steps, the last shorter."""
    bounds = np.cumsum([0, *call_lengths(n_steps, steps_per_call or n_steps)])
    return [(int(a), int(b)) for a, b in itertools.pairwise(bounds)]

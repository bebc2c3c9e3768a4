"""Random weights, inputs and targets made with NumPy, so every backend gets the same arrays."""

from __future__ import annotations

from typing import Any

import numpy as np


def random_weights(names: list[str], shapes: list[tuple[int, ...]], seed: int,
                   scale: float = 1.0) -> list[np.ndarray]:
    """Random float32 weights of the given shapes that keep a model well defined.

    Kernels ~ N(0, (scale / sqrt(fan_in))^2), biases and offsets ~ N(0, (0.1 scale)^2),
    normalization scales near 1, moving variances in [0.5, 1.5] (a variance must be positive).
    """
    rng = np.random.default_rng(seed)
    weights = []
    for name, shape in zip(names, shapes, strict=True):
        leaf = name.rsplit("/", 1)[-1]
        if "moving_variance" in leaf:
            value = rng.uniform(0.5, 1.5, shape)
        elif leaf == "gamma":
            value = 1.0 + 0.1 * rng.normal(size=shape)
        elif len(shape) <= 1:
            value = 0.1 * scale * rng.normal(size=shape)
        else:
            fan_in = int(np.prod(shape[:-1]))
            value = scale / np.sqrt(max(fan_in, 1)) * rng.normal(size=shape)
        weights.append(value.astype(np.float32))
    return weights


def random_inputs(description: dict[str, Any], batch_size: int, seed: int,
                  scale: float = 1.0) -> list[np.ndarray]:
    """Random inputs for a model ``describe``d by a worker (integer ids below their bound)."""
    rng = np.random.default_rng(seed)
    arrays = []
    for spec in description["inputs"]:
        shape = (batch_size, *[d or 1 for d in spec["shape"][1:]])
        if "int" in spec["dtype"]:
            arrays.append(rng.integers(0, spec["int_high"] or 2, shape).astype(spec["dtype"]))
        else:
            arrays.append((scale * rng.normal(size=shape)).astype(np.float32))
    return arrays


def random_targets(description: dict[str, Any], batch_size: int, seed: int,
                   sparse_classes: bool = False) -> list[np.ndarray]:
    """Random targets per output: class ids (``sparse_classes``) or N(0, 1) values."""
    rng = np.random.default_rng(seed + 1)
    arrays = []
    for spec in description["outputs"]:
        shape = (batch_size, *[d or 1 for d in spec["shape"][1:]])
        if sparse_classes:
            arrays.append(rng.integers(0, shape[-1], shape[:-1]).astype(np.int32))
        else:
            arrays.append(rng.normal(size=shape).astype(np.float32))
    return arrays

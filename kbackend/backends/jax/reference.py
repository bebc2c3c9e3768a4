"""The hand-written JAX training loops the benchmarks use as their floor (no Keras): a ReLU MLP
(bench_engines) and the Conv1D + BatchNorm classifier of examples/models.py (bench_user_model)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kbackend.backends.jax.step import scan_steps
from kbackend.backends.reference_parts import (
    BN_EPSILON,
    BN_MOMENTUM,
    ReferenceLoop,
    conv1d_arrays,
    epoch_spans,
)


def reference_train_loop(params: Sequence[tuple[np.ndarray, np.ndarray]], x: np.ndarray,
                         y: np.ndarray, learning_rate: float) -> Callable[[], None]:
    """One call trains one epoch of a ReLU MLP (``params``: (weights, bias) per layer) with
    plain SGD, in one ``lax.scan`` over the pre-stacked batches ``x``: (steps, batch, features)
    and ``y``: (steps, batch) already on the device; returns when the epoch has finished."""
    import jax  # deferred: importing JAX is heavy
    import optax

    transform = optax.sgd(learning_rate)

    def loss_fn(params, xb, yb):
        h = xb
        for i, (w, b) in enumerate(params):
            h = h @ w + b
            if i < len(params) - 1:
                h = jax.nn.relu(h)
        return optax.softmax_cross_entropy_with_integer_labels(h, yb).mean()

    def step(carry, batch):
        params, opt_state = carry
        loss, grads = jax.value_and_grad(loss_fn)(params, *batch)
        updates, opt_state = transform.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    epoch = jax.jit(lambda carry, xs, ys: jax.lax.scan(step, carry, (xs, ys)), donate_argnums=0)
    device_params = jax.device_put(list(params))
    state = {"carry": (device_params, transform.init(device_params))}
    xs, ys = jax.device_put(x), jax.device_put(y)

    def run() -> None:
        state["carry"], losses = epoch(state["carry"], xs, ys)
        jax.block_until_ready(losses)

    return run


def reference_conv1d_loop(params: Sequence[np.ndarray], x: np.ndarray, y: np.ndarray,
                          learning_rate: float, *, steps_per_call: int = 0,
                          unroll: bool = False) -> ReferenceLoop:
    """The Conv1D + BatchNorm classifier of ``examples/models.py`` (``conv1d_classifier``)
    trained by hand with plain SGD: per block a ``lax.conv_general_dilated`` (kernel 5, SAME,
    no bias), batch norm in training mode by hand (the batch's mean and biased variance over
    batch and time, ``inv = rsqrt(var + 1e-3) * gamma``, ``h * inv + (beta - mean * inv)``,
    gamma and beta trained, the moving mean and variance updated as Keras does with momentum
    0.99), ReLU and a ``lax.reduce_window`` max-pool (2, VALID); then the mean over time, a
    dense layer to logits and ``optax.softmax_cross_entropy_with_integer_labels``,
    ``optax.sgd``. The normalization is Keras's form, the faster one: written as
    ``(h - mean) * rsqrt(var + 1e-3) * gamma + beta`` a step took ~12% longer on a CPU here
    (bench_user_model), though its gradients below a batch norm match float64 to ~1e-7 where
    this form's lose ~1% to cancellation in float32 (on JAX; TF's gradients of it do not).

    ``params``: the Keras model's ``get_weights()`` order, (kernel ``(5, in, out)``, gamma,
    beta, moving mean, moving variance) per block, then the dense kernel and bias. ``x``:
    ``(steps, batch, time, channels)`` pre-stacked batches, ``y``: ``(steps, batch)``, both put
    on the device once. An epoch is one ``lax.scan`` over every step (``steps_per_call`` 0), or
    calls of ``steps_per_call`` steps (the last shorter), each a ``lax.scan`` or, with
    ``unroll``, its steps written out one after another (no loop: what the native engine does
    for conv models on a CPU, ``capabilities.unrolls_its_loop``).
    """
    import jax  # deferred: importing JAX is heavy
    import optax  # deferred with JAX

    arrays, blocks = conv1d_arrays(params)
    trainable = [tuple(arrays[5 * b:5 * b + 3]) for b in range(blocks)] + [tuple(arrays[-2:])]
    stats = [tuple(arrays[5 * b + 3:5 * b + 5]) for b in range(blocks)]
    transform = optax.sgd(learning_rate)
    call = _conv1d_call(transform, unroll)
    chunks = [(jax.device_put(x[a:b]), jax.device_put(y[a:b].astype(np.int32)))
              for a, b in epoch_spans(len(x), steps_per_call)]
    device_trainable = jax.device_put(trainable)
    state = {"carry": (device_trainable, jax.device_put(stats),
                       transform.init(device_trainable))}

    def run_epoch() -> np.ndarray:
        losses = []
        for xs, ys in chunks:
            state["carry"], chunk_losses = call(state["carry"], xs, ys)
            losses.append(chunk_losses)
        return np.concatenate([np.asarray(jax.block_until_ready(part)) for part in losses])

    return ReferenceLoop(run_epoch, lambda: _keras_order(state["carry"]))


def _conv1d_loss(trainable: Any, stats: Any, xb: Any, yb: Any) -> tuple[Any, list[Any]]:
    """The classifier's mean loss on one batch in training mode (batch statistics), and each
    block's moving mean and variance updated with that batch's statistics."""
    import jax  # deferred: importing JAX is heavy
    import jax.numpy as jnp
    import optax  # deferred with JAX

    h, new_stats = xb, []
    for (kernel, gamma, beta), (moving_mean, moving_var) in zip(trainable[:-1], stats,
                                                                strict=True):
        h = jax.lax.conv_general_dilated(h, kernel, window_strides=(1,), padding="SAME",
                                         dimension_numbers=("NWC", "WIO", "NWC"))
        mean, var = jnp.mean(h, axis=(0, 1)), jnp.var(h, axis=(0, 1))
        inv = jax.lax.rsqrt(var + BN_EPSILON) * gamma
        h = h * inv + (beta - mean * inv)
        h = jax.nn.relu(h)
        h = jax.lax.reduce_window(h, -jnp.inf, jax.lax.max, (1, 2, 1), (1, 2, 1), "VALID")
        new_stats.append((moving_mean * BN_MOMENTUM + mean * (1.0 - BN_MOMENTUM),
                          moving_var * BN_MOMENTUM + var * (1.0 - BN_MOMENTUM)))
    dense_kernel, dense_bias = trainable[-1]
    logits = jnp.mean(h, axis=1) @ dense_kernel + dense_bias
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()
    return loss, new_stats


def _conv1d_call(transform: Any, unroll: bool) -> Callable[..., Any]:
    """One compiled call of the epoch: ``call(carry, xs, ys) -> (carry, losses)`` runs
    ``len(xs)`` SGD steps (``transform``) from ``carry`` (trainable values, moving statistics,
    optimizer state; donated), in a ``lax.scan`` or, with ``unroll``, written out."""
    import jax  # deferred: importing JAX is heavy
    import optax  # deferred with JAX

    def step(carry, batch):
        trainable, stats, opt_state = carry
        (loss, stats), grads = jax.value_and_grad(_conv1d_loss, has_aux=True)(trainable, stats,
                                                                              *batch)
        updates, opt_state = transform.update(grads, opt_state, trainable)
        return (optax.apply_updates(trainable, updates), stats, opt_state), loss

    def steps(carry, xs, ys):
        return scan_steps(step, carry, (xs, ys), unroll)

    return jax.jit(steps, donate_argnums=0)


def _keras_order(carry: Any) -> list[np.ndarray]:
    """The values of ``carry`` on the host, in the Keras model's ``get_weights()`` order."""
    import jax  # deferred: importing JAX is heavy

    trainable, stats, _ = jax.device_get(carry)
    out: list[np.ndarray] = []
    for (kernel, gamma, beta), (mean, var) in zip(trainable[:-1], stats, strict=True):
        out += [kernel, gamma, beta, mean, var]
    return [np.asarray(a) for a in [*out, *trainable[-1]]]

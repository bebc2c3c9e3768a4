"""The hand-written JAX training loop the engine benchmark uses as its floor (no Keras)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np


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

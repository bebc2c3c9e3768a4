"""The native JAX train loop: Keras's stateless API, ``jax.value_and_grad``, optax, ``lax.scan``.

A train step is a pure function ``(state, batch) -> (state, loss)`` with ``state`` a small
``TrainState``. ``K`` steps run in one compiled call: ``lax.scan`` over ``K`` rows of sample
indices, each row gathered from the training split that lives on the device for the whole run.
The state buffers are donated, so XLA updates the parameters in place. Each call's length is
compiled once, ahead of time (``jit(...).lower(...).compile()``), which also times compilation.

Reached only through ``kbackend.backends.jax_backend`` (the dispatch point).
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from kbackend.data.batching import pad_to_chunks

EVAL_CHUNK = 1024  # validation samples per forward pass (the split is padded to a multiple)


class TrainState(NamedTuple):
    """Everything a train step changes: the model's values and the optimizer's state."""

    trainable: list[Any]
    non_trainable: list[Any]  # BatchNorm statistics, dropout seed-generator state, ...
    opt_state: Any


def _mean_cross_entropy(keras: Any, labels: Any, probs: Any) -> Any:
    """Keras's ``sparse_categorical_crossentropy`` loss, reduced as ``compile`` reduces it."""
    per_sample = keras.losses.sparse_categorical_crossentropy(labels, probs)
    return jnp.sum(per_sample) / per_sample.shape[0]


def _total_loss(data_loss: Any, extra_losses: list[Any]) -> Any:
    """Data loss plus regularization losses, summed as ``keras.Model.compute_loss`` does."""
    if not extra_losses:
        return data_loss
    return jnp.sum(jnp.stack([data_loss, *(jnp.sum(loss) for loss in extra_losses)]))


def make_train_step(model: Any, transform: Any) -> Any:
    """``train_step(state, x, y) -> (state, loss)`` for a Keras model and an optax transform."""
    import keras

    def loss_fn(trainable, non_trainable, x, y):
        probs, non_trainable, extra = model.stateless_call(
            trainable, non_trainable, x, training=True, return_losses=True)
        return _total_loss(_mean_cross_entropy(keras, y, probs), extra), non_trainable

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def train_step(state: TrainState, x: Any, y: Any) -> tuple[TrainState, Any]:
        (loss, non_trainable), grads = grad_fn(state.trainable, state.non_trainable, x, y)
        updates, opt_state = transform.update(grads, state.opt_state, state.trainable)
        trainable = optax.apply_updates(state.trainable, updates)
        return TrainState(trainable, non_trainable, opt_state), loss

    return train_step


class NativeTrainer:
    """Runs fused train calls on one model; see ``kbackend.engines.native`` for the driver."""

    def __init__(self, model: Any, spec: Any, dataset: Any) -> None:
        import keras

        self.model = model
        self.keras = keras
        self.train_step = make_train_step(model, spec.to_optax())
        # Copies: the state's buffers are donated, the Keras variables must keep theirs.
        trainable = [jnp.array(v.value) for v in model.trainable_variables]
        non_trainable = [jnp.array(v.value) for v in model.non_trainable_variables]
        self.state = TrainState(trainable, non_trainable, spec.to_optax().init(trainable))
        # The training split goes to the device once; steps gather their batches there.
        self.x_train = jax.device_put(dataset.x_train)
        self.y_train = jax.device_put(dataset.y_train)
        self._val = tuple(jax.device_put(a) for a in
                          pad_to_chunks(dataset.x_val, dataset.y_val, EVAL_CHUNK))
        self._compiled: dict[int, Any] = {}
        self.trace_counts: dict[int, int] = {}
        self._evaluate = jax.jit(self._evaluate_fn)

    # -- training -------------------------------------------------------------------------
    def _run_fn(self, length: int) -> Any:
        def run(state, x_all, y_all, epoch_rows, start):
            self.trace_counts[length] = self.trace_counts.get(length, 0) + 1
            rows = jax.lax.dynamic_slice_in_dim(epoch_rows, start, length)

            def body(state, row):
                return self.train_step(state, x_all[row], y_all[row])

            return jax.lax.scan(body, state, rows)

        return run

    def put_epoch(self, rows: np.ndarray) -> Any:
        """Move an epoch's ``(steps, batch)`` index matrix to the device, ahead of its steps."""
        return jax.device_put(rows)

    def compile(self, length: int, epoch_rows: Any) -> float:
        """Compile the ``length``-step call if needed; the seconds it took (0.0 if cached)."""
        if length in self._compiled:
            return 0.0
        start = time.perf_counter()
        jitted = jax.jit(self._run_fn(length), donate_argnums=0)
        self._compiled[length] = jitted.lower(
            self.state, self.x_train, self.y_train, epoch_rows, np.int32(0)).compile()
        return time.perf_counter() - start

    def run(self, epoch_rows: Any, start: int, length: int) -> Any:
        """Dispatch ``length`` steps from row ``start`` (asynchronously); their losses (device)."""
        self.state, losses = self._compiled[length](
            self.state, self.x_train, self.y_train, epoch_rows, np.int32(start))
        return losses

    def fetch(self, losses: Any) -> np.ndarray:
        """Wait for a call's losses and copy them to the host."""
        return np.asarray(jax.block_until_ready(losses))

    # -- evaluation -----------------------------------------------------------------------
    def _evaluate_fn(self, trainable, non_trainable, x_chunks, y_chunks, mask_chunks):
        def chunk_sums(carry, chunk):
            x, y, mask = chunk
            probs, _, extra = self.model.stateless_call(
                trainable, non_trainable, x, training=False, return_losses=True)
            per_sample = self.keras.losses.sparse_categorical_crossentropy(y, probs)
            correct = (jnp.argmax(probs, axis=-1) == y).astype(jnp.float32)
            penalty = sum((jnp.sum(loss) for loss in extra), jnp.float32(0.0))
            return (carry[0] + jnp.sum(per_sample * mask), carry[1] + jnp.sum(correct * mask),
                    penalty), None

        zero = jnp.float32(0.0)
        (loss_sum, correct, penalty), _ = jax.lax.scan(
            chunk_sums, (zero, zero, zero), (x_chunks, y_chunks, mask_chunks))
        count = jnp.sum(mask_chunks)
        return loss_sum / count + penalty, correct / count

    def evaluate(self) -> tuple[float, float]:
        """Validation loss (cross-entropy + regularization, as Keras reports it) and accuracy."""
        loss, accuracy = self._evaluate(self.state.trainable, self.state.non_trainable, *self._val)
        return float(loss), float(accuracy)

    # -- model values ---------------------------------------------------------------------
    def snapshot(self) -> Any:
        """A host copy of the model's values (for restoring the best ones)."""
        return jax.device_get((self.state.trainable, self.state.non_trainable))

    def restore(self, snapshot: Any) -> None:
        trainable, non_trainable = (jax.tree.map(jnp.asarray, part) for part in snapshot)
        self.state = self.state._replace(trainable=trainable, non_trainable=non_trainable)

    def finish(self) -> None:
        """Write the trained values back into the Keras model (save/evaluate/predict use them)."""
        pairs = [*zip(self.model.trainable_variables, self.state.trainable, strict=True),
                 *zip(self.model.non_trainable_variables, self.state.non_trainable, strict=True)]
        for variable, value in pairs:
            variable.assign(value)

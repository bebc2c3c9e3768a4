"""The JAX data-parallel native engine: the loop around ``jax_step``'s pure train step.

Each epoch draws one permutation of the training split from ``config.seed`` (the same in every
process), cuts it into global batches of ``config.batch_size`` (a last partial batch is dropped:
it could not be split evenly over the devices), and runs ``config.fused_steps`` steps per
compiled call. In a multi-process job each process reads only its own contiguous block of rows of
every global batch; the devices of process p hold block p, so the global batch, and therefore the
training, is the same as in one process. Validation runs on this process's copy of the
(replicated) parameters.
"""

from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kbackend.history import History
from kbackend.parallel import check_batch_split, device_count
from kbackend.parallel.jax_step import (
    initial_state,
    make_mesh,
    make_train_step,
    replicate,
    replicate_for_pmap,
    shard_batch,
    split_for_pmap,
    to_host,
)


def _evaluator(model: Any) -> Any:
    import keras

    @jax.jit
    def evaluate(trainable: list, non_trainable: list, x: Any, y: Any) -> tuple[Any, Any]:
        probs, _ = model.stateless_call(trainable, non_trainable, x, training=False)
        loss = jnp.sum(keras.losses.sparse_categorical_crossentropy(y, probs))
        return loss, jnp.sum(jnp.argmax(probs, axis=-1) == y)

    def run(trainable: list, non_trainable: list, x: np.ndarray, y: np.ndarray) -> dict[str, float]:
        loss = correct = 0.0
        for start in range(0, len(x), 1024):
            part_loss, part_correct = evaluate(trainable, non_trainable, x[start:start + 1024],
                                               y[start:start + 1024])
            loss, correct = loss + float(part_loss), correct + float(part_correct)
        return {"val_loss": loss / len(x), "val_accuracy": correct / len(x)}

    return run


def _write_back(model: Any, host_state: Any) -> None:
    for variable, value in zip(model.trainable_variables, host_state.trainable, strict=True):
        variable.assign(value)
    for variable, value in zip(model.non_trainable_variables, host_state.non_trainable, strict=True):
        variable.assign(value)


def train(model: Any, dataset: Any, spec: Any, config: Any, reporter: Any = None) -> History:
    """Train ``model`` data parallel over ``config.devices`` devices; return the history."""
    from kbackend.engines.keras_fit import compile_model

    count = device_count(config)
    batch = config.batch_size
    per_device = check_batch_split(batch, count, config.num_processes)
    processes, process = jax.process_count(), jax.process_index()
    local_rows = batch // processes
    devices = jax.devices()[:count]
    mesh = make_mesh(devices)
    tx = spec.to_optax()
    step_fn = make_train_step(model, tx, mesh, config.dp_impl)
    if config.dp_impl == "pmap":
        if processes > 1:
            from kbackend.errors import ConfigError

            raise ConfigError("--dp-impl pmap runs in one process; use --dp-impl shard_map for multi-process jobs.")
        state = replicate_for_pmap(initial_state(model, tx), count)

        def place(xs: np.ndarray, ys: np.ndarray) -> Any:
            return split_for_pmap((xs, ys), count)
    else:
        state = replicate(initial_state(model, tx), mesh)

        def place(xs: np.ndarray, ys: np.ndarray) -> Any:
            return shard_batch((xs, ys), mesh)

    def host_state() -> Any:
        host = to_host(state)
        return jax.tree.map(lambda leaf: leaf[0], host) if config.dp_impl == "pmap" else host

    def first(metric: Any) -> np.ndarray:
        values = to_host(metric)
        return values[0] if config.dp_impl == "pmap" else values

    evaluate = _evaluator(model)
    x_train, y_train = dataset.x_train, dataset.y_train
    steps_per_epoch = len(x_train) // batch
    total = steps_per_epoch * config.epochs
    if config.max_steps:
        total = min(total, config.max_steps)
    rng = np.random.default_rng(config.seed)
    history = History()
    history.extra.update({"devices": count, "per_device_batch": per_device, "processes": processes,
                          "dp_impl": config.dp_impl, "dropped_per_epoch": len(x_train) % batch,
                          "losses_are_global_batch_means": True})
    train_time, step = 0.0, 0
    for epoch in range(1, config.epochs + 1):
        order = rng.permutation(len(x_train))[:steps_per_epoch * batch].reshape(steps_per_epoch, batch)
        mine = order[:, process * local_rows:(process + 1) * local_rows]  # this process's rows
        position = 0
        while position < steps_per_epoch and step < total:
            k = min(config.fused_steps, steps_per_epoch - position, total - step)
            if config.eval_every:
                k = min(k, config.eval_every - step % config.eval_every)
            rows = mine[position:position + k]
            batches = place(x_train[rows], y_train[rows])
            started = time.perf_counter()
            state, metrics = step_fn(state, batches)
            losses = first(metrics.loss)  # waits for the device: honest timing
            elapsed = time.perf_counter() - started
            times = train_time + elapsed * np.arange(1, k + 1) / k
            history.record_steps(list(range(step + 1, step + k + 1)), list(losses), list(times))
            train_time += elapsed
            step, position = step + k, position + k
            epoch_end = position == steps_per_epoch or step == total
            if (config.eval_every and step % config.eval_every == 0) or epoch_end:
                current = host_state()
                record = {"step": step, "epoch": epoch, "train_time": train_time,
                          "train_loss": float(np.mean(losses)),
                          **evaluate(current.trainable, current.non_trainable,
                                     dataset.x_val, dataset.y_val)}
                history.record_eval(**record)
                if reporter is not None and epoch_end:
                    reporter.epoch_end(epoch, config.epochs, record)
                if config.target is not None and config.target.reached(record):
                    history.extra["target_reached"] = {"step": step, "epoch": epoch,
                                                       "train_time": train_time}
                    total = step
        if step >= total:
            break
    _write_back(model, host_state())
    compile_model(model, spec, config)  # so model.evaluate works on the trained weights
    history.timing["train_time"] = train_time
    history.extra["epochs_run"] = epoch
    return history

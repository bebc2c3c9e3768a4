"""Engine ``data_parallel``: the native loop with the backend's sharded trainer.

On JAX the trainer is the pmap-style ``jax.shard_map`` one (``backends/jax/data_parallel.py``);
on TensorFlow a ``tf.distribute`` custom loop (``MirroredStrategy`` in one process, the job's
``MultiWorkerMirroredStrategy`` across processes; ``backends/tensorflow/data_parallel.py``).
"""

from __future__ import annotations

from typing import Any

from kbackend import distributed
from kbackend.backends import impl
from kbackend.engines import loop
from kbackend.engines.keras_fit import compile_model
from kbackend.errors import ConfigError
from kbackend.history import History


def train(model: Any, dataset: Any, spec: Any, config: Any, reporter: Any = None) -> History:
    """Train ``model`` data parallel over ``config.devices`` devices; return the history."""
    return distributed.run_guarded(_train, model, dataset, spec, config, reporter)


def _train(model: Any, dataset: Any, spec: Any, config: Any, reporter: Any = None) -> History:
    if config.fused_steps == 0:
        # The probe measures one device, and each process would pick its own K: the processes'
        # compiled programs (and their collectives) must match.
        raise ConfigError("--fused-steps auto is single-device only: pass a number of fused "
                          "steps with --engine data_parallel.")
    count = distributed.device_count(config)  # the batch split was checked by config.check_run
    plan = loop.Plan.of(config, len(dataset.x_train), config.fused_steps)
    spec = spec.with_total_steps(plan.steps_per_epoch * config.epochs)
    compile_model(model, spec, config)  # for evaluate/predict/save afterwards
    trainer = impl().data_parallel_trainer(model, spec, dataset, devices=count,
                                           batch_size=config.batch_size, dp_impl=config.dp_impl,
                                           task=config.task)
    history = History()
    history.extra.update(engine="native", decay_steps=spec.decay_steps)
    return loop.run(trainer, plan, config, reporter, history=history)

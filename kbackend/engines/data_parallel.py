"""Engine ``data_parallel``: the native loop with the backend's sharded trainer.

On JAX the trainer is the pmap-style ``jax.shard_map`` one (``backends/jax/data_parallel.py``);
on TensorFlow a ``tf.distribute`` custom loop (``MirroredStrategy`` in one process, the job's
``MultiWorkerMirroredStrategy`` across processes; ``backends/tensorflow/data_parallel.py``).
"""

from __future__ import annotations

from typing import Any

from kbackend.backends import impl
from kbackend.config import TrainConfig
from kbackend.engines import loop
from kbackend.engines.keras_fit import compile_model
from kbackend.engines.plan import TrainPlan
from kbackend.errors import ConfigError
from kbackend.history import History


def train(model: Any, dataset: Any, plan: TrainPlan, config: TrainConfig,
          reporter: Any = None) -> History:
    """Train ``model`` data parallel over ``plan.devices`` devices; return the history."""
    if plan.fused_steps == 0:
        # The probe measures one device, and each process would pick its own K: the processes'
        # compiled programs (and their collectives) must match.
        raise ConfigError("--fused-steps auto is single-device only: pass a number of fused "
                          "steps with --engine data_parallel.")
    spec = plan.optimizer
    compile_model(model, spec, config)  # for evaluate/predict/save afterwards
    trainer = impl().data_parallel_trainer(model, spec, dataset, devices=plan.devices,
                                           batch_size=plan.batch_size, dp_impl=config.dp_impl,
                                           task=config.task)
    # the batch split checked by config.check_run, as the plan holds it
    history = loop.native_history(spec, devices=plan.devices,
                                  per_device_batch=plan.per_device_batch,
                                  processes=plan.processes)
    return loop.run(trainer, plan, config, reporter, history=history)

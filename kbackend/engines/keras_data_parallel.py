"""Engine ``keras_data_parallel``: Keras ``fit`` spread over several devices (and processes).

The backend supplies the scope (``impl().data_parallel_scope``): ``keras.distribution
.DataParallel`` on JAX, ``tf.distribute.MirroredStrategy`` (``MultiWorkerMirroredStrategy`` in a
multi-process job) on TensorFlow. Variables must be created inside that scope, so the engine
trains a clone of the model built in the scope and copies the trained weights back.

The training split is cut to a whole number of global batches: a last partial batch could not be
split evenly over the devices (the single-device run it is compared with gets the same cut). The
validation split is cut to a multiple of the devices for the same reason (at most devices - 1
samples, said in ``record.validation_dropped``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from kbackend.backend_choice import keras as import_keras
from kbackend.backends import impl
from kbackend.config import TrainConfig
from kbackend.engines import keras_fit
from kbackend.engines.plan import TrainPlan
from kbackend.history import History


def whole_batches(dataset: Any, batch_size: int) -> Any:
    """``dataset`` with its training split cut to a multiple of ``batch_size`` samples."""
    keep = len(dataset.x_train) - len(dataset.x_train) % batch_size
    return replace(dataset, x_train=dataset.x_train[:keep], y_train=dataset.y_train[:keep])


def train(model: Any, dataset: Any, plan: TrainPlan, config: TrainConfig,
          reporter: Any = None) -> History:
    """Train ``model`` with ``fit`` data parallel over ``plan.devices`` devices."""
    keras = import_keras()
    backend = impl()
    count = plan.devices
    trimmed = whole_batches(dataset, plan.batch_size)
    # Keras splits every validation batch over the devices too: the last one must divide.
    n_val = len(dataset.x_val) - len(dataset.x_val) % (count * max(1, config.num_processes))
    trimmed = replace(trimmed, x_val=dataset.x_val[:n_val], y_val=dataset.y_val[:n_val])
    x, y, batch_size = backend.keras_fit_inputs(trimmed.x_train, trimmed.y_train,
                                                plan.batch_size)
    local = replace(trimmed, x_train=x, y_train=y)
    with backend.data_parallel_scope(count):
        replica = keras.models.clone_model(model, clone_function=backend.data_parallel_clone_layer)
        replica.set_weights(model.get_weights())
        fit_config = replace(config, batch_size=batch_size,
                             jit_compile=backend.data_parallel_jit_compile(config.jit_compile))
        # fit runs this process's block of the trimmed split with its share of each global
        # batch: whole batches, so the plan's steps, budget and schedule are unchanged.
        fit_plan = replace(plan, n_train=len(local.x_train), batch_size=batch_size,
                           drops_last_batch=False)
        history = keras_fit.train(replica, local, fit_plan, fit_config, reporter)
    model.set_weights(replica.get_weights())
    # so model.evaluate works on the trained weights
    keras_fit.compile_model(model, plan.optimizer, config)
    record = history.record
    record.devices, record.per_device_batch = count, plan.per_device_batch
    record.processes = backend.process_count()
    record.dropped_per_epoch = plan.dropped_per_epoch
    record.validation_dropped = len(dataset.x_val) - n_val
    return history

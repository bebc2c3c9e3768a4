"""The Keras ``fit`` engine: ``model.compile`` + ``model.fit`` with a recording callback.

The callback also stops ``fit`` at the first non-finite train loss (as ``keras.callbacks
.TerminateOnNaN`` does) and records it in ``history.record.diverged``; raising is
``kbackend.training.train``'s decision, as for the native engines.
"""

from __future__ import annotations

import math
import time
from typing import Any

from kbackend.backend_choice import keras as import_keras
from kbackend.backends import impl
from kbackend.config import TrainConfig
from kbackend.data.batching import call_lengths
from kbackend.engines.plan import TrainPlan
from kbackend.hardware.inputs import monitored_batches
from kbackend.hardware.monitor import StepMonitor, keras_callback
from kbackend.history import History
from kbackend.task import MultiOutputTask, metric_direction


class _FitRecording:
    """Records per-step train losses and training time with evaluation time excluded: the
    behaviour of ``fit``'s recording callback, mixed into ``keras.callbacks.Callback`` by
    ``_recorder_class`` (which supplies ``model``).

    Keras reports the running mean of the loss over the epoch, weighted by batch size; the
    loss of each executed interval is recovered exactly from consecutive running means.
    With ``steps_per_execution`` > 1 callbacks fire once per execution, so each recorded
    point is the mean loss of that execution's steps.
    """

    model: Any  # Keras's Callback.model: the model fit is training

    def __init__(self, history: History, batch_sizes: list[int], steps_per_epoch: int,
                 steps_per_execution: int, reporter: Any, epochs: int,
                 max_steps: int = 0, target: Any = None) -> None:
        super().__init__()
        self.history = history
        self.batch_sizes = batch_sizes
        self.steps_per_epoch = steps_per_epoch
        self.steps_per_execution = steps_per_execution
        self.reporter = reporter
        self.epochs = epochs
        self.eval_time = 0.0
        self.epoch = 0
        self.max_steps = max_steps
        self.target = target

    def _train_time(self) -> float:
        return time.perf_counter() - self.start - self.eval_time

    def on_train_begin(self, logs: Any = None) -> None:
        self.start = time.perf_counter()

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self.epoch = epoch
        self.seen_samples = 0
        self.seen_loss_sum = 0.0
        self.last_batch = -1

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        running_mean = float(logs["loss"])
        elapsed = self._train_time()
        first, last = self.last_batch + 1, batch
        interval_samples = sum(self.batch_sizes[first:last + 1])
        total = self.seen_samples + interval_samples
        interval_loss = (running_mean * total - self.seen_loss_sum) / interval_samples
        self.seen_samples, self.seen_loss_sum = total, running_mean * total
        self.last_batch = batch
        step = self.epoch * self.steps_per_epoch + batch + 1
        self.history.record_steps([step], [interval_loss], [elapsed])
        if not math.isfinite(running_mean):
            # With steps_per_execution > 1 this is the execution's last step: Keras reports
            # no finer loss.
            self.history.record.diverged = {"step": step, "loss": str(interval_loss),
                                            "seen_in": "train_loss"}
            self.model.stop_training = True
        if self.max_steps and step >= self.max_steps:
            self.model.stop_training = True

    def on_test_begin(self, logs: Any = None) -> None:
        self.test_start = time.perf_counter()

    def on_test_end(self, logs: Any = None) -> None:
        self.eval_time += time.perf_counter() - self.test_start

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        if self.history.record.diverged is not None:
            return  # Keras validated the diverged weights anyway; nothing to record
        logs = logs or {}
        # The last step run, not the epoch boundary: max_steps can stop an epoch early.
        record = {"step": self.history.steps_run, "epoch": epoch + 1,
                  "train_time": self._train_time()}
        for key, value in logs.items():  # loss, the compiled metric, their val_ twins
            if key.startswith("val_"):
                record[key] = float(value)
            elif key != "learning_rate":
                record["train_" + key] = float(value)
        self.history.record_eval(**record)
        if self.target is not None and self.target.reached_in(self.history.evals) and \
                self.history.record.target_reached is None:
            self.history.record.target_reached = {
                "step": record["step"], "epoch": epoch + 1,
                "train_time": record["train_time"]}
            self.model.stop_training = True
        if self.reporter is not None:
            self.reporter.epoch_end(epoch + 1, self.epochs, record)

    def on_train_end(self, logs: Any = None) -> None:
        self.history.timing["train_time"] = self._train_time()
        self.history.timing["eval_time"] = self.eval_time


def _recorder_class() -> Any:
    """``_FitRecording`` as a Keras callback class. Built when a run asks for it, not at import:
    its base comes from Keras, and importing this module must not import Keras (that picks the
    backend and costs seconds of start-up)."""
    # Any: mypy cannot see the classes of a module imported at run time (the base below)
    keras: Any = import_keras()

    class Recorder(_FitRecording, keras.callbacks.Callback):
        """``fit``'s recording callback (``_FitRecording``)."""

    return Recorder


def build_optimizer(model: Any) -> None:
    """Make the compiled model's optimizer variables now (iterations, slots): the run writes its
    trained state into them at the end (a saved model resumes), and making them is set-up, not
    one of the run's own programs (``record.xla_programs``)."""
    optimizer = getattr(model, "optimizer", None)
    inner = getattr(optimizer, "inner_optimizer", optimizer)  # a loss-scale wrapper's own
    if inner is not None and not inner.built:
        inner.build(model.trainable_variables)


def compile_model(model: Any, spec: Any, config: Any) -> None:
    """Compile ``model`` for its task (``config.task``: loss and metric) with ``spec``'s
    optimizer."""
    task = config.task
    # The spec this model's optimizer was made from: a trainer may train with that optimizer
    # (TF's native loop does, so a saved model holds its trained state) only for this spec,
    # never with an optimizer the user compiled the model with.
    object.__setattr__(model, "_kbackend_spec", spec)
    model.compile(
        optimizer=spec.to_keras(),
        **_loss_and_metrics(task),
        jit_compile=config.jit_compile,
        steps_per_execution=config.steps_per_execution,
    )


def _loss_and_metrics(task: Any) -> dict[str, Any]:
    """``compile``'s loss, loss weights and metrics for ``task``: a multi-output task's as
    dicts keyed by output (Keras then logs ``<output>_loss`` and ``<output>_<metric>``, the
    name ``task.metric`` has), else the one loss and metric."""
    if isinstance(task, MultiOutputTask):
        return {"loss": task.loss_object(),
                "loss_weights": {h.name: h.weight for h in task.heads},
                "metrics": {h.name: [_keras_metric(h.task)] for h in task.heads}}
    return {"loss": task.loss_object(), "metrics": [_keras_metric(task)]}


def _keras_metric(task: Any) -> Any:
    """The task's metric as a Keras metric logged under ``task.metric``."""
    keras = import_keras()
    return keras.metrics.MeanMetricWrapper(getattr(keras.metrics, task.metric_fn),
                                           name=task.metric, **dict(task.metric_args))


def train(model: Any, dataset: Any, plan: TrainPlan, config: TrainConfig,
          reporter: Any = None) -> History:
    """Train ``model`` with ``model.fit`` as ``plan`` says (one step per batch, the last batch
    of each epoch partial) and return the history in kbackend's format."""
    keras = import_keras()
    batch = plan.batch_size
    batch_sizes = call_lengths(plan.n_train, batch)  # the last batch of an epoch partial
    compile_model(model, plan.optimizer, config)
    history = History()
    # fit stops at max_steps (its epochs cannot): the plan's budget
    budget = plan.total_steps if config.max_steps else 0
    callbacks = [_recorder_class()(history, batch_sizes, plan.steps_per_epoch,
                                   config.steps_per_execution, reporter, plan.epochs,
                                   budget, config.target)]
    if config.early_stopping:
        callbacks.append(keras.callbacks.EarlyStopping(
            monitor=config.monitor, patience=config.early_stopping, restore_best_weights=True,
            mode=metric_direction(config.monitor)))
    impl().set_random_seed(config.seed)
    # One batch source, monitored or not, in kbackend.data.batching's order: turning the monitor
    # on does not change the batches (Keras's own shuffle would differ, and by backend).
    monitor = None
    if config.hardware_monitor:
        monitor = StepMonitor()
        callbacks.append(keras_callback(monitor, batch, config.steps_per_execution))
    source = monitored_batches(dataset.x_train, dataset.y_train, batch,
                               monitor=monitor, seed=config.seed, shuffle=config.shuffle,
                               label_transform=config.task.fit_labels)
    callbacks.append(source.epoch_callback())
    fit_history = model.fit(
        source, shuffle=False, epochs=plan.epochs,  # the source's order, not shuffled again
        validation_data=(dataset.x_val, config.task.fit_labels(dataset.y_val)),
        callbacks=callbacks,
        verbose=0,
    )
    if monitor is not None:
        history.record.monitor = monitor.stop()
    history.stopped_early = (len(fit_history.epoch) < plan.epochs and not config.max_steps
                             and history.record.diverged is None)
    history.record.epochs_run = len(fit_history.epoch)
    history.record.steps_per_epoch = plan.steps_per_epoch
    history.record.losses_are_execution_means = config.steps_per_execution > 1
    return history

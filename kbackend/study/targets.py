"""The target a study races every cell to: one rule for every front door (``study_target``).

A built-in dataset has a default target that every default cell reaches, which its data source
gives (``kbackend.data.named``: ``BuiltinData.default_target``). The user's own data never gets
another dataset's default: the study asks for ``--target`` (``target=`` from Python), and the
one-line error names the validation metric the model reports and the best value a short probe
reached on this data, so the user can pick a value the grid can reach. The command line,
``kbackend.study``, ``StudyConfig`` and ``advise``'s printed study command all follow it.
"""

from __future__ import annotations

from dataclasses import replace

from kbackend.config import Target, TrainConfig
from kbackend.data.named import data_source
from kbackend.errors import ConfigError
from kbackend.models import ModelOptions
from kbackend.optim import OptimizerSpec
from kbackend.training import train, workload_of

# The probe: Adam at its usual rate, a small batch, a few epochs on the native engine, capped in
# steps so a large dataset does not make an error message slow.
PROBE_EPOCHS = 3
PROBE_MAX_STEPS = 600
PROBE_BATCH = 32


def default_target(data: str, label: str | None = None) -> Target | None:
    """The target a study on ``data`` races to unless told: its data source's own (a built-in
    dataset's); None for the user's own data."""
    default = data_source(data, label).default_target()
    return None if default is None else Target(*default)


def study_target(model: str, data: str, value: float | None, metric: str | None, *,
                 label: str | None = None, python: bool = False, data_dir: str | None = None,
                 unsafe_deserialization: bool = False,
                 validation_fraction: float = 0.1) -> Target:
    """The target of a study of ``model`` on ``data``: ``value`` of ``metric`` (default
    ``val_accuracy``) when a value is given; else the data source's own (``default_target``),
    where ``metric`` is None or its metric; else, for the user's own data, the one-line
    ``missing_target_error``. ``python``: the error names ``target=`` (``kbackend.study``,
    ``StudyConfig``) instead of ``--target``."""
    if value is not None:
        return Target(metric or "val_accuracy", value)
    flag, metric_flag = ("target=", "target_metric=") if python else \
        ("--target", "--target-metric ")
    default = default_target(data, label)
    if default is None:
        raise missing_target_error(model, data, label=label, python=python, data_dir=data_dir,
                                   unsafe_deserialization=unsafe_deserialization,
                                   validation_fraction=validation_fraction)
    if metric is not None and metric != default.metric:
        raise ConfigError(f"{metric_flag}{metric} needs an explicit {flag} value (the "
                          f"dataset's default target is on {default.metric}).")
    return default


def missing_target_error(model: str, dataset: str, *, label: str | None = None,
                         python: bool = False, data_dir: str | None = None,
                         unsafe_deserialization: bool = False,
                         validation_fraction: float = 0.1) -> ConfigError:
    """The one-line error for a study of ``model`` on the user's ``dataset`` without a target:
    the model's validation metric and what a short probe (``PROBE_EPOCHS`` epochs of Adam)
    reached with it, and an example in the caller's words (``python``: keywords, else flags)."""
    config = TrainConfig(model=model, dataset=dataset, label=label, data_dir=data_dir,
                         unsafe_deserialization=unsafe_deserialization,
                         validation_fraction=validation_fraction)
    workload = workload_of(config)
    metric = f"val_{workload.task.metric}"
    num_train = workload.dataset.info.num_train
    batch = min(PROBE_BATCH, num_train)
    probe = replace(config, optimizer=OptimizerSpec("adam", 1e-3), batch_size=batch,
                    epochs=PROBE_EPOCHS, max_steps=PROBE_MAX_STEPS, engine="native",
                    fused_steps=1, task=workload.task, model_options=ModelOptions(seed=0),
                    on_divergence="record")
    best = train(probe, workload=workload).history.best(metric)
    reached = ("the probe did not produce a finite value" if best is None else
               f"a {PROBE_EPOCHS}-epoch Adam probe (lr 1e-3, batch {batch}) reached {best:.4g}")
    flag, example = (("target=", f"target=VALUE, target_metric={metric!r}") if python else
                     ("--target", f"--target VALUE --target-metric {metric}"))
    return ConfigError(
        f"A study on your own data needs {flag}: the value of {metric} (the model's "
        f"validation metric) every cell races to; {reached} here, so pick a value the grid can "
        f"reach (at or a little short of it), e.g. {example}.")

"""The target a study races every cell to, for data kbackend knows nothing about.

A built-in dataset has a default target that every default cell reaches (``study.config``'s
``DEFAULT_TARGETS``). The user's own data never gets another dataset's default: the study asks
for ``--target`` (``target=`` from Python), and the one-line error names the validation metric
the model reports and the best value a short probe reached on this data, so the user can pick a
value the grid can reach. One rule for the command line and Python (``missing_target_error``).
"""

from __future__ import annotations

from kbackend.config import TrainConfig
from kbackend.data import DATASETS
from kbackend.errors import ConfigError
from kbackend.models import MODELS, ModelOptions
from kbackend.optim import OptimizerSpec
from kbackend.training import train, workload_of

# The probe: Adam at its usual rate, a small batch, a few epochs on the native engine, capped in
# steps so a large dataset does not make an error message slow.
PROBE_EPOCHS = 3
PROBE_MAX_STEPS = 600
PROBE_BATCH = 32


def needs_explicit_target(dataset: str) -> bool:
    """Whether a study on ``dataset`` must be told its target (the user's own data)."""
    return dataset not in DATASETS


def missing_target_error(model: str, dataset: str, *, label: str | None = None,
                         flag: str = "--target", data_dir: str | None = None,
                         unsafe_deserialization: bool = False,
                         validation_fraction: float = 0.1) -> ConfigError:
    """The one-line error for a study of ``model`` on the user's ``dataset`` without a target:
    the model's validation metric and what a short probe (``PROBE_EPOCHS`` epochs of Adam)
    reached with it."""
    config = TrainConfig(model=model, dataset=dataset, label=label, data_dir=data_dir,
                         unsafe_deserialization=unsafe_deserialization,
                         validation_fraction=validation_fraction)
    workload = workload_of(config)
    metric = f"val_{workload.task.metric}"
    num_train = workload.dataset.info.num_train
    batch = min(PROBE_BATCH, num_train)
    probe = TrainConfig(
        model=model, dataset=dataset, label=label, data_dir=data_dir,
        unsafe_deserialization=unsafe_deserialization, validation_fraction=validation_fraction,
        optimizer=OptimizerSpec("adam", 1e-3), batch_size=batch, epochs=PROBE_EPOCHS,
        max_steps=PROBE_MAX_STEPS, engine="native", fused_steps=1, task=workload.task,
        model_options=ModelOptions(seed=0), on_divergence="record")
    best = train(probe, workload=workload).history.best(metric)
    reached = ("the probe did not produce a finite value" if best is None else
               f"a {PROBE_EPOCHS}-epoch Adam probe (lr 1e-3, batch {batch}) reached {best:.4g}")
    what = "built-in" if model in MODELS else "its"
    return ConfigError(
        f"A study on your own data needs {flag}: the value of {metric} ({what} model's "
        f"validation metric) every cell races to; {reached} here, so pick a value the grid can "
        f"reach (at or a little short of it), e.g. {flag} VALUE --target-metric {metric}.")

"""What a batch-size x optimizer study runs: the grid, the learning-rate search, the target and
the budgets. Everything here is validated before any training starts."""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from kbackend.adaptive import AUTO, AutoBatchSize, is_power_of_two
from kbackend.config import ENGINE_CHOICES, LR_SCALING, MAX_EPOCHS, MAX_STEPS
from kbackend.data import check_batch_size
from kbackend.data.user import check_image_size
from kbackend.engine_facts import DEFAULT_ENGINE, engine_facts
from kbackend.errors import ConfigError, DataError, check_declared, declared
from kbackend.optim import OPTIMIZERS, OptimizerSpec
from kbackend.study.targets import study_target
from kbackend.study.verdicts import DEFAULT_ACCURACY_MARGIN, DEFAULT_MARGIN
from kbackend.training import Target

DEFAULT_OPTIMIZERS = ("sgd", "momentum", "adam")
POPULATION_CHOICES = ("auto", "on", "off")
LOCAL_EXECUTOR = "local"
RAY_EXECUTOR = "ray"  # "ray" starts a local Ray instance; "ray:ADDRESS" joins a running cluster
RAY_EXTRA = "kbackend[ray]"  # what installs Ray (pyproject's optional dependencies)
SMALLEST_DEFAULT_BATCH = 8
_COUNT = declared(int, low=0)
_POSITIVE = declared(int, low=1)
# The default study: MNIST-1D drawn larger (15,000 sequences: 10,800 train, 1,200 validation,
# 3,000 test), generated offline by the mnist1d package, and the MNIST-1D paper's kind of model
# (a ReLU MLP, here 40-256-128-10). Not trivial (the paper: logistic 32%, MLP 68%, CNN 94% test
# accuracy), and its 1,200 validation samples resolve accuracy in steps of 0.08% (digits: 144
# samples, 0.7%). Every default cell reaches the target within the budget.
DEFAULT_DATASET = "mnist1d_large"
DEFAULT_MODEL = "mlp"
DEFAULT_MAX_STEPS = 3000
# Per-dataset budgets (max_steps, max_epochs) where the default's 3,000 steps cannot reach the
# target: on MNIST batch 8 needs 9,000-13,500 steps to 0.97, and at most 8 epochs keeps large
# batches from running as many (measured: docs/reproductions.md, the IPU MNIST study); on
# mnist1d_large batch 8 needs 2,475-3,600 steps to 0.65 and batch 1,024 at most 14 epochs
# (docs/study.md), so 8,000 steps or 40 epochs leave every cell at least 2x its need.
DEFAULT_BUDGETS: dict[str, tuple[int, int]] = {"mnist": (20_000, 8), "mnist1d_large": (8_000, 40)}
# Validations per epoch. Each checks the whole validation split, so its arithmetic is a fixed
# share of the training between two checks (the default study's evaluation: 0.25x its steady
# training at 8 an epoch, 0.20x at 6), while the step resolution of "steps to target" stays
# finer than the spread over seeds (docs/study.md, "Why this default problem and target").
DEFAULT_EVALS_PER_EPOCH = 6

# The equal budget, in epochs, of the frontier runs (the best validation value each cell reaches,
# and the test metric of that checkpoint): the same for every cell of a study, and what the
# command line uses unless --frontier-epochs says otherwise (StudyConfig's own default: 0, off).
# MNIST-1D-large: batch 8 reaches 0.65 in 2-3 epochs, batch 1,024 in 6-14; 3 epochs of every
# cell and seed fit the default study's 1.5x (docs/study.md). MNIST: batch 8
# reaches 0.97 in 1.3-2 epochs (6,750 steps each).
DEFAULT_FRONTIER_EPOCHS: dict[str, int] = {"mnist1d_large": 3, "mnist": 2}
FALLBACK_FRONTIER_EPOCHS = 3
# The automatic --seed-budget: added seeds and frontier runs may take this share of the recorded
# time of the runs before them.
AUTO_SEED_BUDGET_SHARE = 0.5

# Centre of each optimizer's learning-rate grid at REFERENCE_BATCH. The centre moves with the
# batch size by square-root scaling (a heuristic that holds for SGD below the critical batch
# size and for Adam, Malladi et al. 2022); the grid around it is what decides, and a best rate
# on the grid's edge is flagged in the report.
REFERENCE_BATCH = 32
CENTRE_LR = {"sgd": 0.2, "momentum": 0.02, "nesterov": 0.02, "adam": 2e-3, "adamw": 2e-3}
LR_BATCH_EXPONENT = 0.5


# How and where the cells run, never which question: kept out of ``StudyConfig.identity``.
EXECUTOR_FIELDS = ("executor", "workers", "cell_cpus", "cell_gpus")
# How many seeds and runs answer the question and how verdicts read them: also out of the
# identity (every run, added seed and frontier run has its own key), so studies stored before
# these options existed keep theirs.
VERDICT_FIELDS = ("max_seeds", "seed_budget", "margin", "accuracy_margin", "frontier_epochs")


def default_frontier_epochs(dataset: str) -> int:
    """The frontier's equal budget in epochs the command line uses for ``dataset``."""
    return DEFAULT_FRONTIER_EPOCHS.get(dataset, FALLBACK_FRONTIER_EPOCHS)


# Where half the training split would allow more: the default grid's largest batch size.
DEFAULT_MAX_BATCH: dict[str, int] = {"mnist1d_large": 1024}


def default_batch_sizes(num_train: int) -> tuple[int, ...]:
    """Powers of two from 8 up to the largest that still gives two steps per epoch."""
    sizes = []
    size = SMALLEST_DEFAULT_BATCH
    while size <= num_train // 2:
        sizes.append(size)
        size *= 2
    return tuple(sizes) or (max(1, num_train // 2),)


@dataclass(frozen=True)
class StudyConfig:
    """A batch-size x optimizer study.

    ``batch_sizes=None`` picks powers of two that fit the training split; an explicit empty
    tuple is an error. ``learning_rates`` maps an optimizer to its explicit grid (otherwise a
    ``lr_grid_size``-point grid spaced by ``lr_factor`` around ``CENTRE_LR`` scaled to the
    batch size). ``max_steps`` is each run's step budget, cut to ``max_epochs`` epochs where that
    is fewer (0: no epoch cap), so that one study can give a small batch thousands of steps and a
    large batch no more passes over the data than it needs (None: the dataset's default,
    ``DEFAULT_BUDGETS``, else ``DEFAULT_MAX_STEPS`` and no cap); ``evals_per_epoch`` sets how
    often the target is checked (engines that validate once per epoch do that instead). With
    ``prune``, a later learning rate of a cell gets the best median steps-to-target so far as
    its budget: it can only win by reaching the target in fewer steps. Each learning rate runs
    with ``seeds`` seeds (``seed``, ``seed + 1``, ...: initial weights and data order); a cell's
    figures are medians over them with an order-statistic interval. A cell whose best rate sits
    on an end of its grid extends the grid that way by up to ``lr_extend`` points. Time to
    target is the median steps to target times the cell's steady seconds per step, measured
    after training in ``step_time_repeats`` interleaved rounds (0: each run's own clock
    instead).
    ``population`` says how the native engine trains a cell's grid x seeds: ``"auto"`` as one
    vmapped population where a measured probe finds it faster than one run after another,
    ``"on"`` always (JAX only), ``"off"`` never (how, not which question: outside the identity).
    ``executor`` says where the cells run: ``"local"`` one after another in this process,
    ``"ray"`` as tasks on a Ray instance started here (``workers`` cells at once; 0: one per
    core), ``"ray:ADDRESS"`` on a running Ray cluster; each cell's task asks for ``cell_cpus``
    CPUs and ``cell_gpus`` GPUs (None: one GPU where the cluster has GPUs, else none; a fraction
    packs several cells on one GPU). Where, not which question: outside the identity, so the
    executors resume each other's studies.
    ``jit_compile=False`` trains the Keras engines and TensorFlow's native loop without XLA (on a
    CPU, TensorFlow's XLA compilation can cost more than a short run's training; JAX's native
    loop is always one XLA program).
    """

    model: str = DEFAULT_MODEL
    dataset: str = DEFAULT_DATASET
    data_dir: str | None = None
    # A CSV data source's label column; a .keras model's Lambda layers loaded (their code runs).
    label: str | None = None
    # An image folder's (height, width) to read every image at (None: the first image's size).
    image_size: tuple[int, int] | None = None
    unsafe_deserialization: bool = False
    validation_fraction: float = field(default=0.1, metadata=declared(
        (int, float), low=0, high=1, open_low=True, open_high=True,
        why="a study stops each run at a validation target, so it needs a split"))
    optimizers: tuple[str, ...] = DEFAULT_OPTIMIZERS
    # Fixed sizes, optionally with one ``"auto"``: an adaptive cell per optimizer bounded by the
    # smallest and the largest fixed size (native engine, local executor; ``lr_scaling``).
    batch_sizes: tuple[int | str, ...] | None = None
    max_batch_size: int = field(default=0, metadata=_COUNT)
    learning_rates: dict[str, tuple[float, ...]] = field(default_factory=dict)
    lr_grid_size: int = field(default=3, metadata=_POSITIVE)
    lr_factor: float = field(default=math.sqrt(10.0), metadata=declared(
        (int, float), low=1, open_low=True, why="a ratio"))
    target: Target | None = None
    max_steps: int | None = field(default=None, metadata=declared((int, type(None)), low=1))
    max_epochs: int | None = field(default=None, metadata=declared((int, type(None)), low=0))
    evals_per_epoch: int = field(default=DEFAULT_EVALS_PER_EPOCH, metadata=_POSITIVE)
    engine: str = field(default=DEFAULT_ENGINE, metadata=declared(str, choices=ENGINE_CHOICES))
    fused_steps: int = field(default=0, metadata=_COUNT)
    jit_compile: bool = True
    population: str = field(default="auto", metadata=declared(str, choices=POPULATION_CHOICES))
    seed: int = 0
    prune: bool = True
    seeds: int = field(default=3, metadata=_POSITIVE)
    lr_extend: int = field(default=2, metadata=_COUNT)
    step_time_repeats: int = field(default=10, metadata=_COUNT)
    noise_points: int = field(default=4, metadata=_COUNT)
    noise_draws: int = field(default=24, metadata=_POSITIVE)
    noise_small_batch: int = field(default=0, metadata=_COUNT)
    noise_big_batch: int = field(default=0, metadata=_COUNT)
    # Sequential seeds and three-way verdicts (kbackend.study.verdicts): None = ``seeds`` (no
    # seed is added); ``seed_budget``: seconds of added seeds and frontier runs at most, counted
    # by the runs' own recorded wall times (so a resumed study decides alike); None = half the
    # recorded time of the grid's runs (what keeps a study within 1.5x), 0 = no limit.
    max_seeds: int | None = field(default=None, metadata=declared((int, type(None))))
    seed_budget: float | None = field(default=None, metadata=declared(
        (int, float, type(None)), low=0, finite=True))
    margin: float = field(default=DEFAULT_MARGIN, metadata=declared((int, float), low=0,
                                                                    finite=True))
    accuracy_margin: float = field(default=DEFAULT_ACCURACY_MARGIN, metadata=declared(
        (int, float), low=0, high=1, open_high=True))
    frontier_epochs: int = field(default=0, metadata=declared(
        int, low=0, high=MAX_EPOCHS, why="0: no frontier runs",
        shown="--frontier-epochs (frontier_epochs)"))
    executor: str = field(default=LOCAL_EXECUTOR, metadata=declared(str))
    workers: int = field(default=0, metadata=declared(int, low=0, why="0: one per core"))
    cell_cpus: float = field(default=1.0, metadata=declared((int, float), low=0, open_low=True,
                                                            finite=True))
    cell_gpus: float | None = field(default=None, metadata=declared(
        (int, float, type(None)), low=0, finite=True))
    # How the auto cell's learning rate (its rate at MIN) follows its batch: the identity holds
    # it only for a study with an auto cell.
    lr_scaling: str = field(default="sqrt", metadata=LR_SCALING)
    # A step-time curve measured on another device for this model (``device_profile``): the
    # report adds each cell's time to target predicted there. It only re-models time: outside
    # the identity, so a resumed study with another profile trains nothing.
    device_profile: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.device_profile, os.PathLike):
            object.__setattr__(self, "device_profile", os.fspath(self.device_profile))
        check_declared(self)
        if self.image_size is not None:
            check_image_size(self.image_size)
        if self.device_profile is not None and (not isinstance(self.device_profile, str)
                                                or not self.device_profile.strip()):
            raise ConfigError(f"Invalid device_profile {self.device_profile!r}: expected the "
                              "path of a JSON step-time curve.")
        self._check_executor()
        self._check_optimizers()
        if self.batch_sizes is not None:
            self._check_batch_sizes()
        self._check_auto()
        self._check_learning_rates()
        self._check_verdicts()
        if self.noise_small_batch and self.noise_big_batch and \
                self.noise_small_batch >= self.noise_big_batch:
            raise ConfigError(
                f"Invalid noise batch sizes: the small batch ({self.noise_small_batch}) must be "
                f"smaller than the big one ({self.noise_big_batch})."
            )

    def _check_optimizers(self) -> None:
        """At least one optimizer, each known, none twice."""
        if not self.optimizers:
            raise ConfigError("Empty optimizer list: expected at least one of "
                              f"{list(OPTIMIZERS)}.")
        for name in self.optimizers:
            if name not in OPTIMIZERS:
                raise ConfigError(
                    f"Unknown optimizer. Expected one of {list(OPTIMIZERS)}. Received: {name!r}."
                )
        if len(set(self.optimizers)) != len(self.optimizers):
            raise ConfigError(f"Duplicate optimizers in {list(self.optimizers)}.")

    def _check_batch_sizes(self) -> None:
        """An explicit grid: at least one size, each a positive integer or one ``"auto"``."""
        sizes = self.batch_sizes or ()
        if len(sizes) == 0:
            raise ConfigError(
                "Empty batch-size list: expected at least one batch size, e.g. 8,32,128 "
                "(or leave it out for powers of two that fit the data)."
            )
        for size in sizes:
            if size != AUTO and (not isinstance(size, int) or isinstance(size, bool)
                                 or size < 1):
                raise ConfigError(f"Invalid batch size {size!r}: expected a positive integer "
                                  "or 'auto'.")
        if sizes.count(AUTO) > 1:
            raise ConfigError(f"Invalid batch sizes {list(sizes)}: 'auto' at most "
                              "once (it adds one adaptive cell per optimizer).")
        if len(set(sizes)) != len(sizes):
            raise ConfigError(f"Duplicate batch sizes in {list(sizes)}.")

    def _check_learning_rates(self) -> None:
        """Explicit grids only for the study's optimizers, each non-empty, each rate valid."""
        for name, rates in self.learning_rates.items():
            if name not in self.optimizers:
                raise ConfigError(
                    f"Learning rates given for {name!r}, which is not in the study's optimizers "
                    f"{list(self.optimizers)}."
                )
            if not rates:
                raise ConfigError(f"Empty learning-rate list for {name!r}.")
            for rate in rates:
                OptimizerSpec(name, rate)  # raises for a rate that is not finite and > 0

    def _check_auto(self) -> None:
        """``"auto"`` in the batch sizes: one adaptive cell per optimizer, bounded by the fixed
        sizes (so at least two are needed), trained on the native engine (one run at a time, or
        one Ray task per optimizer)."""
        if not self.adaptive:
            return
        fixed = self.fixed_batch_sizes or ()
        if len(fixed) < 2:
            raise ConfigError(f"Invalid batch sizes {list(self.batch_sizes or ())}: the auto cell "
                              "grows between the study's smallest and largest fixed batch size; "
                              "give at least two, e.g. 32,128,512,auto.")
        low, high = min(fixed), max(fixed)
        if not (is_power_of_two(low) and is_power_of_two(high)) or low < 2:
            raise ConfigError(f"Invalid batch sizes {list(self.batch_sizes or ())}: the auto "
                              f"cell's bounds (the smallest and largest fixed size, {low} and "
                              f"{high}) must be powers of two of at least 2.")
        if not engine_facts(self.engine).compiled_cells:
            raise ConfigError(f"Batch size 'auto' needs the native engine (the adaptive batch "
                              f"size runs on it); this study's engine is {self.engine!r}: pass "
                              "--engine native or drop 'auto'.")

    @property
    def auto_bounds(self) -> AutoBatchSize | None:
        """The auto cell's bounds (the smallest and largest fixed size), None without one."""
        fixed = self.fixed_batch_sizes
        if not self.adaptive or not fixed:
            return None
        return AutoBatchSize(min(fixed), max(fixed))

    @property
    def adaptive(self) -> bool:
        """Whether the study has an auto (adaptive batch size) cell per optimizer."""
        return self.batch_sizes is not None and AUTO in self.batch_sizes

    @property
    def fixed_batch_sizes(self) -> tuple[int, ...] | None:
        """The explicit fixed batch sizes (without ``"auto"``), None for the default grid."""
        if self.batch_sizes is None:
            return None
        return tuple(s for s in self.batch_sizes if isinstance(s, int))

    def _check_verdicts(self) -> None:
        """Added seeds: at most ``max_seeds``, never fewer than ``seeds``."""
        if self.max_seeds is not None and self.max_seeds < self.seeds:
            raise ConfigError(f"Invalid --max-seeds {self.max_seeds!r}: expected at least "
                              f"--seeds ({self.seeds}).")

    def check_frontier_steps(self, num_train: int, batch_sizes: tuple[int, ...]) -> None:
        """The frontier runs' budget (``frontier_epochs`` epochs at the smallest batch size) in
        steps stays within the optimizer's int32 step count; checked once the data is known."""
        if not self.frontier_epochs or not batch_sizes:
            return
        steps = self.frontier_epochs * max(1, num_train // min(batch_sizes))
        if steps > MAX_STEPS:
            raise ConfigError(f"Invalid --frontier-epochs (frontier_epochs) "
                              f"{self.frontier_epochs:,}: {steps:,} steps at batch size "
                              f"{min(batch_sizes)}, more than {MAX_STEPS:,} (the optimizer's "
                              "int32 step count).")

    def _check_executor(self) -> None:
        """local, ray or ray:ADDRESS; ``workers`` only for a Ray instance started here; a cell's
        GPUs a fraction (cells that share one) or whole GPUs."""
        kind, _, address = self.executor.partition(":")
        if kind not in (LOCAL_EXECUTOR, RAY_EXECUTOR) or (kind == LOCAL_EXECUTOR and address) \
                or (kind == RAY_EXECUTOR and ":" in self.executor and not address.strip()):
            raise ConfigError(f"Invalid executor: expected local, ray or ray:ADDRESS (e.g. "
                              f"ray:10.0.0.1:6379). Received: {self.executor!r}.")
        if self.workers and self.executor != RAY_EXECUTOR:
            raise ConfigError(f"--workers sizes a Ray instance started here (--executor ray); "
                              f"this study's executor is {self.executor!r}: leave --workers out "
                              "(a cluster's size is its own).")
        gpus = self.cell_gpus
        if gpus is not None and not (gpus <= 1 or float(gpus).is_integer()):
            raise ConfigError(f"Invalid cell_gpus {gpus!r}: expected a fraction in [0, 1] (cells "
                              "that share a GPU) or a whole number of GPUs.")

    @property
    def ray_address(self) -> str | None:
        """The Ray cluster's address of ``executor="ray:ADDRESS"`` (None: start one here)."""
        kind, _, address = self.executor.partition(":")
        return address.strip() or None if kind == RAY_EXECUTOR else None

    @property
    def seed_values(self) -> tuple[int, ...]:
        """The seeds every learning rate of a cell runs with."""
        return tuple(self.seed + index for index in range(self.seeds))

    @property
    def resolved_max_steps(self) -> int:
        """``max_steps``, or the dataset's default budget when it is None."""
        default, _ = DEFAULT_BUDGETS.get(self.dataset, (DEFAULT_MAX_STEPS, 0))
        return default if self.max_steps is None else self.max_steps

    @property
    def resolved_max_epochs(self) -> int:
        """``max_epochs``, or the dataset's default epoch cap when it is None (0: none)."""
        _, default = DEFAULT_BUDGETS.get(self.dataset, (DEFAULT_MAX_STEPS, 0))
        return default if self.max_epochs is None else self.max_epochs

    def step_budget(self, steps_per_epoch: int) -> int:
        """A run's full step budget at a batch size of ``steps_per_epoch`` steps per epoch."""
        if self.resolved_max_epochs:
            return min(self.resolved_max_steps, self.resolved_max_epochs * steps_per_epoch)
        return self.resolved_max_steps

    @property
    def resolved_target(self) -> Target:
        """``target``, else the data source's default (``study.targets.study_target``: the
        user's own data has none, and the one-line error says what a short probe reached)."""
        if self.target is not None:
            return self.target
        return study_target(self.model, self.dataset, None, None, label=self.label,
                            python=True, data_dir=self.data_dir,
                            unsafe_deserialization=self.unsafe_deserialization,
                            validation_fraction=self.validation_fraction)

    def resolved_batch_sizes(self, num_train: int) -> tuple[int, ...]:
        """The grid's batch sizes, sorted, each checked against the training split's size."""
        fixed = self.fixed_batch_sizes
        if fixed is None:
            cap = self.max_batch_size or DEFAULT_MAX_BATCH.get(self.dataset, 0)
            sizes = default_batch_sizes(num_train)
            if cap:
                sizes = tuple(s for s in sizes if s <= cap) or sizes[:1]
            return sizes
        too_big = [s for s in fixed if s > num_train]
        if too_big:
            raise DataError(
                f"Batch sizes {too_big} are larger than the training split ({num_train} samples "
                f"of {self.dataset!r}): use batch sizes of at most {num_train}."
            )
        for size in fixed:
            check_batch_size(size, num_train)
        return tuple(sorted(fixed))

    def learning_rate_grid(self, optimizer: str, batch_size: int) -> tuple[float, ...]:
        """The learning rates tried for one cell, in the order they are tried (centre first)."""
        if optimizer in self.learning_rates:
            return tuple(self.learning_rates[optimizer])
        scale = (batch_size / REFERENCE_BATCH) ** LR_BATCH_EXPONENT
        centre = CENTRE_LR.get(optimizer, 1e-2) * scale
        # Centre, then alternately below and above (0, -1, 1, -2, ...): with pruning the likely
        # winner runs first. An even grid is centred between two points.
        shift = 0.5 if self.lr_grid_size % 2 == 0 else 0
        offsets = [(-1) ** k * ((k + 1) // 2) + shift for k in range(self.lr_grid_size)]
        return tuple(float(f"{centre * self.lr_factor ** o:.4g}") for o in offsets)

    def to_dict(self) -> dict[str, Any]:
        payload = asdict(self)
        payload["target"] = asdict(self.resolved_target)
        payload["max_steps"] = self.resolved_max_steps
        payload["max_epochs"] = self.resolved_max_epochs
        payload["learning_rates"] = {k: list(v) for k, v in sorted(self.learning_rates.items())}
        return payload

    def identity(self) -> dict[str, Any]:
        """What makes two studies the same question, whatever backend or device answers it (what
        the model and data hold is added by ``StudyRunner.content_identity``: names and paths are
        not content)."""
        payload = self.to_dict()
        for name in ("data_dir", "engine", "fused_steps", "jit_compile", "population",
                     "step_time_repeats", "unsafe_deserialization", "device_profile",
                     *EXECUTOR_FIELDS,
                     *VERDICT_FIELDS):
            payload.pop(name)
        if not self.adaptive:  # only an auto cell reads it: other studies keep their identity
            payload.pop("lr_scaling")
        # Unset, these options leave out their names: studies stored before the options keep
        # their identity.
        for name in ("label", "image_size"):
            if payload[name] is None:
                payload.pop(name)
        if not payload["max_epochs"]:
            payload.pop("max_epochs")
        return payload

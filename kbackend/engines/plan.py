"""The plan of one run: every number on the way from ``--batch-size`` to the step, built once.

``kbackend.training.train`` builds a ``TrainPlan`` after the pre-run checks
(``Engine.plan``) and every engine takes it: the global and per-device batch, the devices,
steps per epoch (the engine's rounding), the fused steps asked and as run, the step budget,
the schedule's length (the optimizer spec in the plan has it set, once) and the evaluation
points. Engines read these numbers; none computes them again.

Two things can only be known later, and each is a new plan made from this one, never a second
calculation: ``--fused-steps auto`` (K measured on the model, ``with_fused_steps``) and a K
capped to what a trainer can write out (``with_fused_steps`` again, from ``loop``).

A batch size that grows (``--batch-size auto``, issue 37) hands the loop a new plan at an
evaluation point: ``engines.adaptive.plan_at``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from kbackend.data import batching
from kbackend.optim import OptimizerSpec


@dataclass(frozen=True)
class TrainPlan:
    """How many steps a run takes, in which calls, where it evaluates, on how many devices."""

    n_train: int
    batch_size: int  # global: all devices and processes together
    epochs: int
    drops_last_batch: bool  # floor(n / batch) steps per epoch, else ceil (Keras fit)
    steps_per_epoch: int
    fused_steps_asked: int  # as configured; 0 is ``--fused-steps auto``
    fused_steps: int  # K as run: 0 until ``auto`` is measured (the native engine)
    total_steps: int  # epochs x steps_per_epoch, cut by max_steps
    schedule_steps: int  # the optimizer schedule's length: every step the epochs hold
    eval_every: int  # steps between evaluations (steps_per_epoch: once per epoch)
    optimizer: OptimizerSpec  # the configured optimizer, its schedule length set
    devices: int = 1
    processes: int = 1

    @classmethod
    def of(cls, config: Any, n_train: int, *, drops_last_batch: bool = True, devices: int = 1,
           optimizer: OptimizerSpec | None = None) -> TrainPlan:
        """The plan of ``config`` (a ``TrainConfig``) on ``n_train`` samples. ``optimizer``
        replaces ``config.optimizer`` (its schedule length is set here either way). An explicit
        K must fit in one epoch (``batching.check_fused_steps``: a call never spans two)."""
        batch = config.batch_size
        steps = batching.steps_per_epoch(n_train, batch, drops_last=drops_last_batch)
        if config.fused_steps:
            batching.check_fused_steps(config.fused_steps, steps, n_train, batch)
        schedule = steps * config.epochs
        total = min(schedule, config.max_steps) if config.max_steps else schedule
        spec = optimizer if optimizer is not None else config.optimizer
        # The schedule spans the steps this engine really runs; max_steps and targets only
        # stop early.
        return cls(n_train=n_train, batch_size=batch, epochs=config.epochs,
                   drops_last_batch=drops_last_batch, steps_per_epoch=steps,
                   fused_steps_asked=config.fused_steps, fused_steps=config.fused_steps,
                   total_steps=total, schedule_steps=schedule,
                   eval_every=config.eval_every or steps,
                   optimizer=spec.with_total_steps(schedule), devices=max(1, devices),
                   processes=max(1, config.num_processes))

    def with_fused_steps(self, fused_steps: int) -> TrainPlan:
        """This plan run with K = ``fused_steps`` (``auto`` measured, or capped by a trainer);
        ``fused_steps_asked`` keeps what was asked."""
        if fused_steps == self.fused_steps:
            return self
        batching.check_fused_steps(fused_steps, self.steps_per_epoch, self.n_train,
                                   self.batch_size)
        return replace(self, fused_steps=fused_steps)

    @property
    def per_device_batch(self) -> int:
        """Samples each device takes per step (the split was checked by ``check_run``)."""
        return self.batch_size // self.devices

    @property
    def dropped_per_epoch(self) -> int:
        """Samples of each epoch's shuffled order left out (the last partial batch)."""
        if not self.drops_last_batch:
            return 0
        return self.n_train - self.steps_per_epoch * self.batch_size

    def call_lengths(self) -> list[int]:
        """One epoch's fused calls: K steps each, the last shorter when K does not divide."""
        return batching.call_lengths(self.steps_per_epoch, self.fused_steps)

    def crosses_evaluation(self, step_before: int, step: int, origin: int = 0) -> bool:
        """Whether a call from ``step_before`` to ``step`` reaches an evaluation point (a
        multiple of ``eval_every`` steps after ``origin``, where this plan took over) or the
        end of the budget."""
        every = self.eval_every
        return ((step - origin) // every > (step_before - origin) // every
                or step >= self.total_steps)

"""A population of native runs as one program: ``jax.vmap`` over stacked parameters and
optimizer states.

M runs of one cell (same model, optimizer, batch size and K; their own initial values, data
order and learning rate) train in lockstep: one compiled call runs K steps of every member,
each member gathering its own batches from the one device copy of the training split. The
member axis is the leading axis of every state leaf, of the epoch's index matrix ``(M, steps,
B)`` and of the per-step losses ``(M, K)``. A member computes exactly what its run alone
computes; only XLA's batched kernels may round differently (tests/test_population.py states
the tolerance).

Reached through ``kbackend.backends.impl().population_trainer``; the driver is
``kbackend.engines.loop.run_population``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kbackend.backends.jax.native import CompiledCalls, make_evaluator
from kbackend.backends.jax.step import TrainState, fresh_opt_state
from kbackend.errors import InternalError
from kbackend.task import CLASSIFICATION, Task


class PopulationTrainer(CompiledCalls):
    """Runs fused train calls of ``members`` runs of one model at once (vmapped): the epoch's
    index matrices are ``(members, steps, batch)``, a call's losses ``(members, length)``."""

    def __init__(self, model: Any, spec: Any, dataset: Any, members: int,
                 task: Task = CLASSIFICATION) -> None:
        super().__init__(model, spec, dataset, task)
        self.members = members
        self.state: TrainState | None = None
        self.frozen: Any = None  # each member's values where it stopped (see ``freeze``)

    def _run_fn(self, length: int) -> Any:
        """Every member's run (``CompiledCalls._run_fn``) on its own rows, vmapped."""
        return jax.vmap(super()._run_fn(length), in_axes=(0, None, None, 0, None))

    def reset(self, values: list[Any], learning_rates: list[float]) -> None:
        """Start the members' runs: member m from ``values[m]`` (``(trainable,
        non_trainable)``) with a fresh optimizer state at base rate ``learning_rates[m]``."""
        if len(values) != self.members or len(learning_rates) != self.members:
            raise InternalError(f"expected {self.members} members' values and rates, got "
                             f"{len(values)} and {len(learning_rates)}")

        def stacked(part: int) -> list[Any]:
            return [jnp.stack([jnp.asarray(v[part][i]) for v in values])
                    for i in range(len(values[0][part]))]

        trainable, non_trainable = stacked(0), stacked(1)
        opt_state = fresh_opt_state(self.spec, trainable, learning_rates, members=True)
        self.state = TrainState(trainable, non_trainable, opt_state)
        self.frozen = jax.tree.map(jnp.copy, (trainable, non_trainable))

    def freeze(self, members: list[int]) -> None:
        """Keep ``members``' current values as their final ones (``evaluate_test`` uses them):
        a member that stops is not changed by the steps the others still take."""
        chosen = np.zeros(self.members, bool)
        chosen[list(members)] = True
        mask = jnp.asarray(chosen)

        def keep(current: Any, kept: Any) -> Any:
            return jnp.where(mask.reshape((-1,) + (1,) * (current.ndim - 1)), current, kept)

        self.frozen = jax.tree.map(keep, self._values(), self.frozen)

    def _values(self) -> tuple[Any, Any]:
        """The members' current ``(trainable, non_trainable)`` values (``reset`` sets them)."""
        if self.state is None:
            raise InternalError("The population has no members yet: call reset first.")
        return self.state.trainable, self.state.non_trainable

    def _evaluate(self, split: str, values: Any) -> tuple[np.ndarray, np.ndarray]:
        evaluate = make_evaluator(self.model, self.dataset, split, members=True, task=self.task)
        return evaluate(*values)

    def evaluate(self) -> tuple[np.ndarray, np.ndarray]:
        """Every member's validation loss and metric now, shape ``(M,)`` each."""
        return self._evaluate("val", self._values())

    def evaluate_test(self) -> tuple[np.ndarray, np.ndarray]:
        """Every member's test loss and metric on its frozen values (``freeze``), ``(M,)``."""
        return self._evaluate("test", self.frozen)

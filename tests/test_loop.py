"""The one epoch loop: a single run and a population run the same loop (backend-free).

Scripted trainers stand in for the compiled ones: member m's loss at step s is
``1 / (s + m + 1)`` (NaN from its ``nan_from`` step on), and its validation accuracy at its
e-th evaluation is ``0.1 * e * (m + 1)``, so targets, divergence and censoring fall on steps
these tests know.
"""

from __future__ import annotations

import numpy as np
import pytest

from kbackend.config import Target, TrainConfig
from kbackend.engines import loop
from kbackend.engines.plan import TrainPlan
from kbackend.errors import ConfigError
from kbackend.history import RunRecord

NEVER = 10**9


class ScriptedPopulation:
    """A population trainer (losses ``(M, K)``, per-member evaluations, ``freeze``)."""

    def __init__(self, nan_from: list[int]) -> None:
        self.nan_from = nan_from
        self.steps_run = 0
        self.evaluations = 0
        self.frozen: list[int] = []
        self.trace_counts: dict[int, int] = {}
        self.unroll = False

    def put_epoch(self, rows):
        return rows

    def compile(self, length, epoch_rows):
        if length in self.trace_counts:
            return 0.0
        self.trace_counts[length] = 1
        return 0.0

    def run(self, epoch_rows, start, length):
        steps = np.arange(self.steps_run + 1, self.steps_run + length + 1)
        self.steps_run += length
        return np.stack([np.where(steps >= nan, np.nan, 1.0 / (steps + m + 1))
                         for m, nan in enumerate(self.nan_from)])

    def fetch(self, losses):
        return losses

    def evaluate(self):
        self.evaluations += 1
        members = np.arange(len(self.nan_from))
        return 1.0 / (self.evaluations + members), 0.1 * self.evaluations * (members + 1)

    def evaluate_test(self):
        members = len(self.nan_from)
        return np.ones(members), np.full(members, 0.5)

    def freeze(self, members):
        self.frozen.extend(members)


class ScriptedSingle(ScriptedPopulation):
    """The same script as a single run's trainer (losses ``(K,)``, scalar evaluations)."""

    def __init__(self, nan_from: int = NEVER) -> None:
        super().__init__([nan_from])
        self.run_record = RunRecord(unrolled_loop=False)

    def run(self, epoch_rows, start, length):
        return super().run(epoch_rows, start, length)[0]

    def evaluate(self):
        loss, metric = super().evaluate()
        return float(loss[0]), float(metric[0])

    def snapshot(self):
        return self.evaluations

    def restore(self, snapshot):
        self.restored = snapshot

    def finish(self):
        pass


def config(**options) -> TrainConfig:
    return TrainConfig(engine="native", batch_size=4, **{"epochs": 3, "fused_steps": 3,
                                                         "eval_every": 5, **options})


def same_run(a, b) -> None:
    assert a.step == b.step
    np.testing.assert_allclose(a.loss, b.loss, rtol=1e-12)
    strip = [{k: v for k, v in e.items() if k != "train_time"} for e in a.evals]
    assert strip == [{k: v for k, v in e.items() if k != "train_time"} for e in b.evals]
    keep = ("fused_steps", "steps_per_epoch", "eval_every", "dropped_per_epoch", "epochs_run",
            "trace_counts", "diverged")
    assert {k: getattr(a.record, k) for k in keep} == {k: getattr(b.record, k) for k in keep}
    assert (a.record.target_reached or {}).get("step") == (b.record.target_reached or {}).get(
        "step")
    assert a.stopped_early == b.stopped_early


@pytest.mark.parametrize("options", [
    {},  # the whole budget
    {"target": Target("val_accuracy", 0.3)},  # reached at the third evaluation
    {"max_steps": 20},
    {"eval_every": 0, "fused_steps": 4},
])
def test_a_single_run_is_a_population_of_one(options):
    run_config = config(**options)
    plan = TrainPlan.of(run_config, n_train=82)  # 20 steps per epoch, 2 samples dropped
    single = loop.run(ScriptedSingle(), plan, run_config)
    (member,) = loop.run_population(ScriptedPopulation([NEVER]), plan, [run_config])
    same_run(single, member)
    assert single.timing.keys() >= {"train_time", "eval_time", "compile_time"}


def test_a_diverged_member_stops_at_the_next_evaluation_and_the_others_go_on():
    run_config = config()
    plan = TrainPlan.of(run_config, n_train=80)
    trainer = ScriptedPopulation([NEVER, 2])
    healthy, diverged = loop.run_population(trainer, plan, [run_config, run_config])
    assert diverged.record.diverged == {"step": 2, "loss": "nan", "seen_in": "train_loss"}
    assert diverged.steps_run == 6 and diverged.evals == []  # the first call passing 5
    assert healthy.steps_run == 60 and healthy.record.diverged is None
    assert trainer.frozen == [1, 0]


def test_with_no_healthy_member_left_the_loop_stops_one_call_after_the_diverging_call():
    run_config = config()
    plan = TrainPlan.of(run_config, n_train=80)
    trainer = ScriptedPopulation([2, 2])
    histories = loop.run_population(trainer, plan, [run_config, run_config])
    single_trainer = ScriptedSingle(nan_from=2)
    single = loop.run(single_trainer, plan, run_config)
    assert trainer.steps_run == single_trainer.steps_run == 6  # the call of step 2, one more
    same_run(histories[0], single)  # member 0's script is the single run's
    assert histories[1].step == single.step
    assert histories[1].record.diverged == single.record.diverged


@pytest.mark.parametrize(("crossing", "steps"), [("mean2", [20, 15]), ("first", [20, 12])])
def test_members_stop_at_their_own_targets_and_censoring(crossing, steps):
    run_config = config(target=Target("val_accuracy", 0.35, crossing=crossing))
    plan = TrainPlan.of(run_config, n_train=80)

    def censor(step, histories, active):
        return [m for m in active if m == 2]  # at the first evaluation (step 6)

    histories = loop.run_population(ScriptedPopulation([NEVER] * 3), plan, [run_config] * 3,
                                    censor)
    # Evaluations at steps 6, 12, 15, 20 (calls of 3, the first passing each multiple of 5);
    # accuracy 0.1 e (m + 1): member 1 passes 0.35 at its 2nd evaluation (0.4), and the mean of
    # its last two evaluations at its 3rd ((0.4 + 0.6) / 2); member 0 at its 4th by either rule.
    assert [h.record.target_reached["step"] for h in histories[:2]] == steps
    assert histories[2].record.censored_at == 6 and histories[2].record.target_reached is None
    assert [h.stopped_early for h in histories] == [True, True, False]


def test_a_population_refuses_single_run_features():
    with pytest.raises(ConfigError, match="neither early stopping nor the hardware monitor"):
        loop.run_population(ScriptedPopulation([NEVER]), TrainPlan.of(config(), 80),
                            [config(early_stopping=2)])

"""The adaptive batch size's backend-free maths (kbackend/adaptive.py): the online noise scale on
a quadratic problem with known gradient noise, the growth policy (table-driven), the learning-rate
rules and the ``auto[:MIN:MAX]`` parsing with its one-line errors."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kbackend.adaptive import (
    AutoBatchSize,
    BatchBounds,
    BatchChange,
    GrowthPolicy,
    NoiseScale,
    adascale_gain,
    check_lr_scaling,
    micro_batches_for,
    next_power_of_two,
    parse_batch_size,
    scaled_learning_rate,
    step_estimates,
    target_batch_size,
)
from kbackend.errors import ConfigError


# -- the estimator on a quadratic problem --------------------------------------------------
class Quadratic:
    """Per-example loss 0.5 |w - c_i|^2 with c_i ~ N(mu, diag(s^2)) drawn afresh (an infinite
    population): the per-example gradient is w - c_i, so |G|^2 = |w - mu|^2 and
    tr(Sigma) = sum(s^2) exactly, and B_simple = sum(s^2) / |w - mu|^2."""

    def __init__(self, rng: np.random.Generator, dim: int, b_simple: float) -> None:
        self.rng, self.dim = rng, dim
        self.scales = rng.uniform(0.5, 2.0, size=dim)
        self.trace_sigma = float(np.sum(self.scales ** 2))
        direction = rng.normal(size=dim)
        # Place w so that |w - mu|^2 gives the requested noise scale.
        self.offset = direction / np.linalg.norm(direction) * math.sqrt(self.trace_sigma / b_simple)
        self.grad_sq = float(self.offset @ self.offset)

    def step_norms(self, batch: int, micro_batches: int) -> tuple[np.ndarray, float]:
        """One step's micro-batch squared norms (M,) and the squared norm of their mean."""
        gradients = self.offset - self.rng.normal(size=(batch, self.dim)) * self.scales
        micro = gradients.reshape(micro_batches, batch // micro_batches, self.dim).mean(axis=1)
        return np.sum(micro ** 2, axis=1), float(np.sum(micro.mean(axis=0) ** 2))


@pytest.mark.parametrize(("true_b_simple", "batch", "micro_batches"),
                         [(50.0, 32, 4), (400.0, 64, 4), (20.0, 128, 8), (1000.0, 256, 2)])
def test_online_estimate_recovers_a_known_noise_scale(true_b_simple, batch, micro_batches):
    """After 3,000 steps with a 0.999 decay (an effective window of ~1,000 steps), the smoothed
    |G|^2, tr(Sigma) and B_simple are within 25 % of the truth. Measured over seeds 0-19 of
    each case: median error 0.4-4.7 %, largest 12.5 % (B_simple 400 at batch 64, where |G|^2 is
    smallest against the noise); the seeds used here give at most 19 %."""
    problem = Quadratic(np.random.default_rng(int(true_b_simple)), 20, true_b_simple)
    noise = NoiseScale(decay=0.999)
    for _ in range(3000):
        micro, big = problem.step_norms(batch, micro_batches)
        noise = noise.update(micro, big, batch // micro_batches, batch)
    assert noise.steps == 3000
    assert noise.trace_sigma == pytest.approx(problem.trace_sigma, rel=0.25)
    assert noise.grad_sq == pytest.approx(problem.grad_sq, rel=0.25)
    assert noise.b_simple == pytest.approx(true_b_simple, rel=0.25)


def test_default_decay_tracks_the_noise_scale_within_a_factor_of_two():
    """The default decay (0.95, ~20 steps) is noisy but unbiased enough for a power-of-two
    policy: over 200 checkpoints the median estimate is within 20 % of the truth and 90 % of
    them lie within a factor of two (the policy's resolution)."""
    problem = Quadratic(np.random.default_rng(7), 20, 100.0)
    noise, estimates = NoiseScale(), []
    for step in range(4000):
        noise = noise.update(*problem.step_norms(64, 4), 16, 64)
        if step % 20 == 19:
            estimates.append(noise.b_simple)
    ratios = np.asarray(estimates) / 100.0
    assert np.median(ratios) == pytest.approx(1.0, rel=0.2)
    assert np.mean((ratios > 0.5) & (ratios < 2.0)) >= 0.9


def test_exact_expectations_give_exact_estimates():
    grad_sq, trace_sigma, small, big = 2.0, 300.0, 8, 32
    g, s = step_estimates(grad_sq + trace_sigma / small, grad_sq + trace_sigma / big, small, big)
    assert g == pytest.approx(grad_sq, rel=1e-12) and s == pytest.approx(trace_sigma, rel=1e-12)


def test_fused_steps_fold_in_like_single_steps():
    rng = np.random.default_rng(0)
    micro, big = rng.uniform(1, 2, size=(7, 4)), rng.uniform(0.5, 1, size=7)
    one_by_one = NoiseScale()
    for row, value in zip(micro, big, strict=True):
        one_by_one = one_by_one.update(row, value, 8, 32)
    at_once = NoiseScale().update_steps(micro, big, 8, 32)
    assert at_once == one_by_one and at_once.steps == 7
    # The (K,) form (means per step) gives the same state as the (K, M) form.
    assert NoiseScale().update_steps(micro.mean(axis=1), big, 8, 32).b_simple == pytest.approx(
        at_once.b_simple, rel=1e-12)


def test_estimate_states_before_and_without_signal():
    empty = NoiseScale()
    assert math.isnan(empty.b_simple) and math.isnan(empty.grad_sq)
    # |G_B|^2 above |G_b|^2 by more than the noise allows: |G|^2 > 0, tr(Sigma) < 0.
    # The reverse with a tiny |G_B|^2: the |G|^2 estimate is negative, B_simple infinite.
    no_signal = empty.update([1.0, 1.0], 0.0, 8, 16)
    assert no_signal.grad_sq < 0 and math.isinf(no_signal.b_simple)
    assert empty.update([1.0], math.nan, 8, 16) == empty  # a diverged step is skipped


@pytest.mark.parametrize("decay", [-0.1, 1.0, 1.5])
def test_bad_decay_is_a_config_error(decay):
    with pytest.raises(ConfigError):
        NoiseScale(decay=decay)


@pytest.mark.parametrize(("micro", "batch"), [(8, 8), (16, 8), (0, 8)])
def test_bad_micro_batch_sizes_are_config_errors(micro, batch):
    with pytest.raises(ConfigError):
        step_estimates(1.0, 1.0, micro, batch)


# -- the growth policy ---------------------------------------------------------------------
def _noise_with(b_simple: float, steps: int) -> NoiseScale:
    """A state whose smoothed estimates give ``b_simple`` after ``steps`` steps."""
    return NoiseScale(grad_sq_sum=1.0, trace_sigma_sum=b_simple, steps=steps)


BOUNDS = BatchBounds(8, 256)


@pytest.mark.parametrize(
    ("current", "b_simple", "steps", "interval", "last_change", "expected"),
    [
        (8, 3.0, 50, 1, None, 8),        # below MIN: stays at MIN
        (8, 8.0, 50, 1, None, 8),        # exactly a power of two: that size
        (8, 9.0, 50, 1, None, 16),       # the power of two at or above
        (8, 100.0, 50, 1, None, 128),    # jumps straight to the target
        (8, 5000.0, 50, 1, None, 256),   # capped at MAX
        (64, 20.0, 50, 3, 1, 64),        # never shrinks
        (16, 100.0, 50, 2, 2, 16),       # one change per interval: this one changed already
        (16, 100.0, 50, 3, 2, 128),      # the next interval may change again
        (8, 100.0, 9, 1, None, 8),       # not warm yet (warmup 10 steps)
        (8, math.inf, 50, 1, None, 8),   # |G|^2 not yet positive: hold
        (8, math.nan, 0, 1, None, 8),    # no estimate: hold
        (256, 9000.0, 50, 5, 1, 256),    # at MAX already
    ])
def test_growth_policy(current, b_simple, steps, interval, last_change, expected):
    noise = _noise_with(b_simple, steps) if math.isfinite(b_simple) else NoiseScale(
        grad_sq_sum=-1.0 if math.isinf(b_simple) else 0.0, trace_sigma_sum=1.0, steps=steps)
    policy = GrowthPolicy(BOUNDS, warmup_steps=10)
    assert policy.decide(current, noise, interval, last_change) == expected


def test_a_run_of_decisions_grows_monotonically_in_powers_of_two_within_bounds():
    rng = np.random.default_rng(3)
    policy, current, last_change, sizes = GrowthPolicy(BatchBounds(16, 512)), 16, None, [16]
    for interval, b_simple in enumerate(rng.lognormal(4.0, 1.5, size=200)):
        chosen = policy.decide(current, _noise_with(float(b_simple), 100), interval, last_change)
        if chosen != current:
            last_change, current = interval, chosen
        sizes.append(current)
    assert sizes == sorted(sizes)
    assert all(16 <= s <= 512 and s & (s - 1) == 0 for s in sizes)
    assert len(set(sizes)) <= len(BatchBounds(16, 512).sizes())


@pytest.mark.parametrize(("value", "expected"),
                         [(0.3, 1), (1, 1), (1.5, 2), (2, 2), (3, 4), (64, 64), (65, 128)])
def test_next_power_of_two(value, expected):
    assert next_power_of_two(value) == expected


def test_bounds_list_each_compiled_size_once():
    assert BatchBounds(8, 128).sizes() == [8, 16, 32, 64, 128]
    assert BatchBounds(32, 32).sizes() == [32]
    assert target_batch_size(math.nan, BatchBounds(8, 128)) is None


# -- learning-rate scaling -----------------------------------------------------------------
@pytest.mark.parametrize(("scaling", "batch", "expected"),
                         [("linear", 64, 0.8), ("sqrt", 128, 0.4), ("none", 64, 0.1),
                          ("linear", 8, 0.1), ("sqrt", 32, 0.2)])
def test_learning_rate_rules(scaling, batch, expected):
    assert scaled_learning_rate(0.1, batch, 8, scaling) == pytest.approx(expected)


def test_adascale_gain_follows_the_noise():
    # Pure noise (|G|^2 = 0): the gain is the full scale S, like linear scaling.
    assert adascale_gain(0.0, 100.0, 64, 8) == pytest.approx(8.0)
    # No noise: a larger batch gains nothing.
    assert adascale_gain(1.0, 0.0, 64, 8) == pytest.approx(1.0)
    # Johnson et al. eq. 3 with s2 = tr(Sigma) / B0 = 4, |G|^2 = 1, S = 8: (4 + 1) / (0.5 + 1).
    assert adascale_gain(1.0, 32.0, 64, 8) == pytest.approx(5.0 / 1.5)
    noise = _noise_with(32.0, 20)  # |G|^2 = 1, tr(Sigma) = 32
    assert scaled_learning_rate(0.1, 64, 8, "adascale", noise) == pytest.approx(0.1 * 5.0 / 1.5)
    assert scaled_learning_rate(0.1, 64, 8, "adascale", NoiseScale()) == 0.1  # no estimate yet
    assert adascale_gain(math.nan, 1.0, 64, 8) == 1.0


def test_unknown_lr_scaling_is_a_one_line_error():
    with pytest.raises(ConfigError, match="Invalid --lr-scaling 'cubic'") as error:
        check_lr_scaling("cubic")
    assert "\n" not in str(error.value)


# -- micro-batches and the change record ---------------------------------------------------
@pytest.mark.parametrize(("batch", "wanted", "expected"),
                         [(8, 4, 4), (16, 4, 4), (2, 4, 2), (6, 4, 2), (1024, 4, 4),
                          (8, 2, 2), (1024, 2, 2)])
def test_micro_batches_for(batch, wanted, expected):
    assert micro_batches_for(batch, wanted) == expected


def test_two_micro_batches_by_default():
    """M backward passes per step: two keep the overhead lowest (docs/adaptive.md)."""
    assert micro_batches_for(64) == 2


@pytest.mark.parametrize("batch", [1, 3])
def test_batches_that_do_not_split_are_config_errors(batch):
    with pytest.raises(ConfigError):
        micro_batches_for(batch)


def test_change_lines():
    assert BatchChange(120, 64, 0.05, 71.4).describe() == (
        "step 120: batch size 64, learning rate 0.05 (B_simple ~ 71)")
    assert "B_simple ~ n/a" in BatchChange(0, 8, 0.01, math.nan).describe()


# -- parsing and bounds --------------------------------------------------------------------
@pytest.mark.parametrize(("text", "expected"), [
    ("32", 32), (32, 32), ("auto", AutoBatchSize()), ("AUTO", AutoBatchSize()),
    ("auto:8:512", AutoBatchSize(8, 512)), ("auto::256", AutoBatchSize(None, 256)),
    ("auto:16:", AutoBatchSize(16, None)), ("auto:64:64", AutoBatchSize(64, 64)),
])
def test_parse_batch_size(text, expected):
    assert parse_batch_size(text) == expected


@pytest.mark.parametrize(("text", "message"), [
    ("auto:512:8", "MIN is above MAX"),
    ("auto:12:64", "powers of two"),
    ("auto:8:100", "powers of two"),
    ("auto:0:64", "positive integer"),
    ("auto:-8:64", "positive integer"),
    ("auto:eight:64", "'eight' is not an integer"),
    ("auto:8.5:64", "is not an integer"),
    ("auto:8", "expected a positive integer, 'auto' or 'auto:MIN:MAX'"),
    ("auto:8:16:32", "expected a positive integer, 'auto' or 'auto:MIN:MAX'"),
    ("big", "expected a positive integer, 'auto' or 'auto:MIN:MAX'"),
    ("0", "expected a positive integer"),
    ("-4", "expected a positive integer"),
])
def test_bad_batch_sizes_are_one_line_errors(text, message):
    with pytest.raises(ConfigError, match=message) as error:
        parse_batch_size(text)
    assert "\n" not in str(error.value)


def test_bounds_resolve_with_the_runs_defaults():
    assert AutoBatchSize().resolved(8, 512) == BatchBounds(8, 512)
    assert AutoBatchSize(32, None).resolved(8, 16) == BatchBounds(32, 32)  # knee below MIN
    assert AutoBatchSize(None, 4).resolved(8, 512) == BatchBounds(4, 4)
    assert AutoBatchSize(16, 64).resolved(8, 512) == BatchBounds(16, 64)
    assert str(AutoBatchSize(16, 64)) == "auto:16:64" and str(AutoBatchSize()) == "auto"


# -- MAX: the knee probe -------------------------------------------------------------------
class _EverFasterTrainer:
    """A trainer whose steps take the same time at every batch size: throughput doubles with
    each doubling, so the probe only stops where a batch no longer fits the training split."""

    def __init__(self) -> None:
        self.state, self.sizes, self.now = "weights", [], 0.0

    def clock(self) -> float:  # the probe's clock: seconds charged by ``run``
        return self.now

    def state_copy(self):
        return self.state

    def restore_state(self, saved) -> None:
        self.state = saved

    def put_epoch(self, order):
        self.sizes.append(order.shape[1])
        self.state = "changed by the probe"
        return order

    def compile(self, length, rows) -> None:
        pass

    def run(self, rows, start, length):
        self.now += 0.002 * length  # the same time per step at every size

    def fetch(self, pending) -> None:
        pass

    def take_noise_norms(self) -> None:
        pass


def test_the_knee_probe_stops_at_the_data_bound_and_restores_the_state():
    """Throughput that never levels off: the probe times up to the data bound (40960 / 32 ->
    1024; 1294 / 32 -> 32), or the training split where that is below one doubling (20 samples
    at MIN 8: 16), and puts the trainer's state back."""
    from kbackend.engines.adaptive import knee_bound, probe_knee

    trainer = _EverFasterTrainer()
    probe = probe_knee(trainer, n_train=40960, minimum=8, fused_steps=4, clock=trainer.clock)
    assert probe["sizes"] == [8, 16, 32, 64, 128, 256, 512, 1024]  # 2048 > 40960 / 32
    assert sorted(set(trainer.sizes)) == probe["sizes"] and trainer.state == "weights"
    assert probe["knee"] == 1024 and probe["resolved"] and not probe["plateau_reached"]
    assert knee_bound(probe, 40960, 8)[:2] == (1024, "data")
    for n_train, sizes in ((1294, [8, 16, 32]), (20, [8, 16])):
        other = _EverFasterTrainer()
        probe = probe_knee(other, n_train=n_train, minimum=8, fused_steps=2, clock=other.clock)
        assert probe["sizes"] == sizes and probe["knee"] == sizes[-1]


class _OutOfMemoryTrainer(_EverFasterTrainer):
    """``_EverFasterTrainer`` on a device whose memory holds batches up to ``fits`` only."""

    def __init__(self, fits: int) -> None:
        super().__init__()
        self.fits = fits

    def compile(self, length, rows) -> None:
        if rows.shape[1] > self.fits:
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate")


def test_the_knee_probe_stops_at_the_memory_limit():
    """Throughput still growing when 128 runs out of memory: MAX is 64, the largest size that
    fit, recorded as memory-bound; the state is put back. Out of memory at MIN is a one-line
    error; any other error is not taken for a memory limit."""
    from kbackend.engines.adaptive import probe_knee

    trainer = _OutOfMemoryTrainer(fits=64)
    probe = probe_knee(trainer, n_train=40960, minimum=8, fused_steps=4, clock=trainer.clock)
    assert probe["sizes"] == [8, 16, 32, 64] and probe["out_of_memory_at"] == 128
    assert probe["knee"] == 64 and trainer.state == "weights"
    with pytest.raises(ConfigError, match="MIN 8 does not fit in device memory") as error:
        probe_knee(_OutOfMemoryTrainer(fits=4), n_train=1294, minimum=8, fused_steps=4)
    assert "\n" not in str(error.value)

    class Broken(_EverFasterTrainer):
        def compile(self, length, rows) -> None:
            raise RuntimeError("shape mismatch")

    with pytest.raises(RuntimeError, match="shape mismatch"):
        probe_knee(Broken(), n_train=1294, minimum=8, fused_steps=4)

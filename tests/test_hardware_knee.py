"""The one definition of the throughput knee: a table of curves, synthetic curves (hypothesis),
its input checks, and ``kbackend study`` and ``kbackend advise`` naming the same knee."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kbackend.advise.advisor import Advice, recommend_batch_size
from kbackend.errors import ConfigError
from kbackend.hardware.knee import DEFAULT_MIN_GAIN, curve_knee, find_knee
from kbackend.study.analysis import analyze
from kbackend.study.study_record import StudyRecord

MIN_GAIN = DEFAULT_MIN_GAIN
POWERS = [2**k for k in range(3, 11)]  # 8 .. 1024

# (name, batch sizes, samples/s, knee, plateau reached): the definition, one row per case.
CURVES = [
    ("flattens after 128", [8, 32, 128, 512], [110.0, 500.0, 900.0, 1000.0], 128, True),
    # T(b) = b / (b + 64): the doubling 256 -> 512 still gains 11%, 512 -> 1024 only 6%.
    # "80% of the best" (kbackend study's old rule) named 256 here, while advise named 512.
    ("slow saturation", POWERS, [b / (b + 64) for b in POWERS], 512, True),
    ("still rising", [8, 16, 32], [100.0, 200.0, 400.0], 32, False),
    ("flat from the start", [8, 16, 32], [100.0, 101.0, 102.0], 8, True),
    ("first flat doubling wins", [8, 16, 32, 64], [100.0, 190.0, 200.0, 400.0], 16, True),
    ("gain exactly at the threshold counts", [8, 16, 32], [100.0, 110.0, 111.0], 16, True),
    ("one point", [64], [500.0], 64, False),
    ("uneven grid: gains per doubling", [16, 64, 128], [100.0, 121.0, 122.0], 64, True),
]


@pytest.mark.parametrize(("sizes", "throughput", "knee", "plateau"),
                         [c[1:] for c in CURVES], ids=[c[0] for c in CURVES])
def test_knee_definition(sizes, throughput, knee, plateau):
    found = find_knee(sizes, throughput)
    assert (found.batch_size, found.plateau_reached) == (knee, plateau)
    assert found.throughput == throughput[found.index]
    rows = [{"batch_size": b, "samples_per_s": t} for b, t in zip(sizes, throughput, strict=True)]
    assert curve_knee(rows) == found


@pytest.mark.parametrize(("sizes", "throughput", "knee"), [(c[1], c[2], c[3]) for c in CURVES],
                         ids=[c[0] for c in CURVES])
def test_study_and_advise_name_the_same_knee(sizes, throughput, knee):
    """Both commands go from the same measured curve to the batch size they call the knee."""
    runs = [{"config": {"batch_size": b}, "result": {"samples_per_s": t}}
            for b, t in zip(sizes, throughput, strict=True)]  # as summary.json holds them
    study_knee = analyze(StudyRecord.from_json({"cells": [], "runs": runs})).throughput_knee
    advice = Advice("seed_mlp", "digits", "jax", quick=True)
    curve = [{"batch_size": b, "samples_per_s": t, "step_ms": 1000.0 * b / t, "rounds": 1}
             for b, t in zip(sizes, throughput, strict=True)]
    recommend_batch_size(advice, curve)
    advised = [r["value"] for r in advice.recommendations if r["setting"] == "batch_size"]
    assert study_knee == advised[0] == knee


@st.composite
def rise_then_plateau(draw):
    """Powers-of-two batch sizes; every doubling gains >= MIN_GAIN + 0.02 up to ``plateau``, then
    every doubling gains < MIN_GAIN - 0.02 (flat, or a slight drop)."""
    points = draw(st.integers(2, 12))
    plateau = draw(st.integers(0, points - 1))
    first = draw(st.integers(0, 4))
    sizes = [2 ** (first + i) for i in range(points)]
    throughput = [draw(st.floats(1.0, 1e5))]
    for i in range(1, points):
        low, high = (MIN_GAIN + 0.02, 1.0) if i <= plateau else (-0.05, MIN_GAIN - 0.02)
        throughput.append(throughput[-1] * (1.0 + draw(st.floats(low, high))))
    return sizes, throughput, plateau


@settings(max_examples=200, deadline=None)
@given(rise_then_plateau())
def test_knee_is_where_the_plateau_starts(curve):
    sizes, throughput, plateau = curve
    knee = find_knee(sizes, throughput)
    assert knee.index == plateau
    assert knee.batch_size == sizes[plateau]
    assert knee.throughput == throughput[plateau]
    assert knee.plateau_reached == (plateau < len(sizes) - 1)


@settings(max_examples=200, deadline=None)
@given(peak=st.floats(10.0, 1e6), half=st.floats(1.0, 4096.0), points=st.integers(2, 14),
       min_gain=st.floats(0.01, 0.5))
def test_knee_on_saturating_curves(peak, half, points, min_gain):
    """T(b) = peak * b / (b + half): concave and monotone; gains shrink with every doubling."""
    sizes = [2**i for i in range(points)]
    throughput = [peak * b / (b + half) for b in sizes]
    knee = find_knee(sizes, throughput, min_gain)
    assert all(g >= min_gain for g in knee.gains[:knee.index])
    if knee.plateau_reached:
        assert knee.gains[knee.index] < min_gain
    else:
        assert knee.index == points - 1
    # A stricter threshold (larger min_gain) never moves the knee to a larger batch.
    assert find_knee(sizes, throughput, min(0.99, min_gain * 2)).index <= knee.index


def test_uneven_grids_compare_gains_per_doubling():
    # 16 -> 64 is two doublings: x1.21 overall is +10% per doubling, not +21%.
    knee = find_knee([16, 64, 128], [100.0, 121.0, 122.0], min_gain=0.10)
    assert knee.gains[0] == pytest.approx(0.10)
    assert knee.batch_size == 64


@pytest.mark.parametrize("sizes,throughput,match", [
    ([], [], "non-empty"),
    ([8, 16], [1.0], "equally long"),
    ([16, 8], [1.0, 2.0], "increasing"),
    ([8, 16], [1.0, float("nan")], "finite"),
    ([8, 16], [1.0, 0.0], "finite values > 0"),
])
def test_bad_curves_are_one_line_errors(sizes, throughput, match):
    with pytest.raises(ConfigError, match=match):
        find_knee(sizes, throughput)

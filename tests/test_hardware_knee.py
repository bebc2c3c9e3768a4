"""The knee finder on synthetic throughput curves (hypothesis), plus its input checks."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kbackend.errors import ConfigError
from kbackend.hardware.knee import DEFAULT_MIN_GAIN, find_knee

MIN_GAIN = DEFAULT_MIN_GAIN


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

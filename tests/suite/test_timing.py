"""suite.timing: how many steps a point measures, and the interval of its median step."""
from __future__ import annotations

import math

import pytest

from suite import timing
from suite.spec import RunSpec

TINY = {"preset": "tiny-llama"}


def spec(**kw) -> RunSpec:
    return RunSpec(**{"system": "native", "model": TINY, "seq_len": 32, "steps": 5, "timeout_s": 100.0, **kw})


def test_the_median_interval_has_the_coverage_it_states():
    """Order statistics x(j), x(n+1-j) cover the median with 1 - 2 P(Bin(n, 1/2) < j): five values
    give their range at 93.75 %; nine give x(2)..x(8) at 96.1 %, the narrowest reaching 95 %."""
    assert timing.median_interval([5.0, 1.0, 3.0, 2.0, 4.0]) == (1.0, 5.0, 1 - 2 / 32)
    low, high, level = timing.median_interval([float(x) for x in range(1, 10)])
    assert (low, high) == (2.0, 8.0) and level == pytest.approx(1 - 2 * 10 / 512)
    # checked against a simulation: the stated coverage is what the interval achieves
    import random
    rng = random.Random(0)
    hits = sum(lo <= 0 <= hi for lo, hi, _ in (timing.median_interval([rng.gauss(0, 1) for _ in range(9)])
                                                for _ in range(4000)))
    assert abs(hits / 4000 - level) < 0.015


@pytest.mark.parametrize("times, more", [
    ([1.0] * 4, True),                         # fewer than `steps`
    ([1.0, 1.01, 0.99, 1.0, 1.02], False),     # steady: range 3 % of the median
    ([2.0, 1.0, 1.3, 1.0, 1.1], True),         # not steady: more, while the budget allows
    ([1.0, 2.0] * 10, False),                  # the measured-steps limit (4 x steps)
])
def test_a_point_measures_until_its_last_steps_agree(times, more):
    assert timing.wants_more(times, spec(), elapsed_s=0.0) is more


def test_the_time_budget_stops_an_unsteady_point():
    unsteady = [2.0, 1.0, 1.3, 1.0, 1.1]
    assert timing.wants_more(unsteady, spec(), elapsed_s=40.0) is True   # 40 + 2 x 1.1 < 50
    assert timing.wants_more(unsteady, spec(), elapsed_s=48.0) is False  # half the 100 s timeout


def test_a_fixed_count_point_takes_its_steps_and_no_more():
    """A data file, saved weights or the repeated batch fix the run's meaning by their step count; a
    smoke point's timing is never judged, so more steps would only cost time."""
    assert spec(repeat_batch=True).measured_steps_limit == spec(smoke=True).measured_steps_limit == 5
    assert spec().measured_steps_limit == 20 and spec(max_steps=7).measured_steps_limit == 7
    with pytest.raises(ValueError, match="max_steps 9: this point's step count is fixed"):
        spec(repeat_batch=True, max_steps=9)
    with pytest.raises(ValueError, match="max_steps: must be an integer of at least steps"):
        spec(max_steps=3)


def test_the_summary_is_of_the_last_window_and_says_whether_it_steadied():
    rows = [{"step": i + 2, "step_time_s": t} for i, t in enumerate([3.0, 2.0, 1.0, 1.0, 1.01, 0.99, 1.0, 1.0])]
    s = timing.summary(rows, spec())
    assert (s["first_step"], s["last_step"], s["window_steps"], s["measured_steps"]) == (5, 9, 5, 8)
    assert s["steady"] and s["median_s"] == 1.0 and s["interval_s"] == [0.99, 1.01]
    r = {"timing": s, "spec": {"warmup": 1}}
    assert timing.relative_noise(r) == pytest.approx(0.01)
    # a result made before `timing`: from its steps after the warm-up
    old = {"spec": {"warmup": 1}, "steps": [{"step_time_s": t} for t in (9.0, 5.83, 2.91, 2.54)]}
    assert timing.relative_noise(old) == pytest.approx((5.83 - 2.54) / 2 / 2.91)
    assert not math.isnan(timing.relative_noise(old))

"""How many steps a point measures, and how sure its median step is.

A point measures at least `spec.steps` steps after its warm-up, then goes on until the last
`spec.steps` of them agree (their range within `spec.steady_spread` of their median), up to
`spec.max_steps` measured steps and while the point's time budget has room for more (half its
timeout, so that the extra steps never bring a point near its limit). Every step is recorded; the
medians and the spread are of that last window, and a point whose window never steadied says so.

The spread of the median is a distribution-free interval: the order statistics x(j) <= median <=
x(n+1-j) cover the true median with probability 1 - 2 P(Binomial(n, 1/2) < j), so no model of the
noise is assumed and no random resampling makes two readings of one result differ. Of five steps,
the interval is their range at 94 %; `level` says the coverage each interval has.
"""
from __future__ import annotations

import math
import statistics

TARGET_LEVEL = 0.95
# a point extends its steps only while this fraction of its timeout has not gone
BUDGET_FRACTION = 0.5


def _coverage(n: int, j: int) -> float:
    """P(x(j) <= median <= x(n+1-j)) for n samples of a continuous distribution."""
    tail = sum(math.comb(n, k) for k in range(j)) / 2 ** n
    return 1 - 2 * tail


def median_interval(values: list[float]) -> tuple[float, float, float]:
    """(low, high, coverage) of the order-statistic interval of the median: the narrowest whose
    coverage reaches TARGET_LEVEL, or the range (j = 1) where too few values reach it."""
    xs = sorted(values)
    n = len(xs)
    j = 1
    while j + 1 <= (n + 1) // 2 and _coverage(n, j + 1) >= TARGET_LEVEL:
        j += 1
    return xs[j - 1], xs[n - j], _coverage(n, j)


def spread(values: list[float]) -> float | None:
    """The range of `values` over their median (None where the median is not positive)."""
    m = statistics.median(values)
    return (max(values) - min(values)) / m if m > 0 else None


def is_steady(times: list[float], window: int, within: float) -> bool:
    """The last `window` times agree: their range within `within` of their median."""
    if len(times) < window:
        return False
    s = spread(times[-window:])
    return s is not None and s <= within


def wants_more(times: list[float], spec, elapsed_s: float) -> bool:
    """Whether a point that has measured `times` (after its warm-up) takes another step."""
    if len(times) < spec.steps:
        return True
    if len(times) >= spec.measured_steps_limit or is_steady(times, spec.steps, spec.steady_spread):
        return False
    return elapsed_s + 2 * statistics.median(times[-spec.steps:]) < BUDGET_FRACTION * spec.timeout_s


def window(measured: list[dict], spec) -> list[dict]:
    """The steps the medians are of: the last `spec.steps` measured (all, where fewer)."""
    return measured[-spec.steps:]


def summary(measured: list[dict], spec) -> dict | None:
    """The step time's statistics over the window, as a result's `timing` records them."""
    rows = window(measured, spec)
    times = [r["step_time_s"] for r in rows if isinstance(r.get("step_time_s"), (int, float))]
    if not times:
        return None
    low, high, level = median_interval(times)
    return {"measured_steps": len(measured), "window_steps": len(times),
            "first_step": rows[0].get("step"), "last_step": rows[-1].get("step"),
            "median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
            "spread": spread(times), "interval_s": [low, high], "level": level,
            "steady": is_steady(times, spec.steps, spec.steady_spread), "steady_spread": spec.steady_spread}


def relative_noise(result: dict) -> float | None:
    """The half-width of a result's median step interval over the median: how far its median may
    sit from the truth. From `timing` where the result has it; else from its steps after the
    warm-up (results made before `timing` existed, often of 3 steps: a wider, less sure interval)."""
    t = result.get("timing")
    if t and t.get("median_s"):
        low, high = t["interval_s"]
        return (high - low) / 2 / t["median_s"]
    spec = result.get("spec") or {}
    times = [s["step_time_s"] for s in (result.get("steps") or [])[spec.get("warmup", 0):]
             if isinstance(s.get("step_time_s"), (int, float))]
    if len(times) < 2 or statistics.median(times) <= 0:
        return None
    low, high, _ = median_interval(times)
    return (high - low) / 2 / statistics.median(times)

"""The harness's noise model on real runs (suite.timing, suite.compare): the same point measured
twice on this machine is no regression; the same point with a slowdown injected into its system's
step is one, also when the slow run's environment names another machine."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from suite import compare
from suite.runner import run_point
from suite.spec import RunSpec

pytestmark = pytest.mark.slow

SLOWER = 0.25  # the injected sleep over the measured step: the rate falls to 1 / 1.25, by 20 %
WAIT_S = 1.0


def point(**kw) -> RunSpec:
    # the smallest step: its compute (8-15 ms on one thread here) moves between consecutive runs by
    # as much as itself (8 ms in one run, 13 in the next; 11 ms on CI's machine, 5.1% of a 0.2 s
    # wait, was called a regression), and no run's own interval sees that; beside a 1 s wait such
    # a drift is 1-2%, under compare's 5% floor, while the injected 20% stands out of it
    return RunSpec(system="native", model={"preset": "tiny-llama"}, seq_len=16, batch_size=1, grad_accum=1,
                   steps=9, max_steps=18, warmup=2, timeout_s=300.0, **kw)


def slowed(tmp_path: Path, name: str, seconds: float) -> Path:
    """A folder for PYTHONPATH whose sitecustomize makes native's step sleep `seconds` more: the
    injection reaches the worker process without a hook in the product."""
    folder = tmp_path / name
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(
        "import time\nfrom baselines.native import Native\n_step = Native.step\n"
        f"def step(self, microbatches):\n    out = _step(self, microbatches)\n    time.sleep({seconds!r})\n    return out\n"
        "Native.step = step\n")
    return folder


def test_a_rerun_is_no_regression_and_an_injected_slowdown_is_one(tmp_path, monkeypatch):
    """Every run's step waits WAIT_S beside its compute, as a system waiting on a device would: the
    2-core machine's compute alone drifts between consecutive runs by more than the slowdown (the
    first run after the workflow tests 12% slower), which no noise model of one run sees."""
    root = Path(__file__).resolve().parents[2]
    # one OpenMP thread a worker: two, on a 2-core machine that other processes share, spin at their
    # barriers while descheduled, and a 20 ms step of compute took 0.02-1.7 s (the pair's noise 50%,
    # no slowdown seen); one thread is time-sliced at worst, and the steps held 0.22-0.24 s
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("PYTHONPATH", f"{slowed(tmp_path, 'wait', WAIT_S)}:{root}")
    base = run_point(point(), tmp_path / "base" / "p.json")
    again = run_point(point(), tmp_path / "again" / "p.json")
    assert base["status"] == again["status"] == "ok"
    report = compare.compare(tmp_path / "base", tmp_path / "again", metrics=("model_tflops",))
    assert not report["regressed"], compare.render(report)

    extra = SLOWER * again["timing"]["median_s"]
    monkeypatch.setenv("PYTHONPATH", f"{slowed(tmp_path, 'slower', WAIT_S + extra)}:{root}")
    slow = run_point(point(), tmp_path / "slow" / "p.json")
    assert slow["status"] == "ok"
    report = compare.compare(tmp_path / "again", tmp_path / "slow", metrics=("model_tflops",))
    row = report["rows"][0]
    assert row["verdict"] == "worse" and report["regressed"], compare.render(report)

    # the slow run as if made on another machine: judged by its rate over that machine's matmul rate
    path = tmp_path / "slow" / "p.json"
    faked = json.loads(path.read_text())
    # another CPU, cores and memory, with the matmul rate this one measured in the rerun (one reading of
    # a 2-core machine's GEMMs moves by more than the slowdown; the yardstick's use is what is tested)
    faked["env"] |= {"cpu": "Another CPU", "cpu_cores": 64, "host_memory_bytes": 512 * 2 ** 30,
                     "matmul_tflops": again["env"]["matmul_tflops"]}
    path.write_text(json.dumps(faked))
    report = compare.compare(tmp_path / "again", tmp_path / "slow", metrics=("model_tflops",))
    row = report["rows"][0]
    assert row["machine_differs"] and report["regressed"], compare.render(report)
    assert row["verdict"].startswith("code slower per fraction of the matmul rate"), compare.render(report)

"""experiments/probes/step_kernels.py on the CPU (a check of the probe, not a measurement): each depth's
JSON holds the ceiling, a step's layer-pass spans and its kernels by kind; --compare gives the per-layer
table of two depths and refuses one depth twice."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
import pytest

pytestmark = pytest.mark.slow  # minutes on the 2-core machine: `pytest -m "not slow"` leaves them out

ROOT = Path(__file__).resolve().parents[2]


def probe(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "experiments.probes.step_kernels", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


def test_step_kernels_per_layer(tmp_path):
    out = {}
    for layers in (1, 2):
        out[layers] = tmp_path / f"s{layers}.json"
        done = probe("--preset", "tiny-qwen2", "--seq", "32", "--batch", "2", "--device", "cpu",
                     "--layers", str(layers), "--out", str(out[layers]))
        assert done.returncode == 0, done.stderr[-2000:]
        r = json.loads(out[layers].read_text())
        assert r["layers"] == layers and r["ceiling"]["seconds"] > 0
        assert set(r["step"]["layer_pass_spans_s"]) == {"forward", "recompute", "backward"}
        assert min(r["step"]["layer_pass_spans_s"].values()) > 0 and r["step"]["seconds_by_kind"]["matmul"] > 0
    done = probe("--compare", str(out[2]), str(out[1]))
    assert done.returncode == 0 and "layers 1 -> 2, ms a layer" in done.stdout and "spans" in done.stdout, done.stderr
    done = probe("--compare", str(out[1]), str(out[1]))
    assert done.returncode != 0 and "two depths" in done.stderr

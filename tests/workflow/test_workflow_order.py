"""Points ready at once run in the grid's order (CPU, a real Snakemake)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # minutes on the 2-core machine: `pytest -m "not slow"` leaves them out

pytest.importorskip("snakemake")
ROOT = Path(__file__).resolve().parents[2]


def test_points_run_in_the_grids_order_whatever_the_targets_order(tmp_path):
    """One at a time (a GPU host's points are), the point first in the grid runs first: the grids
    list each experiment's cheapest first, so a session cut short has made the most points.
    Left to itself, Snakemake chooses among ready jobs in an order of its own."""
    hw = f"order{tmp_path.name[-6:]}".replace("_", "")
    ids = ["a", "b", "c", "d"]
    grid = tmp_path / "grid.yaml"
    grid.write_text(f"hardware: {hw}\ndefaults: {{seq: 8, batch: 1, accum: 1, steps: 1, warmup: 0, timeout: 60}}\n"
                    "experiments:\n  quick:\n    points:\n"
                    + "".join(f"      - {{id: {i}, system: native, preset: tiny-llama, layers: {n + 1}}}\n"
                              for n, i in enumerate(ids)))
    targets = [f"results/{hw}/points/quick/{i}.json" for i in reversed(ids)]
    try:
        done = subprocess.run([sys.executable, "-m", "snakemake", "--profile", "profiles/cpu", "-c1", *targets,
                               "--config", f"grid={grid}"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                              env={**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"})
        log = done.stdout + done.stderr
        assert done.returncode == 0, log[-3000:]
        started = sorted(ids, key=lambda i: log.index(f"output: results/{hw}/points/quick/{i}.json"))
        assert started == ids
    finally:
        for kind in ("results", "logs", "plots"):
            subprocess.run(["rm", "-rf", str(ROOT / kind / hw)])


@pytest.mark.skipif(Path("/dev/nvidia0").exists(), reason="this machine has an NVIDIA GPU")
def test_a_gpu_grid_runs_no_point_without_a_gpu(tmp_path):
    """A grid with `needs_gpu` on this GPU-less machine: its point's job stops before the harness,
    saying why, and writes no result (the harness would measure the CPU and file it as the GPU's)."""
    hw = f"gpuless{tmp_path.name[-6:]}".replace("_", "")
    grid = tmp_path / "grid.yaml"
    grid.write_text(f"hardware: {hw}\nneeds_gpu: true\ndefaults: {{seq: 8, batch: 1, accum: 1, steps: 1, warmup: 0, "
                    "timeout: 60}\nexperiments:\n  quick:\n    points:\n      - {id: a, system: native, preset: tiny-llama}\n")
    try:
        done = subprocess.run([sys.executable, "-m", "snakemake", "--profile", "profiles/cpu", "-c1",
                               f"results/{hw}/points/quick/a.json", "--config", f"grid={grid}"], cwd=ROOT,
                              capture_output=True, text=True, timeout=300,
                              env={**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"})
        assert done.returncode != 0
        assert f"grid {hw} needs an NVIDIA GPU and this machine has none" in done.stderr
        assert not (ROOT / "results" / hw).exists()
    finally:
        for kind in ("results", "logs", "plots"):
            subprocess.run(["rm", "-rf", str(ROOT / kind / hw)])

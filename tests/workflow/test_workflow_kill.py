"""A killed workflow leaves nothing running and resumes with one command (CPU, a real Snakemake)."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.slow  # minutes on the 2-core machine: `pytest -m "not slow"` leaves them out

pytest.importorskip("snakemake")
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.alone  # its kill must land while the point trains, which another test's load can delay past
def test_a_killed_workflow_stops_its_points_and_resumes(tmp_path):
    """SIGKILL of `snakemake --profile profiles/cpu` while a point trains: the point's harness and worker end
    too (no job tree outlives the workflow); the README's recovery command (unlock, then the same
    command) finishes the point, which the profile's rerun-incomplete redoes."""
    hw = f"killtest{tmp_path.name[-6:]}".replace("_", "")
    grid = tmp_path / "grid.yaml"
    grid.write_text(f"hardware: {hw}\ndefaults: {{seq: 32, batch: 1, accum: 1, steps: 100000, warmup: 0, timeout: 45}}\n"
                    "experiments:\n  slow:\n    points:\n      - {id: p, system: native, preset: tiny-llama}\n")
    target = f"results/{hw}/points/slow/p.json"
    command = [sys.executable, "-m", "snakemake", "--profile", "profiles/cpu", target, "--config", f"grid={grid}"]
    subprocess.run(command + ["--unlock"], cwd=ROOT, check=True, capture_output=True)  # an earlier run's lock
    try:
        flow = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        deadline = time.time() + 90
        workers = []
        while time.time() < deadline and not workers:
            time.sleep(0.5)
            workers = [p for p in psutil.Process(flow.pid).children(recursive=True) if _is_worker(p)]
        assert workers, "the point's worker never started"
        tree = psutil.Process(flow.pid).children(recursive=True)
        flow.send_signal(signal.SIGKILL)
        flow.wait(timeout=30)
        gone, alive = psutil.wait_procs(tree, timeout=15)  # well inside the point's own 45 s limit
        assert not [p for p in alive if _running(p)], "a job outlived the workflow"
        subprocess.run(command + ["--unlock"], cwd=ROOT, check=True, capture_output=True)
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        assert json.loads((ROOT / target).read_text())["status"] == "timeout"  # the redone point ran to its limit
    finally:
        for d in ("results", "logs", "plots"):
            shutil.rmtree(ROOT / d / hw, ignore_errors=True)


def _is_worker(process: psutil.Process) -> bool:
    """A point's worker: the runner's child in a session of its own, forked or not (suite.launch)."""
    try:
        return os.getsid(process.pid) == process.pid and "-m suite run" in " ".join(process.parent().cmdline())
    except (OSError, psutil.Error, AttributeError):  # gone, or a zombie, between listing and asking
        return False


def _running(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


"""A detached workflow run (experiments/workflow_gpu.sh, the GPU machines' route for work longer than
one call) keeps what it writes in its own tree (CPU, a real Snakemake)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # minutes on the 2-core machine: `pytest -m "not slow"` leaves them out

pytest.importorskip("snakemake")
ROOT = Path(__file__).resolve().parents[2]


def workflow_gpu(tmp_path: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """experiments/workflow_gpu.sh in this checkout, its state and pack under `tmp_path`, no wheels."""
    env = {**os.environ, "WORKFLOW_GPU_STATE": str(tmp_path / "state"), "WHEELS": "none", "OUT": str(tmp_path),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", **(env or {})}
    return subprocess.run(["bash", "experiments/workflow_gpu.sh", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=240)


def test_a_detached_run_writes_in_its_own_tree_and_every_pack_holds_it(tmp_path):
    """Each call on a GPU machine first copies the caller's tree there, which removes the files the
    caller lacks: the detached run's results live in its own copy, the caller's tree gets none, an
    attach packs them all and leaves the run's whole log beside the pack, and so does the next
    detached run's first pack; no pack holds a file the run did not write, and a file the last run had
    only copied, which the caller has removed since, does not come back."""
    hw = f"detach{tmp_path.name[-6:]}".replace("_", "")
    grid = tmp_path / "grid.yaml"
    grid.write_text(f"hardware: {hw}\ndefaults: {{seq: 32, batch: 1, accum: 1, steps: 1, warmup: 0, timeout: 60}}\n"
                    "experiments:\n  quick:\n    points:\n      - {id: p, system: native, preset: tiny-llama}\n"
                    "      - {id: q, system: native, preset: tiny-llama, seq: 16}\n"
                    "      - {id: r, system: native, preset: tiny-llama, seq: 8}\n")
    target, other, third = (f"results/{hw}/points/quick/{i}.json" for i in "pqr")

    def call(*args: str) -> str:
        done = workflow_gpu(tmp_path, *args)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        return done.stdout

    own = ROOT / "results" / hw / "README.md"  # the caller's own file, which a pack must not replace
    try:
        own.parent.mkdir(parents=True)
        own.write_text("the caller's\n")
        removed = ROOT / f"results/{hw}/points/quick/removed.json"  # a caller's file it removes later (stale)
        removed.parent.mkdir(parents=True)
        removed.write_text("{}")
        call("--detach", "180", "cpu", f"{target},{other}", "--config", f"grid={grid}")  # a group: one snakemake
        removed.unlink()
        assert not (ROOT / target).exists()  # written in the run's tree only
        assert (tmp_path / "state" / "tree" / target).is_file() and (tmp_path / "state" / "tree" / other).is_file()
        (tmp_path / "workflow.tgz").unlink()
        out = call("--attach", "5", "cpu")
        assert [line.split()[2] for line in out.splitlines() if line.split()[:1] in (["p"], ["q"])] == ["ok", "ok"]
        with tarfile.open(tmp_path / "workflow.tgz") as pack:
            results = [json.load(pack.extractfile(t)) for t in (target, other)]
            assert f"results/{hw}/README.md" not in pack.getnames()
        assert [(r["status"], r["spec"]["seq_len"]) for r in results] == [("ok", 32), ("ok", 16)]
        log = (tmp_path / "detached.log").read_text()  # the whole log beside the pack, each job's start in it
        assert log.count("rule point:") == 2 and target in log and other in log
        # a new detached run (the caller still lacks the first's results, as if its packs were lost):
        # the finished run's results join the new tree, and its pack holds all three
        call("--detach", "180", "cpu", third, "--config", f"grid={grid}")
        with tarfile.open(tmp_path / "workflow.tgz") as pack:
            assert {target, other, third} <= set(pack.getnames())
        # what the last run had only copied does not come back
        assert not (tmp_path / "state" / "tree" / removed.relative_to(ROOT)).exists()
        # and what it had joined goes on to the next run, and into its pack
        call("--detach", "180", "cpu", third, "--config", f"grid={grid}")
        with tarfile.open(tmp_path / "workflow.tgz") as pack:
            assert {target, other, third} <= set(pack.getnames())
    finally:
        pid = tmp_path / "state" / "pid"
        if pid.exists():  # a run past its wait (a slow machine) does not outlive the test
            subprocess.run(["kill", "--", f"-{pid.read_text().strip()}"], capture_output=True)
        for kind in ("results", "logs", "plots"):
            subprocess.run(["rm", "-rf", str(ROOT / kind / hw)])


def test_a_second_detach_leaves_a_running_one_alone(tmp_path):
    """A detached run still going (no exit status yet, its process alive) is not wiped by a new
    --detach: the new one is refused with what to do."""
    state = tmp_path / "state"
    (state / "tree").mkdir(parents=True)
    (state / "log").write_text("the running one's log\n")
    running = subprocess.Popen(["sleep", "60"])
    (state / "pid").write_text(f"{running.pid}\n")
    try:
        done = workflow_gpu(tmp_path, "--detach", "5", "cpu", "results/x.json")
    finally:
        running.kill()
    assert done.returncode == 1 and "--attach to it" in done.stdout
    assert (state / "log").read_text() == "the running one's log\n"


def detached_grid(tmp_path: Path, name: str, points: dict[str, int], targets: str) -> tuple[dict, str]:
    """A grid of tiny native points (id -> seq) under a hardware of its own, its `targets` made by a
    detached run with DEADLINE 600 s (the points' paths {id} in `targets`); returns each point's
    path, whether made, and the run's log. The run's results, logs and plots go afterwards."""
    hw = f"{name}{tmp_path.name[-6:]}".replace("_", "")
    grid = tmp_path / "grid.yaml"
    grid.write_text(f"hardware: {hw}\ndefaults: {{seq: 32, batch: 1, accum: 1, steps: 1, warmup: 0, timeout: 60}}\n"
                    "experiments:\n  quick:\n    points:\n"
                    + "".join(f"      - {{id: {i}, system: native, preset: tiny-llama, seq: {seq}}}\n"
                              for i, seq in points.items()))
    paths = {i: f"results/{hw}/points/quick/{i}.json" for i in points}
    try:
        done = workflow_gpu(tmp_path, "--detach", "180", "cpu", *targets.format(**paths).split(),
                            "--config", f"grid={grid}", env={"DEADLINE": "600"})
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        tree = tmp_path / "state" / "tree"
        return {path: (tree / path).is_file() for path in paths.values()}, (tmp_path / "detached.log").read_text()
    finally:
        pid = tmp_path / "state" / "pid"
        if pid.exists():
            subprocess.run(["kill", "--", f"-{pid.read_text().strip()}"], capture_output=True)
        for kind in ("results", "logs", "plots"):
            subprocess.run(["rm", "-rf", str(ROOT / kind / hw)])


def test_a_detached_run_starts_no_target_that_would_pass_its_deadline(tmp_path):
    """With DEADLINE, a target whose estimate (@SECONDS) would end past it is skipped and named in the
    log, and the targets after it still run where they fit; the table of the point folders names
    the targets without their estimates."""
    made, log = detached_grid(tmp_path, "deadline", {"long": 32, "short": 16}, "{long}@3600 {short}@60")
    (long, long_made), (short, short_made) = made.items()
    assert short_made and not long_made
    assert "skipped, about 3600 s with" in log and f"before the deadline: {long}" in log
    assert (tmp_path / "state" / "targets").read_text().split() == [long, short]


def test_a_group_makes_the_members_that_end_before_the_deadline_in_one_snakemake(tmp_path):
    """Of a group whose members carry their estimates, one snakemake makes those that end by the
    deadline after the members taken before them; the others are skipped and named."""
    # p0 (250 s) and p1 (400 s) pass the 600 s deadline together; p0 and p2 (60 s) fit it
    made, log = detached_grid(tmp_path, "group", {"p0": 16, "p1": 32, "p2": 48}, "{p0}@250,{p1}@400,{p2}@60")
    (p0, p0_made), (p1, p1_made), (p2, p2_made) = made.items()
    assert p0_made and p2_made and not p1_made
    assert log.count("Building DAG of jobs") == 1, log[-3000:]
    assert "skipped, about 400 s with" in log and f"before the deadline: {p1}" in log
    assert (tmp_path / "state" / "targets").read_text().split() == [f"{p0},{p1},{p2}"]

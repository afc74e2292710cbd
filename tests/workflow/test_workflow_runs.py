"""The main job's run folders (workflows/scripts/runs.py): a run measures into a folder of its own
named by machine and commit, is compared with the committed results of its hardware or else its
last run, and becomes the committed results only when promoted."""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from workflows.scripts import outputs, runs

pytestmark = pytest.mark.slow  # a CPU workflow: about a minute on the 2-core machine
pytest.importorskip("snakemake")
ROOT = Path(__file__).resolve().parents[2]


def test_a_run_folder_names_the_hardware_the_commit_and_the_machine(monkeypatch):
    monkeypatch.setenv("MEGATRAIN_GIT_COMMIT", "abcdef0123456789")
    folder = runs.name(ROOT / "profiles" / "cpu")
    assert folder.parent == Path("runs") / "cpu"
    assert re.fullmatch(r"\d{8}T\d{6}-abcdef0(-dirty)?-(cpu|\w+x\d+)-\d+g-\d+c", folder.name), folder.name


@pytest.mark.alone  # its promote writes results/<its hardware>/ into the tree, which the committed tables' check reads
def test_two_runs_of_one_machine_are_no_regression_and_promote_commits_the_second(tmp_path):
    hw = f"runs{os.getpid()}"
    grid = tmp_path / "grid.yaml"
    grid.write_text(f"hardware: {hw}\nsmoke_test: true\n"
                    "defaults: {seq: 32, batch: 2, accum: 1, steps: 5, warmup: 1, timeout: 120}\n"
                    "experiments:\n  one:\n    points:\n      - {id: p, system: native, preset: tiny-llama}\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    folders = [Path("runs") / hw / f"2026010{k}T000000-test-cpu" for k in (1, 2)]
    try:
        # the second run measured by the workflow; the first, earlier by its name, its points again (a
        # baseline the comparison reads the points of; two workflow runs took a minute more)
        done = subprocess.run([sys.executable, "-m", "snakemake", "--profile", "profiles/cpu", "one",
                               "--config", f"grid={grid}", f"run={folders[1]}"], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        assert (ROOT / folders[1] / "points" / "one" / "p.json").exists()
        assert (ROOT / folders[1] / "tables" / "one.md").exists() and (ROOT / folders[1] / "plots" / "one.png").exists()
        assert not (ROOT / "results" / hw).exists(), "a run wrote into the committed results"
        shutil.copytree(ROOT / folders[1] / "points", ROOT / folders[0] / "points")
        first = subprocess.run([sys.executable, "-m", "workflows.scripts.runs", "compare", str(folders[0])], cwd=ROOT,
                               env=env, capture_output=True, text=True, timeout=120)
        assert first.returncode == 0 and "this run is the first baseline" in first.stdout
        second = subprocess.run([sys.executable, "-m", "workflows.scripts.runs", "compare", str(folders[1])], cwd=ROOT,
                                env=env, capture_output=True, text=True, timeout=120)
        assert second.returncode == 0, second.stdout + second.stderr
        assert f"against {folders[0] / 'points'}" in second.stdout
        assert "smoke: not judged" in second.stdout and "no regression" in second.stdout
        assert (ROOT / folders[1] / "compare.txt").exists()
        promoted = subprocess.run([sys.executable, "-m", "workflows.scripts.runs", "promote", str(folders[1])],
                                  cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert promoted.returncode == 0, promoted.stderr
        assert (ROOT / "results" / hw / "points" / "one" / "p.json").read_bytes() == \
            (ROOT / folders[1] / "points" / "one" / "p.json").read_bytes()
        assert (ROOT / "plots" / hw / "one.png").exists()
        record = json.loads((ROOT / "plots" / hw / "one.inputs.json").read_text())
        assert list(record["inputs"]) == [f"results/{hw}/tables/one.csv"]  # where the figure's table now is
        with contextlib.chdir(ROOT):
            assert outputs.stale_record(Path("plots") / hw / "one.inputs.json") == []
    finally:
        for d in (ROOT / "runs" / hw, ROOT / "results" / hw, ROOT / "plots" / hw):
            shutil.rmtree(d, ignore_errors=True)


def test_promote_and_compare_refuse_what_is_no_run(tmp_path, capsys):
    assert runs.main(["promote", str(tmp_path / "nothing")]) == 2
    assert "not a run folder" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert runs.main(["promote", str(tmp_path / "empty")]) == 2
    assert runs.main(["compare", str(tmp_path / "empty")]) == 0
    assert "no point was measured" in capsys.readouterr().out

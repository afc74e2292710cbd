"""A result made before its grid point changed is stale: named by the workflow, marked in the table,
never drawn as the point's value (CPU)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatrain.presets import PRESETS
from suite.__main__ import _options
from suite.spec import RunSpec
from workflows.scripts import grid as gridlib

pytestmark = pytest.mark.slow  # minutes on the 2-core machine: `pytest -m "not slow"` leaves them out

ROOT = Path(__file__).resolve().parents[2]
POINT = {"system": "megatrain", "preset": "tiny-llama", "layers": 2, "seq": 32, "batch": 2, "accum": 1, "steps": 3,
         "warmup": 1, "timeout": 60, "options": {"engine.checkpoint_every": 1, "engine.grad_slabs": 2}}


def _result(point: dict, status: str = "ok", **changes) -> dict:
    """A result as the harness writes it for `point`'s command line (its options nested by the CLI's
    own parse), with `changes` to the spec."""
    layers = {"overrides": {"num_hidden_layers": point["layers"]}} if point.get("layers") else {}
    spec = RunSpec(system=point["system"], model={"preset": point["preset"], **layers}, seq_len=point["seq"],
                   batch_size=point["batch"], grad_accum=point["accum"], steps=point["steps"], warmup=point["warmup"],
                   timeout_s=point["timeout"],
                   options=_options([f"{k}={gridlib._value(v)}" for k, v in point["options"].items()]))
    return {"system": point["system"], "status": status, "spec": {**spec.to_dict(), **changes},
            "median": {"model_tflops": 1.5, "step_time_s": 2.0}, "params": 1000}


def test_a_result_stays_its_points_over_other_steps_and_the_presets_own_depth():
    assert gridlib.stale(POINT, _result(POINT)) is None
    assert gridlib.stale(POINT, _result(POINT, steps=5, warmup=2, timeout_s=900.0)) is None
    own = {**POINT, "layers": PRESETS["tiny-llama"]["num_hidden_layers"]}
    assert gridlib.stale(own, _result({**POINT, "layers": None})) is None
    assert gridlib.stale(POINT, _result({**POINT, "options": {**POINT["options"], "ceiling": True}})) is None


@pytest.mark.parametrize("change, message", [
    ({"accum": 4}, 'accum 1 (now 4)'),
    ({"options": {"engine.checkpoint_every": 2, "engine.grad_slabs": 2}}, '"engine.checkpoint_every": 1'),
    ({"options": {}}, "options {"),
    ({"layers": 3}, '"num_hidden_layers": 2'),
    ({"system": "zero3"}, 'system "megatrain" (now "zero3")'),
])
def test_a_result_of_a_point_since_changed_is_stale(change, message):
    why = gridlib.stale({**POINT, **change}, _result(POINT))
    assert why is not None and message in why


def test_a_host_refusal_stands_where_only_options_the_host_admission_does_not_read_changed():
    """FSDP2's `accumulate` moves no host bytes: its host refusals stand when the option is named; its
    measured results, and a refusal whose shape changed, do not."""
    fsdp2 = {**POINT, "system": "fsdp2", "options": {}}
    named = {**fsdp2, "options": {"accumulate": "auto"}}
    assert gridlib.stale(named, _result(fsdp2, "oom_host")) is None
    assert 'options {} (now {"accumulate": "auto"})' in gridlib.stale(named, _result(fsdp2))
    assert "accum" in gridlib.stale({**named, "accum": 2}, _result(fsdp2, "oom_host"))
    megatrain = {**POINT, "options": {**POINT["options"], "engine.grad_slabs": 4}}  # read by its host plan
    assert gridlib.stale(megatrain, _result(POINT, "oom_host")) is not None


def test_the_table_marks_a_stale_result_and_keeps_what_it_measured(tmp_path):
    aggregate = pytest.importorskip("workflows.scripts.aggregate")
    grid = tmp_path / "grid.yaml"
    points = [{k: v for k, v in {**POINT, "id": i}.items() if k not in ("steps", "warmup", "timeout")}
              for i in ("kept", "changed")]
    points[1]["accum"] = 2
    grid.write_text(json.dumps({"hardware": "t", "defaults": {"seq": 32, "batch": 2, "steps": 3, "warmup": 1,
                                                              "timeout": 60},
                                "experiments": {"depth": {"points": points}}}))
    paths = []
    for i in ("kept", "changed"):
        paths.append(tmp_path / f"{i}.json")
        paths[-1].write_text(json.dumps(_result(POINT)))
    df = aggregate.measured(paths, "depth", grid).set_index("id")
    assert df.loc["kept", "status"] == "ok" and df.loc["changed", "status"] == "stale"
    assert "accum 1 (now 2)" in df.loc["changed", "reason"] and "(ok then)" in df.loc["changed", "reason"]
    assert f"--forcerun {paths[1]}" in df.loc["changed", "reason"]
    assert df.loc["changed", "model_tflops"] == 1.5
    plot = pytest.importorskip("workflows.scripts.plot")
    assert plot.no_value_style("stale")[2].startswith("stale")


def test_a_result_that_cannot_be_read_is_named_with_the_way_out(tmp_path):
    aggregate = pytest.importorskip("workflows.scripts.aggregate")
    path = tmp_path / "cut.json"
    path.write_text('{"system": "native"')
    with pytest.raises(ValueError, match=r"cut.json is not a readable result .*: delete it, and the workflow runs"):
        aggregate.measured([path], "depth")


def test_the_workflow_names_a_stale_result_and_keeps_it():
    pytest.importorskip("snakemake")
    hw = f"stale{os.getpid()}"
    grid = ROOT / f".pytest-{hw}.yaml"
    grid.write_text(f"hardware: {hw}\ndefaults: {{seq: 8, batch: 1, accum: 2, steps: 1, warmup: 0, timeout: 60}}\n"
                    "experiments:\n  scale:\n    points:\n      - {id: a, system: native, preset: tiny-llama}\n")
    result = ROOT / f"results/{hw}/points/scale/a.json"
    result.parent.mkdir(parents=True)
    result.write_text(json.dumps(_result({"system": "native", "preset": "tiny-llama", "seq": 8, "batch": 1, "accum": 1,
                                          "steps": 1, "warmup": 0, "timeout": 60, "options": {}})))
    try:
        done = subprocess.run([sys.executable, "-m", "snakemake", "--profile", "profiles/cpu", "-c1", "-n", str(result.relative_to(ROOT)),
                               "--config", f"grid={grid}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
        assert f"stale result, kept: results/{hw}/points/scale/a.json: ran with accum 1 (now 2)" in done.stderr
        assert "Nothing to be done" in done.stdout + done.stderr and result.exists()
    finally:
        grid.unlink(missing_ok=True)
        subprocess.run(["rm", "-rf", str(ROOT / "results" / hw)])


def test_the_grid_lists_its_stale_results_to_run_again(tmp_path, monkeypatch, capsys):
    """`python -m workflows.scripts.grid --stale GRID`: the stale results only, not the ones that are
    the point's run nor the points without a result (what a GPU call removes to run again)."""
    monkeypatch.chdir(tmp_path)
    points = [{k: v for k, v in {**POINT, "id": i}.items() if k not in ("steps", "warmup", "timeout")}
              for i in ("kept", "changed", "absent")]
    points[1]["accum"] = 2
    (tmp_path / "grid.yaml").write_text(json.dumps({
        "hardware": "t", "defaults": {"seq": 32, "batch": 2, "steps": 3, "warmup": 1, "timeout": 60},
        "experiments": {"depth": {"points": points}}}))
    folder = tmp_path / "results/t/points/depth"
    folder.mkdir(parents=True)
    for i in ("kept", "changed"):
        (folder / f"{i}.json").write_text(json.dumps(_result(POINT)))
    assert gridlib.main(["--stale", "grid.yaml"]) == 0
    assert capsys.readouterr().out.split() == ["results/t/points/depth/changed.json"]

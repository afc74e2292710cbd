"""The step model's predictions for a grid not yet run (workflows/scripts/predict.py)."""
import json
from pathlib import Path

import pytest

from workflows.scripts import grid as grids
from workflows.scripts import predict

ROOT = Path(__file__).resolve().parents[2]
GRID = ROOT / "workflows" / "grids" / "h200x8-scale.yaml"


def test_a_grids_points_are_predicted_beside_one_gpu(tmp_path):
    """Every MegaTrain point of the eight-GPU host's grid, in the report and its JSON; a point on
    several GPUs set beside the one-GPU point of its model and batch per GPU (the model's ratio is
    about the GPU count: it leaves the gradient reduction out; each rank returning only its part of
    the gradient, and the device tiles each plan keeps, move the simulated overlap by under 1%), its
    step band the data-parallel runs';
    every point within the host its profile's command states, as the grid was sized."""
    assert predict.main([str(GRID), "h200x8-assumed", "--out", str(tmp_path / "p")]) == 0
    rows = {f"{r['experiment']}/{r['id']}": r for r in json.loads((tmp_path / "p.json").read_text())["points"]}
    megatrain = {f"{e}/{i}" for (e, i), p in grids.points(grids.load(GRID)).items() if p["system"] == "megatrain"}
    assert set(rows) == megatrain
    assert all(f"| {name} |" in (tmp_path / "p.md").read_text() for name in rows)
    for name in ("gpus/7b_g8", "gpus/14b_g4", "largest/32b_L88_g8", "moe/q30b_g8"):
        r = rows[name]
        assert r["vs_one_gpu"] == pytest.approx(r["gpus"], rel=0.01) and r["band_basis"].startswith("ranks>1"), r
    assert rows["gpus/7b_g1"]["vs_one_gpu"] is None and all(r["fits_host"] for r in rows.values())


def test_an_unknown_machine_is_refused_by_name(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        predict.main([str(GRID), "h200x16", "--out", str(tmp_path / "p")])
    assert e.value.code == 2 and "machine 'h200x16': not one of" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_only_the_points_named_and_a_point_not_in_the_grid_refused(tmp_path, capsys):
    out = tmp_path / "p"
    assert predict.main([str(GRID), "h200x8-assumed", "--out", str(out), "--points", "gpus/7b_g8", "moe/q30b_g8"]) == 0
    assert [r["id"] for r in json.loads(out.with_suffix(".json").read_text())["points"]] == ["7b_g8", "q30b_g8"]
    assert predict.main([str(GRID), "h200x8-assumed", "--out", str(tmp_path / "q"), "--points", "gpus/7b_g8_zero3"]) == 2
    assert "gpus/7b_g8_zero3: not a MegaTrain point of h200x8-scale.yaml" in capsys.readouterr().err
    assert not (tmp_path / "q.md").exists()

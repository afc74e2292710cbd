"""The workflow's data and helpers, without running Snakemake: grids against their schema, point
ids unique, command lines well formed, and the aggregation of real harness results."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest

pytest.importorskip("snakemake")
pd = pytest.importorskip("pandas")
from snakemake.utils import validate  # noqa: E402

from suite.spec import RunSpec  # noqa: E402
from workflows.scripts import aggregate, grid  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
GRIDS = sorted((ROOT / "workflows" / "grids").glob("*.yaml"))
BASELINES = sorted((ROOT / "results" / "h100" / "baselines").glob("*.json"))


@pytest.mark.parametrize("path", GRIDS, ids=lambda p: p.stem)
def test_grid_is_valid_and_ids_unique(path):
    g = grid.load(path)
    validate(g, str(grid.SCHEMA))
    grid.check(g)
    assert g["hardware"] == path.stem  # results/<hardware>/ matches the profile's grid
    assert {"scale", "depth", "ablations"} <= set(g["experiments"])


@pytest.mark.parametrize("path", GRIDS, ids=lambda p: p.stem)
def test_every_point_is_a_valid_run_spec(path):
    # The harness rejects a bad spec before it starts a process; catch it here instead.
    for p in grid.points(grid.load(path)).values():
        model = {"preset": p["preset"], **({"overrides": {"num_hidden_layers": p["layers"]}} if p.get("layers") else {})}
        RunSpec(system=p["system"], model=model, seq_len=p["seq"], batch_size=p["batch"], grad_accum=p["accum"],
                steps=p["steps"], warmup=p["warmup"], timeout_s=p["timeout"])
        args = grid.argv(p)
        assert args[:2] == ["--system", p["system"]] and "--out" not in args


def test_duplicate_id_is_rejected():
    g = grid.load(ROOT / "workflows" / "grids" / "cpu.yaml")
    bad = copy.deepcopy(g)
    pts = bad["experiments"]["depth"]["points"]
    pts.append(dict(pts[0]))
    with pytest.raises(ValueError, match="used twice"):
        grid.check(bad)


def test_options_become_lower_case_yaml_scalars():
    p = {"system": "megatrain", "preset": "tiny-llama", "seq": 32, "batch": 1, "accum": 1, "steps": 1,
         "warmup": 0, "timeout": 10, "options": {"engine.offload_checkpoints": True, "engine.checkpoint_every": 2}}
    assert grid.argv(p)[-2:] == ["engine.checkpoint_every=2", "engine.offload_checkpoints=true"]


@pytest.mark.skipif(not BASELINES, reason="no stored H100 baseline results")
def test_aggregate_real_results():
    df = aggregate.table(BASELINES, "scale", paper="figure1_scale")
    ours, paper = df[df["source"] == "measured"], df[df["source"] == "paper"]
    assert list(df.columns[:len(aggregate.MEASURED_COLUMNS)]) == aggregate.MEASURED_COLUMNS
    assert len(ours) == len(BASELINES) and len(paper) == 4
    status = dict(zip(ours["id"], ours["status"]))
    assert status["3b_native_b8"] == "oom_device" and status["7b_fsdp2_b4"] == "oom_host"
    assert status["3b_zero_infinity_b4"] == "timeout" and status["3b_megatrain_b4"] == "ok"
    # A point that did not run has a reason and no throughput; one that ran has both numbers.
    assert ours[ours["status"] != "ok"]["reason"].notna().all()
    assert ours[ours["status"] != "ok"]["model_tflops"].isna().all()
    assert (ours[ours["status"] == "ok"]["model_tflops"] > 0).all()
    # The paper's numbers stay in the paper's columns, never in the measured ones.
    assert paper["model_tflops"].isna().all() and paper["tflops"].notna().sum() == 3
    row = ours.set_index("id").loc["7b_megatrain_b8x2"]
    assert row["params"] == 7615616512 and 10 < row["host_bytes_per_param"] < 20
    md = aggregate.markdown(df, "scale", "h100")
    assert "## Measured (h100)" in md and "## Paper (Figure 1" in md

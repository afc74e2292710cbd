"""The workflow's data and helpers, without running Snakemake: grids against their schema, point
ids unique, command lines well formed, and the aggregation of real harness results."""
from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytest.importorskip("snakemake")
pd = pytest.importorskip("pandas")
from snakemake.utils import validate  # noqa: E402

from suite.spec import RunSpec  # noqa: E402
from workflows.scripts import aggregate, grid  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
GRIDS = sorted((ROOT / "workflows" / "grids").glob("*.yaml"))
BASELINES = sorted((ROOT / "results" / "h100" / "probes" / "baselines").glob("*.json"))


@pytest.mark.parametrize("path", GRIDS, ids=lambda p: p.stem)
def test_grid_is_valid_and_ids_unique(path):
    g = grid.load(path)
    validate(g, str(grid.SCHEMA))
    grid.check(g)
    # <hardware>.yaml is the machine's grid (its profile's); <hardware>-<purpose>.yaml adds experiments
    # on that machine (`--config grid=`). Both write under results/<hardware>/.
    machine, _, purpose = path.stem.partition("-")
    assert g["hardware"] == machine
    if not purpose:  # a machine's grid holds the paper's experiments, and the points every machine shares
        assert set(g["experiments"]) <= {"scale", "ratel", "depth", "width", "context", "ablations", "devices", "shared"}
    # A not-runnable point is data with a reason, never a job of its experiment.
    for n in g.get("not_runnable", []):
        assert n["experiment"] in g["experiments"] and len(n["reason"]) >= 10
        assert (n["experiment"], n["id"]) not in grid.points(g)


@pytest.mark.parametrize("path", GRIDS, ids=lambda p: p.stem)
def test_every_point_is_a_valid_run_spec(path):
    # The harness rejects a bad spec before it starts a process; catch it here instead.
    for p in grid.points(grid.load(path)).values():
        RunSpec(system=p["system"], model=grid.model(p), seq_len=p["seq"], batch_size=p["batch"],
                grad_accum=p["accum"], steps=p["steps"], warmup=p["warmup"], timeout_s=p["timeout"],
                gpus=p.get("gpus", 1))
        args = grid.argv(p)
        assert args[:2] == ["--system", p["system"]] and "--out" not in args


@pytest.mark.parametrize("path", [p for p in GRIDS if "gpus" in grid.load(p)["experiments"]], ids=lambda p: p.stem)
def test_gpus_experiments_run_the_baselines_beside_megatrain(path):
    """Every MegaTrain point of a `gpus` experiment has ZeRO-3 Offload and FSDP2 beside it: the same
    model, GPUs, global batch (so the same batch per GPU) and shape."""
    pts = [p for (e, _), p in grid.points(grid.load(path)).items() if e == "gpus"]
    def shape(p):
        return p["preset"], p.get("gpus", 1), p["batch"], p["accum"], p["seq"]
    megatrain = {shape(p) for p in pts if p["system"] == "megatrain"}
    assert {p.get("gpus", 1) for p in pts} >= {1, 2}
    for system in ("zero3", "fsdp2"):
        assert {shape(p) for p in pts if p["system"] == system} == megatrain, system


@pytest.mark.parametrize("path", [p for p in GRIDS if "host_gib" in grid.load(p)], ids=lambda p: p.stem)
def test_points_over_the_host_are_marked_not_dropped(path):
    # The sizing is data: a MegaTrain point over host_gib at 12 B/param says so (expect: oom_host),
    # and one that fits does not.
    g = grid.load(path)
    for key, p in grid.points(g).items():
        if p["system"] == "megatrain":
            over = grid.host_need_gib(p) > g["host_gib"]
            assert (p.get("expect") == "oom_host") == over, key


def test_a_point_is_defined_once_per_machine():
    # The grids are the one registry of points: across the grids of one machine no two points run the
    # same thing (options that only add a measurement, ceiling and trace, do not count), and no two
    # experiments share a name, so no table or figure is written by two grids.
    by_hardware: dict[str, list[dict]] = {}
    for path in GRIDS:
        g = grid.load(path)
        by_hardware.setdefault(g["hardware"], []).append(g)
    for hardware, grids in by_hardware.items():
        names = [e for g in grids for e in g["experiments"]]
        assert len(names) == len(set(names)), hardware
        seen: dict[str, tuple[str, str]] = {}
        for g in grids:
            for key, p in grid.points(g).items():
                if "same_as" in p:  # the one run of another point, by design (grid.check)
                    continue
                assert seen.setdefault(grid.identity(p), key) == key, f"{hardware}: {key} repeats {seen[grid.identity(p)]}"
        # A trace lies beside its point's result.
        for g in grids:
            for (experiment, point_id), p in grid.points(g).items():
                if "trace" in p["options"]:
                    assert p["options"]["trace"] == f"results/{hardware}/points/{experiment}/{point_id}.trace.json"


GPU_GRIDS = [p for p in GRIDS if "-" not in p.stem and p.stem not in ("cpu", "shared")]


@pytest.mark.parametrize("path", GPU_GRIDS, ids=lambda p: p.stem)
def test_every_gpu_grid_runs_the_shared_points(path):
    """Every GPU machine runs shared.yaml's points with the same specs (ids, steps, timeout and all), so
    that any two machines' results pair up point by point in `python -m suite compare`."""
    shared = grid.points(grid.load(ROOT / "workflows" / "grids" / "shared.yaml"))
    mine = {k: {f: v for f, v in p.items() if f != "expect"} for k, p in grid.points(grid.load(path)).items()
            if k[0] == "shared"}
    assert mine == shared and len(shared) >= 3
    assert not any(p.get("expect") for k, p in grid.points(grid.load(path)).items() if k[0] == "shared")


def test_identity_ignores_what_only_adds_a_measurement():
    p = {"system": "megatrain", "preset": "tiny-llama", "seq": 32, "batch": 1, "accum": 1, "options": {"engine.checkpoint_every": 1}}
    assert grid.identity(p) == grid.identity({**p, "steps": 9, "options": {**p["options"], "ceiling": True, "trace": "t.json"}})
    assert grid.identity(p) != grid.identity({**p, "options": {"engine.checkpoint_every": 2}})
    assert grid.identity(p) != grid.identity({**p, "layers": 2})


def test_grid_command_line_runs_a_point_outside_the_workflow(capsys):
    path = str(ROOT / "workflows" / "grids" / "h100-speed.yaml")
    assert grid.main([path]) == 0
    listed = capsys.readouterr().out.split()
    assert "targets/7b_16seq_mb8_K1" in listed and len(listed) == len(grid.points(grid.load(path)))
    assert grid.main([path, "targets/7b_16seq_mb8_K1"]) == 0
    args = capsys.readouterr().out.split()
    assert args == grid.argv(grid.points(grid.load(path))[("targets", "7b_16seq_mb8_K1")])
    assert "ceiling=true" in args and "--out" not in args
    with pytest.raises(SystemExit):
        grid.main([path, "targets/nowhere"])


def test_profiles_pick_existing_grids():
    """Each profile is named by its folder (`--profile profiles/NAME`): no link at the root."""
    for profile in sorted((ROOT / "profiles").glob("*/config.yaml")):
        [configfile] = yaml.safe_load(profile.read_text())["configfiles"]
        assert (ROOT / configfile).parent == profile.parent, profile
        assert (ROOT / yaml.safe_load((ROOT / configfile).read_text())["grid"]).is_file(), profile
        assert not (ROOT / profile.parent.name).exists(), profile.parent.name


def test_a_config_on_the_command_line_adds_to_the_profiles():
    """`--config host_memory_gb=N` with a profile keeps the profile's grid and states the host's size."""
    dry = subprocess.run([sys.executable, "-m", "snakemake", "--profile", "profiles/h200", "-n", "-f",  # made or not
                          "results/h200/points/scale/7b_zero3.json", "--config", "host_memory_gb=250"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert dry.returncode == 0, dry.stderr[-2000:]
    assert "MEGATRAIN_HOST_MEMORY_GB=250 exec python -m suite run --system zero3 --preset qwen2.5-7b" in dry.stdout + dry.stderr


def test_the_main_command_runs_the_points_a_committed_partial_table_lacks():
    """The h200 tables and figures are committed from a partial drawing; `snakemake --profile profiles/h200`
    must still run every point without a result (Snakemake reruns nothing for a missing input of an
    output that exists), and a partial drawing must run none."""
    points = grid.points(grid.load(ROOT / "workflows/grids/h200.yaml"))
    lacking = [f"results/h200/points/{e}/{i}.json" for e, i in points
               if not (ROOT / f"results/h200/points/{e}/{i}.json").exists()
               and (ROOT / f"results/h200/tables/{e}.csv").exists()]
    if not lacking:
        pytest.skip("every h200 point with a committed table has a result")
    missing = lacking[0]
    for extra, scheduled in (([], True), (["--config", "partial=true"], False)):
        dry = subprocess.run([sys.executable, "-m", "snakemake", "--profile", "profiles/h200", "-n", *extra],
                             cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert dry.returncode == 0, dry.stderr[-2000:]
        assert (f"output: {missing}" in dry.stdout + dry.stderr) == scheduled, extra


@pytest.mark.slow
def test_partial_tables_run_no_probe_on_the_drawing_machine():
    """`--config partial=true` draws tables from what was measured: no bandwidth probe runs here to
    be filed as the grid's machine's Table 1 (the h200 grid has no probe result committed)."""
    assert not (ROOT / "results/h200/probes/bandwidth.json").exists()
    dry = subprocess.run([sys.executable, "-m", "snakemake", "--profile", "profiles/h200", "-n", "-F", "tables", "--config",
                          "partial=true"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert dry.returncode == 0, dry.stderr[-2000:]
    out = dry.stdout + dry.stderr
    assert "table2_models" in out and "rule bandwidth" not in out and "table1_memory_hierarchy" not in out


def test_overrides_reach_the_harness_spec(tmp_path, monkeypatch):
    # grid.argv's --override/--layers flags parse back into the RunSpec's model overrides.
    import suite.__main__ as cli
    import suite.runner
    p = {"system": "megatrain", "preset": "tiny-llama", "layers": 2, "seq": 32, "batch": 1, "accum": 1, "steps": 1,
         "warmup": 0, "timeout": 10, "options": {}, "overrides": {"hidden_size": 128, "num_attention_heads": 8}}
    seen = {}

    def fake_run_point(spec, out, python, fork):
        seen["model"] = spec.model
        return {"status": "ok", "median": {}, "peak": {"host_rss_bytes": 0}}
    monkeypatch.setattr(suite.runner, "run_point", fake_run_point)
    monkeypatch.delenv("PYTORCH_NVML_BASED_CUDA_CHECK", raising=False)  # `suite run` sets it; gone afterwards
    assert cli.main(["run", *grid.argv(p), "--out", str(tmp_path / "r.json")]) == 0
    assert seen["model"] == grid.model(p) == {
        "preset": "tiny-llama", "overrides": {"hidden_size": 128, "num_attention_heads": 8, "num_hidden_layers": 2}}


def test_duplicate_id_is_rejected():
    g = grid.load(ROOT / "workflows" / "grids" / "cpu.yaml")
    bad = copy.deepcopy(g)
    pts = bad["experiments"]["depth"]["points"]
    pts.append(dict(pts[0]))
    with pytest.raises(ValueError, match="used twice"):
        grid.check(bad)
    # A not-runnable entry shares its experiment's ids and must name an experiment of the grid.
    clash = copy.deepcopy(g)
    clash["not_runnable"] = [{"experiment": "depth", "id": "L2", "system": "x", "model": "y", "reason": "no preset here"}]
    with pytest.raises(ValueError, match="used twice"):
        grid.check(clash)
    clash["not_runnable"][0].update(id="new", experiment="nowhere")
    with pytest.raises(ValueError, match="unknown experiment"):
        grid.check(clash)


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
    # an experiment's note (what no column says) stands between its measured rows and the paper's
    assert not aggregate.EXPERIMENTS["scale"].note
    ratel = aggregate.markdown(df.assign(experiment="ratel"), "ratel", "h100")
    note = ratel.index(aggregate.EXPERIMENTS["ratel"].note)
    assert ratel.index("## Measured") < note < ratel.index("## Paper")


@pytest.mark.skipif(not BASELINES, reason="no stored H100 baseline results")
def test_the_scale_table_prints_predictions_apart_with_the_models_error():
    """The step model's rows for the paper's machines in their own section, after the measured and
    the paper's; the model checked against the table's own MegaTrain points on a probed machine."""
    df = aggregate.table(BASELINES, "scale", paper="figure1_scale")
    md = aggregate.markdown(df, "scale", "h100", BASELINES)
    measured, predicted = md.index("## Measured"), md.index("## Predicted")
    assert measured < md.index("## Paper") < predicted
    section = md[predicted:]
    assert "| h200-paper | gpt-oss-120b | yes |" in section and "| gh200-paper | qwen2.5-7b | yes |" in section
    checked = [line for line in section.splitlines() if line.startswith("| 7b_megatrain_b8x2 |")]
    assert len(checked) == 1 and "%)" in checked[0]
    assert "None of the measured points" in aggregate.markdown(df, "scale", "h100", [])
    assert "## Predicted" not in aggregate.markdown(df, "depth", "h100", BASELINES)


def test_grid_points_without_a_result_keep_a_not_run_row(tmp_path):
    """A table made before the whole grid has run (partial=true) lists the missing points as
    not_run, with their shape, and no throughput."""
    g = tmp_path / "grid.yaml"
    g.write_text(yaml.safe_dump({
        "hardware": "test", "defaults": {"seq": 32, "batch": 2, "steps": 1, "warmup": 0, "timeout": 10},
        "experiments": {"depth": {"points": [
            {"id": "L2", "system": "megatrain", "preset": "tiny-llama", "layers": 2},
            {"id": "L4", "system": "zero3", "preset": "tiny-llama", "layers": 4}]}}}))
    df = aggregate.table([], "depth", paper=[], grid=g)
    assert list(df["id"]) == ["L2", "L4"] and set(df["status"]) == {"not_run"}
    assert list(df["x"]) == [2, 4] and list(df["system"]) == ["megatrain", "zero3"]
    assert df["model_tflops"].isna().all() and (df["params"] > 0).all()


def test_an_included_grid_runs_on_this_host():
    # h200 runs gh200's experiments too: each point on gh200's defaults, `expect` sized for h200's
    # 1397 GiB (L180 needs 561 GiB: over gh200's 447, not over h200's), the paper artefacts kept.
    h200, gh200 = grid.load(ROOT / "workflows/grids/h200.yaml"), grid.load(ROOT / "workflows/grids/gh200.yaml")
    mine, theirs = grid.points(h200), grid.points(gh200)
    assert set(theirs) < set(mine) and ("scale", "72b_megatrain") in mine
    assert theirs[("depth", "L180_megatrain")]["expect"] == "oom_host"
    assert "expect" not in mine[("depth", "L180_megatrain")]
    assert {k: v for k, v in mine[("context", "ctx1k")].items() if k != "expect"} == theirs[("context", "ctx1k")]
    assert all(h200["experiments"][e].get("paper") == x.get("paper") for e, x in gh200["experiments"].items())


def test_an_include_cycle_is_refused(tmp_path):
    for name, other in (("a", "b"), ("b", "a")):
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(
            {"hardware": name, "include": [other], "defaults": {"seq": 8, "batch": 1, "steps": 1, "warmup": 0, "timeout": 1},
             "experiments": {"scale": {"points": [{"id": name, "system": "megatrain", "preset": "tiny-llama"}]}}}))
    with pytest.raises(ValueError, match="includes itself: a -> b -> a"):
        grid.load(tmp_path / "a.yaml")


def test_an_unknown_preset_option_or_paper_artefact_is_named_before_any_point_runs():
    g = grid.load(ROOT / "workflows" / "grids" / "cpu.yaml")
    bad = copy.deepcopy(g)
    bad["experiments"]["depth"]["points"][1]["preset"] = "tiny-lama"
    with pytest.raises(ValueError, match=r"grid point depth/L4: preset 'tiny-lama' is none of \[.*'tiny-llama'"):
        grid.check(bad)
    bad = copy.deepcopy(g)
    bad["experiments"]["depth"]["points"][1]["options"] = {"engine.checkpoint_every": 1, "engin.weight_buffers": 1}
    with pytest.raises(ValueError, match=r"grid point depth/L4: megatrain options: unknown \['engin'\]"):
        grid.check(bad)
    bad = copy.deepcopy(g)
    bad["experiments"]["width"]["points"][1]["overrides"]["hiden_size"] = 96
    with pytest.raises(ValueError, match=r"grid point width/w2.0: model.overrides: \['hiden_size'\] is no field"):
        grid.check(bad)
    bad = copy.deepcopy(g)
    bad["experiments"]["depth"]["paper"] = ["table5_depth", "figure5_dept"]
    with pytest.raises(ValueError, match=r"grid experiment 'depth': paper 'figure5_dept' is none of .*'figure5_depth'"):
        grid.check(bad)


def test_a_point_key_given_twice_in_a_grid_is_named(tmp_path):
    (tmp_path / "g.yaml").write_text("hardware: g\nexperiments:\n  scale:\n    points:\n"
                                      "      - {id: a, system: megatrain, preset: tiny-llama, seq: 8, seq: 16}\n")
    with pytest.raises(ValueError, match="g.yaml is not valid YAML: the key 'seq' is given twice"):
        grid.load(tmp_path / "g.yaml")


def test_a_missing_grid_is_named_with_those_beside_it(tmp_path):
    (tmp_path / "h100.yaml").write_text("hardware: h100\n")
    with pytest.raises(ValueError, match=r"h300.yaml: no such file \(beside it: h100\)"):
        grid.load(tmp_path / "h300.yaml")


def test_the_workflow_config_is_checked_by_its_schema():
    """`--config partial=false` (the string "false" from Snakemake) is false; a misspelt key or a
    value of the wrong kind is refused by name; every profile's workflow.yaml passes."""
    from snakemake.exceptions import WorkflowError

    from workflows.scripts.settings import checked
    assert checked({"partial": "false"}) == {"partial": False}
    assert checked({"partial": "true", "host_memory_gb": 500})["partial"] is True
    for bad, named in (({"parital": "true"}, "'parital' was unexpected"), ({"partial": "maybe"}, "'maybe'"),
                       ({"host_memory_gb": 0}, "minimum of 0"), ({"compare": {"hardware": "h100"}}, "'h100'")):
        with pytest.raises(WorkflowError, match=named):
            checked(bad)
    for workflow_yaml in sorted((ROOT / "profiles").glob("*/workflow.yaml")):
        checked(yaml.safe_load(workflow_yaml.read_text()))

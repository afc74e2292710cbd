"""The experiments' aggregation and figures on synthetic harness results (tmp_path), for every
experiment kind the mapping knows and for an unknown one; measured and paper rows stay apart."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

pd = pytest.importorskip("pandas")
pytest.importorskip("matplotlib")
pytest.importorskip("yaml")

from workflows import paper as paperlib  # noqa: E402
from workflows.scripts import aggregate, plot, timeline  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
KINDS = ["scale", "depth", "width", "context", "ablations", "devices"]


def _result(system: str, preset: str = "tiny-llama", *, status: str = "ok", layers: int | None = None,
            hidden: int | None = None, seq: int = 64, params: int = 143808, tflops: float = 0.01,
            options: dict | None = None) -> dict:
    overrides = {k: v for k, v in (("num_hidden_layers", layers), ("hidden_size", hidden)) if v}
    ok = status == "ok"
    return {
        "system": system, "status": status, "reason": None if ok else "out of memory", "params": params,
        "spec": {"system": system, "model": {"preset": preset, **({"overrides": overrides} if overrides else {})},
                 "seq_len": seq, "batch_size": 2, "grad_accum": 1, "options": options or {}},
        "median": {"model_tflops": tflops, "step_time_s": 0.1, "tokens_per_s": 1000.0} if ok else {},
        "peak": {"host_rss_bytes": 2 ** 30, "device_allocated_bytes": 2 ** 29 if ok else None},
    }


def _points(kind: str) -> dict[str, dict]:
    if kind == "depth":
        return {f"L{n}": _result("megatrain", layers=n, tflops=0.01 * n) for n in (2, 4, 8)}
    if kind == "width":
        return {f"w{m}": _result("megatrain", hidden=64 * m) for m in (1, 2, 3)}
    if kind == "context":
        return {f"s{s}": _result("megatrain", seq=s) for s in (32, 64, 128)} | {"s256": _result("megatrain", seq=256, status="oom_device")}
    return {"a_megatrain": _result("megatrain", params=7_000_000_000), "b_native": _result("native", params=3_000_000_000),
            "c_zero3": _result("zero3", status="oom_host")}


def _write(tmp_path: Path, kind: str) -> list[Path]:
    folder = tmp_path / "points" / kind
    folder.mkdir(parents=True)
    paths = []
    for pid, r in _points(kind).items():
        (folder / f"{pid}.json").write_text(json.dumps(r))
        paths.append(folder / f"{pid}.json")
    return paths


def test_mapping_covers_the_paper_experiments():
    for kind in KINDS:
        spec = aggregate.experiment(kind)
        assert spec is not aggregate.GENERIC and spec.paper and spec.label
        for artefact in spec.paper:
            assert (ROOT / "workflows" / "paper" / f"{artefact}.yaml").exists()
        assert spec.x in aggregate.MEASURED_COLUMNS
    assert aggregate.experiment("scale").paper == ("figure1_scale",)
    assert aggregate.experiment("context").log_x and aggregate.experiment("ablations").kind == "bars"
    assert set(aggregate.experiment("devices").paper) == {"table8_pcie_systems", "table9_consumer_gpus", "figure7_devices"}
    assert aggregate.experiment("nonsense") is aggregate.GENERIC


@pytest.mark.parametrize("kind", KINDS + ["mystery"])
def test_aggregate_and_plot_each_kind(kind, tmp_path):
    paths = _write(tmp_path, kind)
    csv, md, png, pdf = (tmp_path / f"{kind}.{e}" for e in ("csv", "md", "png", "pdf"))
    assert aggregate.main(["--experiment", kind, "--hardware", "cpu", "--csv", str(csv), "--md", str(md),
                           *map(str, paths)]) == 0
    df = pd.read_csv(csv)
    ours, paper = df[df["source"] == "measured"], df[df["source"] == "paper"]
    assert len(ours) == len(paths) and ours["x"].notna().all()
    # The paper's numbers never land in a measured column, and ours never in the paper's.
    assert paper[["model_tflops", "peak_host_GiB", "peak_device_GiB"]].isna().all().all()
    assert set(paper.get("artefact", pd.Series(dtype=str)).dropna()) == {paperlib.load(a)["artefact"] for a in aggregate.experiment(kind).paper}
    text = md.read_text()
    assert "## Measured (cpu)" in text and text.count("## Paper (") == len(aggregate.experiment(kind).paper)
    assert plot.main(["--csv", str(csv), "--experiment", kind, "--hardware", "cpu", "--png", str(png),
                      "--pdf", str(pdf)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG" and pdf.read_bytes()[:4] == b"%PDF"


def test_scale_table_lists_the_mixtures_of_experts_measured_beside_it(tmp_path):
    """The scale table's MoE rows: the `moe` experiment's points (reduced depth or whole), with their
    tokens a step, in a section of their own, never among the dense measured rows."""
    paths = _write(tmp_path, "scale")
    moe = tmp_path / "points" / "moe"
    moe.mkdir()
    point = _result("megatrain", "gpt-oss-120b", layers=4, tflops=178.5, params=14_010_590_528)
    point["spec"] |= {"batch_size": 8, "grad_accum": 4, "seq_len": 4096}
    (moe / "120b_L4_megatrain.json").write_text(json.dumps(point))
    csv, md = tmp_path / "scale.csv", tmp_path / "scale.md"
    assert aggregate.main(["--experiment", "scale", "--hardware", "cpu", "--moe", str(moe / "120b_L4_megatrain.json"),
                           "--csv", str(csv), "--md", str(md), *map(str, paths)]) == 0
    assert "120b_L4" not in csv.read_text()  # the dense rows and the figure are the scale points alone
    section = md.read_text().split("## Mixtures of experts (measured on cpu: the `moe` experiment)")[1]
    row = next(line for line in section.splitlines() if line.startswith("| 120b_L4_megatrain"))
    assert [c.strip() for c in row.split("|")[1:8]] == ["120b_L4_megatrain", "megatrain", "gpt-oss-120b", "4",
                                                        "131072", "ok", "178"]


@pytest.mark.parametrize("zero3, says", [
    ({"tflops": 143.0}, "| 3.24 | 464 / 143 |"),  # both ran with one spec: their ratio
    ({"status": "oom_host"}, "| none | zero3: oom_host |"),  # the second was refused: its status
    ({"tflops": 143.0, "batch": 4}, "| none | no two points with the same spec |"),
])
def test_the_paper_s_ratios_sit_beside_the_same_ratios_measured(zero3, says, tmp_path):
    """Figure 1's 1.84x (MegaTrain over ZeRO-3 Offload at 14B) beside this machine's two 14B points'
    ratio, made only of points that ran with the same spec; otherwise what stopped it."""
    folder = tmp_path / "points" / "scale"
    folder.mkdir(parents=True)
    batch = zero3.pop("batch", 2)
    for name, point in (("14b_megatrain", _result("megatrain", "qwen2.5-14b", params=14_770_033_664, tflops=463.5)),
                        ("14b_zero3", _result("zero3", "qwen2.5-14b", params=14_770_033_664, **zero3))):
        if name == "14b_zero3":
            point["spec"]["batch_size"] = batch
        (folder / f"{name}.json").write_text(json.dumps(point))
    csv, md = tmp_path / "scale.csv", tmp_path / "scale.md"
    assert aggregate.main(["--experiment", "scale", "--hardware", "cpu", "--csv", str(csv), "--md", str(md),
                           *map(str, sorted(folder.glob("*.json")))]) == 0
    section = md.read_text().split("## The paper's ratios beside the same ratios measured on cpu")[1].split("\n## ")[0]
    row = next(line for line in section.splitlines() if line.startswith("| 14B |"))
    assert row.startswith("| 14B | MegaTrain | ZeRO-3 Offload | model_tflops | 1.84 (Figure 1) ") and row.endswith(says)


def test_x_coordinates(tmp_path):
    width = aggregate.table(_write(tmp_path, "width"), "width")
    assert sorted(width[width["source"] == "measured"]["x"]) == [1.0, 2.0, 3.0]  # hidden 64k / tiny-llama's 64
    assert sorted(set(width[width["source"] == "paper"]["x"]))[:2] == [1.0, 1.5]
    explicit = _result("megatrain", hidden=96) | {"width": 2.5}
    assert aggregate.flatten(explicit, "w", "width")["width"] == 2.5
    ctx = aggregate.table(_write(tmp_path, "context"), "context")
    assert ctx[ctx["source"] == "paper"]["x"].max() == 512 * 1024
    scale = aggregate.table(_write(tmp_path, "scale"), "scale")
    # the paper's 7B, 14B and 32B at the parameter counts of our runs of the same models (Qwen2.5)
    assert scale[scale["source"] == "paper"]["x"].dropna().tolist() == pytest.approx([7.6156, 14.7700, 32.7639, 14.7700],
                                                                                     abs=1e-4)
    assert scale[scale["source"] == "measured"]["x"].tolist() == [7.0, 3.0, 0.000143808]


def test_points_on_fewer_layers_get_lines_of_their_own(tmp_path):
    """Table 7's longest contexts run on fewer layers: they are drawn apart, labelled by depth."""
    points = {"s64": _result("megatrain", seq=64), "s128": _result("megatrain", seq=128),
              "s256_L1": _result("megatrain", seq=256, layers=1)}
    paths = []
    for pid, r in points.items():
        (tmp_path / f"{pid}.json").write_text(json.dumps(r))
        paths.append(tmp_path / f"{pid}.json")
    df = aggregate.table(paths, "context", paper=[])
    series = plot._series(df, aggregate.experiment("context"))
    assert list(series) == ["megatrain (all layers)", "megatrain (all layers)", "megatrain (1 layer)"]
    depth = aggregate.table(paths[:2], "context", paper=[])
    assert list(plot._series(depth, aggregate.experiment("context"))) == ["megatrain", "megatrain"]


def test_ratels_offload_routes_are_lines_of_their_own(tmp_path):
    """Ratel's host-memory and disk routes are two systems in effect, and so is the disk route with
    its optimizer in main.py's process (`args.is_mp`): each its own line and legend entry, and a
    route without a value is named as such in the figure's note."""
    points = {"cpu": _result("ratel", options={"approximate_model": True, "offload": "cpu"}),
              "disk": _result("ratel", status="timeout", options={"approximate_model": True, "offload": "disk"}),
              "disk_mp0": _result("ratel", options={"approximate_model": True, "offload": "disk", "args": {"is_mp": 0}})}
    paths = []
    for pid, r in points.items():
        (tmp_path / f"{pid}.json").write_text(json.dumps(r))
        paths.append(tmp_path / f"{pid}.json")
    spec = aggregate.experiment("ratel")
    df = aggregate.table(paths, "ratel", paper=[])
    assert list(plot._series(df, spec)) == ["ratel offload=cpu", "ratel offload=disk", "ratel offload=disk args.is_mp=0"]
    assert "ratel offload=disk timeout at" in plot._failed_note(df, spec)


def test_the_paper_gets_a_line_per_system(tmp_path):
    """Figure 6's text gives throughput and host memory per system: one dashed line each (ratio rows
    not drawn, OOM rows as markers under zero: the next test); Table 6's device memory, which names
    no system, one line."""
    df = aggregate.table(_write(tmp_path, "width"), "width")
    fig = plot.figure(df, "width", "cpu")
    lines = {ax.get_title(): {ln.get_label(): ln.get_xydata().tolist() for ln in ax.get_lines()
                              if ln.get_linestyle() != "None"} for ax in fig.axes}
    tflops, host, device = (lines[t] for t in ("Throughput by width multiplier", "Host memory by width multiplier",
                                               "Device memory by width multiplier"))
    assert tflops["paper (GH200): ZeRO-3 Offload"] == [[1.0, 455], [3.0, 262], [3.5, 160], [4.0, 136]]
    assert tflops["paper (GH200): MegaTrain"] == [[1.0, 406], [3.0, 264], [3.5, 193]]
    assert tflops["paper (GH200): FSDP Offload"] == [[1.0, 501], [3.0, 281]]
    assert [y for _, y in host["paper (GH200): MegaTrain"]] == pytest.approx([v / plot.GB_PER_GiB for v in (174, 263, 308)])
    # Table 6's allocation is named as what it is, beside our allocator's peak
    assert "paper (GH200), device allocation (Table 6)" in device and not any(k.startswith("paper (GH200):") for k in device)


def test_the_papers_oom_is_drawn_as_its_word_in_the_no_value_band(tmp_path):
    """Figure 6's text says ZeRO-3 and FSDP run out of memory beyond width 4.0: each such point sits
    under zero with its series' open marker and "OOM", never as a value; Table 9's 14B ZeRO-3 row
    (OOM, printed without a number) keeps its bar's row and says OOM at zero."""
    df = aggregate.table(_write(tmp_path / "w", "width"), "width")
    fig = plot.figure(df, "width", "cpu")
    ax = fig.axes[0]
    oom = [ln for ln in ax.get_lines() if ln.get_label() == "paper (GH200): ZeRO-3 Offload" and ln.get_ydata()[0] < 0]
    assert sorted(float(ln.get_xdata()[0]) for ln in oom) == [4.5, 5.0]
    assert ax.get_ylim()[0] < min(ln.get_ydata()[0] for ln in oom) < 0  # in the band, not on the frame
    dashed = [ln for ln in ax.get_lines() if ln.get_label() == "paper (GH200): ZeRO-3 Offload" and ln.get_linestyle() == "--"]
    assert max(dashed[0].get_xdata()) == 4.0  # the line is not drawn to them
    assert [t.get_text() for t in ax.texts].count("OOM") == 4  # ZeRO-3 and FSDP at 4.5 and 5.0
    fsdp = [ln for ln in ax.get_lines() if ln.get_label() == "paper (GH200): FSDP Offload" and ln.get_ydata()[0] < 0]
    assert fsdp[0].get_ydata()[0] != oom[0].get_ydata()[0]  # a row each: the two markers at one x stay apart
    assert plot.paper_words(pd.DataFrame({"x": [1, 2, 3], "tflops": ["OOM", "–", 12]}), aggregate.experiment("devices"),
                            "model_tflops")["word"].tolist() == ["OOM"]
    bars = plot.figure(aggregate.table(_write(tmp_path / "d", "devices"), "devices"), "devices", "h100").axes[0]
    labels = [t.get_text() for t in bars.get_yticklabels()]
    row = labels.index("paper: Table 9 / RTX A6000 / Qwen2.5-14B / ZeRO-3 Offload")
    assert [t.xy for t in bars.texts if t.get_text() == "OOM"][0] == (0, row)


def test_timeline_colours_each_span_by_its_kind(tmp_path):
    """One span of every kind on its track, drawn; a kind without a colour would be a KeyError."""
    from megatrain.timeline import Kind, Track
    assert set(timeline.COLORS) == set(Kind)
    tracks = list(Track)
    events = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": i, "args": {"name": str(t)}}
              for i, t in enumerate(tracks)]
    events += [{"name": f"{kind} L0", "cat": str(kind), "ph": "X", "pid": 0, "tid": i % len(tracks),
                "ts": 1000.0 * i, "dur": 900.0} for i, kind in enumerate(Kind)]
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    timeline.main([str(trace), str(tmp_path / "t.png"), "--window", "0", "0.006", "--window", "0.006", "0.012"])
    assert (tmp_path / "t.png").stat().st_size > 0


def _table(tmp_path: Path, experiment: str, points: dict[str, dict], paper=None) -> pd.DataFrame:
    paths = []
    for pid, r in points.items():
        (tmp_path / f"{pid}.json").write_text(json.dumps(r))
        paths.append(tmp_path / f"{pid}.json")
    return aggregate.table(paths, experiment, paper=paper)


def _lines(fig) -> dict[str, list]:
    """Every axes' lines by label (a label may be drawn in several panels)."""
    out: dict[str, list] = {}
    for ax in fig.axes:
        for ln in ax.get_lines():
            out.setdefault(ln.get_label(), []).append(ln)
    return out


def test_refusals_observed_failures_and_never_attempted_points_have_their_own_markers_below_zero(tmp_path):
    """A refusal by the harness's estimate (by memory: host, device, disk), an out-of-memory seen
    while running and a point without a result file are told apart, and none reads as a value of
    zero: they sit in the band under zero, each kind its own marker and legend entry, each point in
    its system's colour but grey where nothing ran."""
    refusal = {**_result("zero3", layers=4, status="oom_host"),
               "reason": "ZeRO-3 Offload does not fit: host memory: needs 9.0 GiB, 8.0 GiB available"}
    disk = {**_result("zero_infinity", layers=4, status="oom_host"),
            "reason": "ZeRO-Infinity does not fit: disk space: needs 9.0 GiB, 8.0 GiB available"}
    observed = {**_result("megatrain", layers=4, status="oom_host"),
                "reason": "killed by SIGKILL with the process tree at 7.9 GiB of 8.0 GiB host memory"}
    df = _table(tmp_path, "depth", {"L2": _result("megatrain", layers=2), "L4": observed, "L4_zero3": refusal,
                                    "L4_zero_infinity": disk}, paper=[])
    assert list(df.set_index("id").loc[["L4", "L4_zero3", "L4_zero_infinity"], "refused"].fillna("")) == \
        ["", "host", "disk"]
    missing = aggregate.flatten({"system": "megatrain", "status": "not_run", "params": 1,
                                 "spec": {"model": {"preset": "tiny-llama", "overrides": {"num_hidden_layers": 8}},
                                          "seq_len": 64, "batch_size": 2, "grad_accum": 1}}, "L8", "depth")
    df = pd.concat([df, pd.DataFrame([missing | {"x": 8}])], ignore_index=True)
    fig = plot.figure(df, "depth", "cpu")
    lines = _lines(fig)
    kinds = {k: lines[plot.NO_VALUE[k][2]] for k in ("refused_host", "refused_disk", "oom_host", "not_run")}
    assert len({ln[0].get_marker() for ln in kinds.values()}) == 4  # the legend's: one marker per kind
    drawn = [ln for ax in fig.axes for ln in ax.get_lines() if ln.get_label() == "_nolegend_" and len(ln.get_xdata())
             and all(y < 0 for y in ln.get_ydata())]
    by_marker = {(ln.get_marker(), ln.get_color(), tuple(ln.get_xdata())) for ln in drawn}
    assert (plot.NO_VALUE["refused_host"][0], plot.SYSTEM_COLORS["zero3"], (4,)) in by_marker
    assert (plot.NO_VALUE["refused_disk"][0], plot.SYSTEM_COLORS["zero_infinity"], (4,)) in by_marker
    assert (plot.NO_VALUE["oom_host"][0], plot.SYSTEM_COLORS["megatrain"], (4,)) in by_marker
    assert (plot.NO_VALUE["not_run"][0], "grey", (8,)) in by_marker
    for ln in drawn:
        assert ln.axes.get_ylim()[0] < min(ln.get_ydata())  # inside the band, not on the frame
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert "measured (cpu): zero3, no value" in legend  # its colour is named though it has no line
    assert plot.no_value_style("weird")[2] == "failed (weird)"


def test_paper_points_sit_at_our_models_and_a_bound_looks_like_one(tmp_path):
    """Figure 1's 7B/14B at our runs' parameter counts; its "above 250" at 32B is a caret with an arrow,
    an entry of its own, not a point of the line."""
    points = {"7b_megatrain": _result("megatrain", "qwen2.5-7b", params=7615616512, tflops=300.0)}
    fig = plot.figure(_table(tmp_path, "scale", points), "scale", "h100")
    lines = _lines(fig)
    exact = lines["paper (GH200): MegaTrain"][0]
    measured = lines["measured (h100): megatrain"][0]
    assert exact.get_xdata()[0] == pytest.approx(measured.get_xdata()[0])  # one model, one x
    assert list(exact.get_ydata()) == [284, 264]  # the bound is not joined to the line
    [bound] = lines['paper (GH200): MegaTrain, lower bound ("above")']
    assert bound.get_marker() == plot.BOUND_MARKERS["lower"] and bound.get_linestyle() == "None"
    assert bound.get_xdata()[0] == pytest.approx(32.7639, abs=1e-3) and bound.get_ydata()[0] == 250
    arrows = [a for a in bound.axes.texts if getattr(a, "arrow_patch", None) is not None]
    assert len(arrows) == 1
    assert plot._bound("above", 250) == "lower" and plot._bound(None, ">250") == "lower"
    assert plot._bound("before OOM", 518) is None and plot._number(">250") == 250
    assert "the paper's points are the paper's" in fig._suptitle.get_text()  # drawn here, so named


def test_a_line_breaks_where_the_settings_change(tmp_path):
    """A 3B point with device tiles and kept layers and a 7B point without: two lines, not joined,
    the second with open markers."""
    tiles = {"engine": {"checkpoint_every": 1, "device_tiles": 20, "no_recompute_layers": "auto"}}
    points = {"3b": _result("megatrain", "qwen2.5-3b", params=3_085_938_688, tflops=370.0, options=tiles),
              "7b": _result("megatrain", "qwen2.5-7b", params=7_615_616_512, tflops=310.0,
                            options={"engine": {"checkpoint_every": 1, "device_tiles": 3}}),
              "7b_native": _result("native", "qwen2.5-7b", params=7_615_616_512, tflops=200.0),
              "3b_native": _result("native", "qwen2.5-3b", params=3_085_938_688, tflops=250.0,
                                   options={"ceiling": True})}  # a diagnostic option is no setting
    df = _table(tmp_path, "scale", points, paper=[])
    assert df.set_index("id").loc["7b", "options"] == "engine.checkpoint_every=1 engine.device_tiles=3"
    fig = plot.figure(df, "scale", "h100")
    ax = fig.axes[0]
    mega = [ln for ln in ax.get_lines() if ln.get_color() == plot.SYSTEM_COLORS["megatrain"]]
    solid = [ln for ln in mega if ln.get_linestyle() == "-"]
    apart = [ln for ln in mega if ln.get_gid() == plot.SETTINGS_CHANGE]
    assert [len(ln.get_xdata()) for ln in solid] == [1, 1] and len(apart) == 1
    assert apart[0].get_markerfacecolor() == "white"
    native = [ln for ln in ax.get_lines() if ln.get_label() == "measured (h100): native"]
    assert len(native[0].get_xdata()) == 2  # same settings: one line
    assert not [ln for ln in ax.get_lines() if ln.get_gid() == plot.SETTINGS_CHANGE and ln.get_color() == "C2"]
    assert "engine.device_tiles 20->3" in plot.setting_changes(
        plot.settings(df.iloc[0], aggregate.experiment("scale")), plot.settings(df.iloc[1], aggregate.experiment("scale")))
    legend = fig.legends[0].get_texts()
    assert any("other settings" in t.get_text() for t in legend)
    # Table 7 varies the batch by design: a batch change alone does not break its line
    ctx = aggregate.experiment("context")
    assert plot.settings(pd.Series({"seq": 1024, "batch": 64, "accum": 1, "options": ""}), ctx) == \
        plot.settings(pd.Series({"seq": 8192, "batch": 8, "accum": 1, "options": ""}), ctx)


def test_a_series_run_at_another_shape_is_named_under_the_figure(tmp_path):
    """Figure 1's native at its largest batch (4 x 1) beside the others' 8 x 4: the figure says so
    under it, naming what differs; the same shape everywhere says nothing."""
    seven = dict(params=7_615_616_512, tflops=300.0)
    points = {"7b_megatrain": _result("megatrain", "qwen2.5-7b", **seven), "7b_zero3": _result("zero3", "qwen2.5-7b", **seven),
              "7b_native": _result("native", "qwen2.5-7b", **seven)}
    for pid in ("7b_megatrain", "7b_zero3"):
        points[pid]["spec"].update(batch_size=8, grad_accum=4)
    points["7b_native"]["spec"].update(batch_size=4, grad_accum=1)
    notes = [t.get_text() for t in plot.figure(_table(tmp_path, "scale", points, paper=[]), "scale", "h100").texts]
    assert any("shape differs: native: batch 4, accum 1 (the others batch 8, accum 4)" in n for n in notes)
    points["7b_native"]["spec"].update(batch_size=8, grad_accum=4)
    notes = [t.get_text() for t in plot.figure(_table(tmp_path, "scale", points, paper=[]), "scale", "h100").texts]
    assert not any("shape differs" in n for n in notes)


def test_the_legend_fits_the_figure_and_a_cut_model_names_its_layers(tmp_path):
    """Appendix B's figure: one panel, long legend entries (the settings note), a 7B-wide model cut
    to 4 layers. The legend stays inside the figure; the tick under the cut model says "4 layers"
    rather than passing for the whole 7B."""
    points = {"1b_disk": _result("ratel", "qwen2.5-7b", layers=4, params=2_022_229_504, tflops=0.9,
                                 options={"offload": "disk"}),
              "1b_cpu": _result("ratel", "qwen2.5-7b", layers=4, params=2_022_229_504, tflops=30.3,
                                options={"offload": "cpu"}),
              "7b": _result("ratel", "qwen2.5-7b", params=7_615_616_512, status="unsupported")}
    fig = plot.figure(_table(tmp_path, "ratel", points), "ratel", "h100")
    fig.canvas.draw()
    box, legend = fig.bbox, fig.legends[0].get_window_extent()
    assert box.x0 <= legend.x0 and legend.x1 <= box.x1
    ticks = [t.get_text() for t in fig.axes[0].get_xticklabels()]
    # Ratel's own GPT at the spec's shape (4 layers, 7B's width, 64 tokens), not the preset's count
    assert "1.16\n(7B,\n4 layers)" in ticks and "4.86\n(7B)" in ticks and "7.62\n(7B)" in ticks
    assert plot._legend_columns(["x" * 60], 3.0) == 1 and plot._legend_columns(["x"], 9.0) == plot.LEGEND_COLUMNS


def test_an_auto_option_says_what_the_run_chose_and_a_line_breaks_where_that_differs(tmp_path):
    """FSDP2's `accumulate: auto` as each run resolved it (its info): the table says which, and a
    device-summed point and a host-summed one are not one line, the note naming the change."""
    points = {f"w{w}": {**_result("fsdp2", "qwen2.5-7b", hidden=h, params=p, tflops=t, options={"accumulate": "auto"}),
                        "info": {"accumulate": where}}
              for w, h, p, t, where in [("1.0", 3584, 2_721_402_880, 315.0, "device"), ("1.5", 5376, 5_305_595_904, 333.0, "device"),
                                         ("3.0", 10752, 17_952_141_312, 120.0, "host")]}
    df = _table(tmp_path, "width", points, paper=[])
    assert list(df.set_index("id").loc[["w1.0", "w3.0"], "options"]) == ["accumulate=auto(device)", "accumulate=auto(host)"]
    assert aggregate.options_text({"accumulate": "auto"}) == "accumulate=auto"  # no info: as asked
    assert aggregate.options_text({"engine": {"device_tiles": "auto"}}, {"engine": {"device_tiles": 19}}) == \
        "engine.device_tiles=auto(19)"
    fig = plot.figure(df, "width", "h200")
    assert [ln for ln in fig.axes[0].get_lines() if ln.get_gid() == plot.SETTINGS_CHANGE]
    assert any("accumulate auto(device)->auto(host)" in t.get_text() for t in fig.texts)


def test_a_line_breaks_where_the_resolved_kernels_change(tmp_path):
    """Two MegaTrain points asked alike, one run before the compiled layer kernels (no such
    setting recorded: eager) and one that resolved `auto` to them: the table says which ran what,
    and the figure does not join them with a solid line."""
    older = {**_result("megatrain", "qwen2.5-3b", params=3_085_938_688, tflops=370.0),
             "info": {"engine": {"device": "cuda:0", "checkpoint_every": 1}}}
    newer = {**_result("megatrain", "qwen2.5-7b", params=7_615_616_512, tflops=450.0),
             "info": {"engine": {"norm_kernel": "compiled", "mlp_kernel": "compiled"}}}
    native = _result("native", "qwen2.5-7b", params=7_615_616_512, tflops=200.0)
    df = _table(tmp_path, "scale", {"3b": older, "7b": newer, "7b_native": native}, paper=[])
    rows = df.set_index("id")
    assert (rows.loc["3b", "kernels"], rows.loc["7b", "kernels"]) == ("eager", "compiled")
    assert pd.isna(rows.loc["7b_native", "kernels"])
    assert aggregate.kernels({**older, "info": {"engine": {"norm_kernel": "compiled", "mlp_kernel": "eager"}}}) == "norm compiled"
    assert aggregate.kernels({**older, "info": {"engine": {"norm_kernel": "compiled", "mlp_kernel": "compiled",
                                                           "loss_kernel": "compiled"}}}) == "compiled, loss compiled"
    ax = plot.figure(df, "scale", "h100").axes[0]
    mega = [ln for ln in ax.get_lines() if ln.get_color() == plot.SYSTEM_COLORS["megatrain"]]
    assert len([ln for ln in mega if ln.get_gid() == plot.SETTINGS_CHANGE]) == 1
    spec = aggregate.experiment("scale")
    assert plot.setting_changes(plot.settings(rows.loc["3b"], spec), plot.settings(rows.loc["7b"], spec)) == "kernels eager->compiled"


def test_depth_legend_names_allocation_and_peak_apart_and_no_two_entries_look_alike(tmp_path):
    points = {f"L{n}_{s}": _result(s, "qwen2.5-7b", layers=n, tflops=100.0 + n) for n in (28, 42) for s in ("megatrain", "zero3")}
    fig = plot.figure(_table(tmp_path, "depth", points), "depth", "h100")
    device = next(ax for ax in fig.axes if ax.get_title().startswith("Device memory"))
    labels = {ln.get_label() for ln in device.get_lines()}
    assert "paper (GH200), device allocation (Table 5)" in labels
    assert "peak allocated" in device.get_ylabel()
    handles = fig.legends[0].legend_handles
    looks = [(h.get_marker(), str(h.get_color()), str(h.get_markerfacecolor()), h.get_linestyle())
             for h in handles if isinstance(h, plot.Line2D)]
    assert len(looks) == len(set(looks))
    paper = [h.get_marker() for h, t in zip(handles, fig.legends[0].get_texts()) if t.get_text().startswith("paper")]
    assert len(paper) == len(set(paper)) >= 4  # MegaTrain, ZeRO-3, FSDP and Table 5's allocation


def test_ablation_bars_are_relative_to_their_own_full_configuration(tmp_path):
    points = {"base_K1": _result("megatrain", tflops=400.0), "one_buffer": _result("megatrain", tflops=380.0),
              "K2": _result("megatrain", tflops=404.0)}
    fig = plot.figure(_table(tmp_path, "ablations", points), "ablations", "h100")
    ax = fig.axes[0]
    labels = [t.get_text().split("\n")[0] for t in ax.get_yticklabels()]  # under each id: its setup
    widths = dict(zip(labels, [p.get_width() for p in ax.patches]))
    assert labels[0].startswith("measured: base_K1")  # our full configuration first
    assert widths[labels[0]] == 0 and widths['measured: one_buffer = paper\'s "w/o Double Buffering"'] == \
        pytest.approx(-5.0)  # the paper's row of the same configuration named beside it
    assert widths["measured: K2"] == pytest.approx(1.0)
    paper = {k: v for k, v in widths.items() if k.startswith("paper")}
    assert paper["paper: w/o Double Buffering"] == pytest.approx(100 * (182.91 / 266.3 - 1))  # -31%
    assert paper["paper: MegaTrain (full)  [full: 0%]"] == 0


def test_bars_take_their_systems_colour_and_print_their_value(tmp_path):
    """The MoE experiment's bars: one colour and one legend entry per system, the value beside each
    bar, its model, depth and tokens under its id, a point that did not run named by what happened
    in every panel (a refusal by estimate for the swap's disk space as the disk's, an out-of-memory
    seen while running apart)."""
    swap = _result("zero3", status="oom_host") | {"reason": "ZeRO-Infinity does not fit: disk space: needs 9 GiB"}
    points = {"q_megatrain": _result("megatrain", tflops=142.4), "q_native": _result("native", tflops=79.6),
              "q_zero3": _result("zero3", tflops=72.0), "big_megatrain": _result("megatrain", status="error"),
              "big_zero3": _result("zero3", status="oom_host"), "big_swap": swap}
    fig = plot.figure(_table(tmp_path, "moe", points), "moe", "h200")
    assert len(fig.axes) == 4  # throughput, step time, host and device memory
    ax = fig.axes[0]
    full = [t.get_text() for t in ax.get_yticklabels()]
    assert full[0] == "measured: q_megatrain\n0.000144 B params, all layers, 2 x 1 x 64 tokens"
    labels = [t.split("\n")[0] for t in full]
    colour = {lab: p.get_facecolor() for lab, p in zip(labels, sorted(ax.patches, key=lambda p: p.get_y()))}
    assert colour["measured: q_megatrain"] != colour["measured: q_native"] != colour["measured: q_zero3"]
    assert colour["measured: q_megatrain"] == pytest.approx(plot.matplotlib.colors.to_rgba(plot.SYSTEM_COLORS["megatrain"]))
    texts = [t.get_text() for t in ax.texts]
    assert {"142", "79.6", "72", "error", "out of host memory (observed)", "refused (estimate): disk space"} <= set(texts)
    assert ax.get_xlim()[1] > 142.4  # the largest value's label inside the axes
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend == [f"measured (h200): {s}" for s in ("megatrain", "native", "zero3")]


def test_smoke_test_figure_says_so_and_keeps_to_its_own_scale(tmp_path):
    paths = _write(tmp_path, "depth")
    df = aggregate.table(paths, "depth").assign(peak_device_GiB=None)  # the CPU has no device memory
    fig = plot.figure(df, "depth", "cpu", smoke=True)
    assert fig._suptitle.get_text().startswith(plot.SMOKE_TITLE)
    assert not [ln for ln in fig.axes[0].get_lines() if ln.get_label().startswith("paper")]
    ax = fig.axes[0]
    ys = [y for ln in ax.get_lines() for y in ln.get_ydata()]
    lo, hi = ax.get_ylim()
    assert lo == 0 and max(ys) <= hi <= 1.2 * max(ys)  # its own data's scale, from zero: no magnified cliffs
    host = fig.axes[1]
    assert host.get_ylim()[0] == 0  # 1 GiB on every point: a flat line from zero, not a cliff
    empty = fig.axes[2]  # no device memory on the CPU
    assert any(t.get_text() == "no value measured" for t in empty.texts)


def test_gpus_figure_scales_each_line_and_lists_a_refused_point_without_drawing_it(tmp_path):
    """The GPU-count experiment: tokens/s over the table's `gpus`, the 1-GPU point's ideal scaling
    dashed in the line's colour and the speed-up beside the 2-GPU point; a failed point is listed by id
    under the axes, in no panel; no paper points, so the title names none."""
    def point(system: str, gpus: int, tokens: float | None, status: str = "ok") -> dict:
        r = _result(system, "qwen2.5-7b", status=status)
        r["spec"] |= {"gpus": gpus, "batch_size": 2 * gpus}
        r["median"] = {"tokens_per_s": tokens} if tokens else {}
        return r
    df = _table(tmp_path, "gpus", {"7b_g1": point("megatrain", 1, 1000.0), "7b_g2": point("megatrain", 2, 1970.0),
                                   "7b_g2_zero3": point("zero3", 2, None, status="oom_host")})
    assert list(df["gpus"]) == list(df["x"]) == [1, 2, 2]
    csv, png, pdf = (tmp_path / f"gpus.{e}" for e in ("csv", "png", "pdf"))
    df.to_csv(csv, index=False)
    assert plot.main(["--csv", str(csv), "--experiment", "gpus", "--hardware", "h200", "--png", str(png),
                      "--pdf", str(pdf)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG" and pdf.read_bytes()[:4] == b"%PDF"
    fig = plot.figure(pd.read_csv(csv), "gpus", "h200")
    throughput, host = fig.axes
    line = _lines(fig)["measured (h200): megatrain (qwen2.5-7b)"][0]
    assert line.get_xydata().tolist() == [[1, 1000], [2, 1970]]
    [ideal] = [ln for ln in throughput.get_lines() if ln.get_gid() == plot.IDEAL]
    assert list(ideal.get_ydata()) == [1000, 2000] and ideal.get_color() == line.get_color()
    assert [t.get_text() for t in throughput.texts] == ["1.97x"]
    assert [t.get_text() for t in throughput.get_xticklabels()] == ["1", "2"]
    # the refused point (its host memory is in the table) is drawn nowhere, not even in the band
    assert {ln.get_label() for ax in fig.axes for ln in ax.get_lines()} == {line.get_label(), "_nolegend_"}
    assert all(ax.get_ylim()[0] == 0 for ax in fig.axes)
    assert any(t.get_text() == "not drawn, ran out of host memory (observed): 7b_g2_zero3" for t in fig.texts)
    assert fig._suptitle.get_text() == "gpus: measured on h200"


def test_a_second_series_takes_a_colour_no_other_meaning_has():
    """A system's further series (fewer layers, another offload) take colours that are no system's,
    no no-value status's (grey: not attempted, red: refused) and not the paper's black."""
    taken = {*plot.SYSTEM_COLORS.values(), *(c for _, c, _ in plot.NO_VALUE.values()), plot.OTHER_NO_VALUE[1],
             plot.PAPER["color"], "C3", "C7"}  # C3 and C7 are matplotlib's red and grey
    assert taken.isdisjoint(plot.SPARE_COLORS) and len(set(plot.SPARE_COLORS)) == len(plot.SPARE_COLORS)
    styles = plot.series_styles(["ratel offload=disk", "ratel offload=cpu", "megatrain", "megatrain (7 layers)"])
    assert styles["ratel offload=disk"][1] == plot.SYSTEM_COLORS["ratel"]
    assert {styles["ratel offload=cpu"][1], styles["megatrain (7 layers)"][1]} <= set(plot.SPARE_COLORS)


def test_a_figure_drawn_again_is_the_same_file(tmp_path):
    import matplotlib.pyplot as plt

    from megatrain.io import save_figure
    fig, ax = plt.subplots()
    ax.plot([1, 2], [3, 4])
    save_figure(fig, tmp_path / "a.png", tmp_path / "a.pdf")
    first = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    save_figure(fig, tmp_path / "a.png", tmp_path / "a.pdf")
    plt.close(fig)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == first and b"CreationDate" not in first["a.pdf"]


def _texts(fig) -> str:
    return " ".join(t.get_text() for t in fig.texts)


def test_an_experiments_note_is_printed_under_its_figure(tmp_path):
    """Ratel's note (its disk route's gradients, its twice-counted shared buffers) is under its figure
    as under its table; an experiment without one prints none, and a CPU smoke figure leaves it out."""
    points = {"1b_ratel_disk": _result("ratel", "qwen2.5-7b", layers=4, params=2_022_229_504, tflops=0.8,
                                       options={"approximate_model": True, "offload": "disk"})}
    drawn = _texts(plot.figure(_table(tmp_path, "ratel", points), "ratel", "h200"))
    assert "Ratel's disk route" in drawn and "shared" in drawn
    assert "Ratel's disk route" not in _texts(plot.figure(_table(tmp_path, "ratel", points), "ratel", "cpu",
                                                         smoke=True))
    assert not aggregate.experiment("depth").note


def test_a_figure_states_its_setup_and_the_paper_as_it_prints_it(tmp_path):
    """Under the figure: the layers, tokens a step, MegaTrain's kernels and the host, a value per
    system where they differ; the paper's numbers as printed (Table 3's 88.97 beside 88.99, not 89)."""
    mega = {**_result("megatrain", "qwen2.5-7b", layers=7, params=7_615_616_512, tflops=400.0),
            "info": {"engine": {"norm_kernel": "compiled", "mlp_kernel": "compiled"}},
            "env": {"host_memory_bytes": 126 * 2**30}}
    zero = {**_result("zero3", "qwen2.5-7b", layers=4, params=7_615_616_512, tflops=200.0),
            "env": {"host_memory_bytes": 126 * 2**30}}
    df = _table(tmp_path, "scale", {"7b": mega, "7b_zero3": zero}, paper=[])
    line = plot.setup_line(df, aggregate.experiment("scale"))
    assert line == ("setup: layers: 7 (megatrain), 4 (zero3); tokens a step: 2 x 1 x 64; MegaTrain's kernels: "
                    "compiled; host: 126 GiB")
    assert any(t.get_text() == line for t in plot.figure(df, "scale", "h100").texts)
    printed = aggregate.md_table(pd.DataFrame({"zero_infinity": [88.97], "megatrain": [88.99]}), printed=True)
    assert "| 88.97 | 88.99 |" in printed
    assert "| 89 | 89 |" in aggregate.md_table(pd.DataFrame({"a": [88.97], "b": [88.99]}))  # ours: 3 figures


def test_ratel_sits_at_the_size_of_the_model_it_trains(tmp_path):
    """Ratel trains a GPT of its own at the spec's shape: its points, run or refused, at that model's
    parameters (4.88 B at Qwen2.5-7B's shape and 4096 tokens), not the preset's 7.62 B."""
    ran = {**_result("ratel", "qwen2.5-7b", params=7_615_616_512, tflops=10.0, seq=4096),
           "info": {"ratel_params": 4_876_928_000}}
    refused = {**_result("ratel", "qwen2.5-7b", params=7_615_616_512, status="oom_host", seq=4096),
               "reason": "ratel does not fit: disk space: needs 83.8 GiB, 63.7 GiB available"}
    df = _table(tmp_path, "ratel", {"7b_ratel": ran, "7b_ratel_disk": refused}, paper=[]).set_index("id")
    assert list(df["params"]) == [4_876_928_000, 4_876_928_000]
    assert df.loc["7b_ratel_disk", "refused"] == "disk"


def test_the_executed_rate_counts_causal_attention_as_half_its_square(tmp_path):
    """The 7B at 512K tokens on the H200 (committed): the step's kernels ran 863.6 TFLOP/s counting
    attention's whole square, recomputed forward included; a causal kernel computes half the
    square, which at 512K is most of the FLOPs, so what the kernels executed is below the model's rate."""
    point = json.loads((ROOT / "results/h200/points/long_context/ctx512k_L28.json").read_text())
    df = _table(tmp_path, "long_context", {"ctx512k_L28": point})
    whole, model = point["median"]["hardware_tflops"], point["median"]["model_tflops"]
    assert whole / 2 < df.loc[0, "executed_tflops"] < model < whole


def test_a_tiny_models_executed_rate_is_counted_at_its_own_sequence(tmp_path):
    """The CPU grid's points: a tiny preset whose positions stop at 256, at 64 tokens a sequence."""
    point = _result("megatrain", seq=64)
    point["median"] |= {"hardware_flops": 1e9}
    point["info"] = {"engine": {"no_recompute_layers": 0, "keep_attention_layers": 0}}
    df = _table(tmp_path, "context", {"s64": point})
    assert 0 < df.loc[0, "executed_tflops"] < 1e9 / 0.1 / 1e12


def test_long_context_and_largest_show_what_they_are_about(tmp_path):
    """long_context: the executed TFLOP/s beside the model TFLOP/s, and the step time; largest: the
    parameters and the host memory; a bar of a grid point names its model, depth and tokens."""
    point = {**_result("megatrain", "qwen2.5-7b", layers=4, params=2_020_000_000, seq=1_048_576, tflops=652.0)}
    point["median"] |= {"step_time_s": 304.0}
    df = _table(tmp_path, "long_context", {"ctx1m_L4": point})
    fig = plot.figure(df, "long_context", "h200x4")
    assert [ax.get_title() for ax in fig.axes] == ["Throughput", "Executed FLOPs", "Step time", "Device memory"]
    assert fig.axes[0].get_yticklabels()[0].get_text() == \
        "measured: ctx1m_L4\n2.02 B params, 4 layers, 2 x 1 x 1048576 tokens"
    assert [ax.get_title() for ax in plot.figure(df, "largest", "h200x4").axes] == \
        ["Throughput", "Model size", "Host memory"]

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

ROOT = Path(__file__).resolve().parent.parent
KINDS = ["scale", "depth", "width", "context", "ablations", "devices"]


def _result(system: str, preset: str = "tiny-llama", *, status: str = "ok", layers: int | None = None,
            hidden: int | None = None, seq: int = 64, params: int = 143808, tflops: float = 0.01) -> dict:
    overrides = {k: v for k, v in (("num_hidden_layers", layers), ("hidden_size", hidden)) if v}
    ok = status == "ok"
    return {
        "system": system, "status": status, "reason": None if ok else "out of memory", "params": params,
        "spec": {"system": system, "model": {"preset": preset, **({"overrides": overrides} if overrides else {})},
                 "seq_len": seq, "batch_size": 2, "grad_accum": 1},
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
    assert set(aggregate.experiment("devices").paper) == {"table8_pcie_systems", "table9_consumer_gpus"}
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


def test_x_coordinates(tmp_path):
    width = aggregate.table(_write(tmp_path, "width"), "width")
    assert sorted(width[width["source"] == "measured"]["x"]) == [1.0, 2.0, 3.0]  # hidden 64k / tiny-llama's 64
    assert sorted(set(width[width["source"] == "paper"]["x"]))[:2] == [1.0, 1.5]
    explicit = _result("megatrain", hidden=96) | {"width": 2.5}
    assert aggregate.flatten(explicit, "w", "width")["width"] == 2.5
    ctx = aggregate.table(_write(tmp_path, "context"), "context")
    assert ctx[ctx["source"] == "paper"]["x"].max() == 512 * 1024
    scale = aggregate.table(_write(tmp_path, "scale"), "scale")
    assert scale[scale["source"] == "paper"]["x"].dropna().tolist() == [7.0, 14.0, 32.0, 14.0]
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


def test_the_paper_gets_a_line_per_system(tmp_path):
    """Figure 6's text gives throughput and host memory per system: one dashed line each (OOM and
    ratio rows not drawn); Table 6's device memory, which names no system, one line."""
    df = aggregate.table(_write(tmp_path, "width"), "width")
    fig = plot.figure(df, "width", "cpu")
    lines = {ax.get_title(): {ln.get_label(): ln.get_xydata().tolist() for ln in ax.get_lines()} for ax in fig.axes}
    tflops, host, device = (lines[t] for t in ("Throughput by width multiplier", "Host memory by width multiplier",
                                               "Device memory by width multiplier"))
    assert tflops["paper (GH200): ZeRO-3 Offload"] == [[1.0, 455], [3.0, 262], [3.5, 160], [4.0, 136]]
    assert tflops["paper (GH200): MegaTrain"] == [[1.0, 406], [3.0, 264], [3.5, 193]]
    assert tflops["paper (GH200): FSDP Offload"] == [[1.0, 501], [3.0, 281]]
    assert [y for _, y in host["paper (GH200): MegaTrain"]] == pytest.approx([v / plot.GB_PER_GiB for v in (174, 263, 308)])
    assert "paper (GH200)" in device and not any(k.startswith("paper (GH200):") for k in device)


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

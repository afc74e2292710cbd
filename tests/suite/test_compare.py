"""suite.compare: points pair by spec across folders, direction-aware verdicts, exit status, and the
cross-hardware figure's inputs. Synthetic harness-format results in tmp_path; no subprocess."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatrain.units import GiB
from suite import compare

ROOT = Path(__file__).resolve().parents[2]
BASELINES = ROOT / "results" / "h100" / "probes" / "baselines"


def result(system="megatrain", batch=4, status="ok", tflops=300.0, host_gib=50.0, device_gib=20.0, options=None):
    ok = status == "ok"
    return {
        "system": system, "status": status, "reason": None if ok else "out of memory",
        "spec": {"system": system, "model": {"preset": "qwen2.5-3b"}, "seq_len": 4096, "batch_size": batch,
                 "grad_accum": 1, "steps": 5, "warmup": 2, "seed": 0, "lr": 1e-5, "repeat_batch": False,
                 "timeout_s": 600.0, "options": options or {}},
        "median": {"model_tflops": tflops, "step_time_s": 1.0} if ok else {},
        "peak": {"host_rss_bytes": int(host_gib * GiB), "device_allocated_bytes": int(device_gib * GiB) if ok else None,
                 "device_nvml_bytes": None},
        "env": {"gpu": "test", "git_commit": "0" * 40},
    }


def write(folder: Path, name: str, r: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.json").write_text(json.dumps(r))


@pytest.fixture
def base(tmp_path):
    d = tmp_path / "base"
    write(d, "a", result("megatrain", 4))
    write(d, "b", result("native", 4, tflops=320.0, host_gib=2.0, device_gib=70.0))
    return d


def verdicts(report) -> dict[tuple[str, str], str]:
    return {(r["point"].split()[0], r["metric"]): r["verdict"] for r in report["rows"]}


def test_pairs_by_spec_not_file_name(base, tmp_path):
    new = tmp_path / "new"
    write(new, "renamed_native", result("native", 4, tflops=320.0, host_gib=2.0, device_gib=70.0))
    write(new / "sub", "x", result("megatrain", 4))  # folders are searched recursively
    report = compare.compare(base, new)
    assert report["matched"] == 2 and not report["only_base"] and not report["only_new"]
    assert set(verdicts(report).values()) == {"same"}


def test_same_name_other_spec_does_not_pair(base, tmp_path):
    new = tmp_path / "new"
    write(new, "a", result("megatrain", 8))  # the name of base's b4 point, but batch 8
    write(new, "b", result("native", 4, tflops=320.0, host_gib=2.0, device_gib=70.0))
    report = compare.compare(base, new)
    assert report["matched"] == 1
    assert report["only_base"] == ["megatrain qwen2.5-3b s4096 b4x1"]
    assert report["only_new"] == ["megatrain qwen2.5-3b s4096 b8x1"]
    assert compare.main(str(base), str(new), 0.05, compare.DEFAULT_METRICS) == 0  # unmatched is no regression


def test_options_are_part_of_the_key(base, tmp_path):
    new = tmp_path / "new"
    write(new, "a", result("megatrain", 4, options={"engine": {"checkpoint_every": 2}}))
    report = compare.compare(base, new)
    assert report["only_new"] == ["megatrain qwen2.5-3b s4096 b4x1 engine.checkpoint_every=2"]


def test_tflops_drop_beyond_threshold_is_worse_and_exits_1(base, tmp_path, capsys):
    new = tmp_path / "new"
    write(new, "a", result("megatrain", 4, tflops=270.0))  # -10%
    write(new, "b", result("native", 4, tflops=330.0, host_gib=2.0, device_gib=70.0))  # +3%: within 5%
    report = compare.compare(base, new, threshold=0.05)
    v = verdicts(report)
    assert v[("megatrain", "model_tflops")] == "worse" and v[("native", "model_tflops")] == "same"
    assert report["regressed"]
    assert compare.main(str(base), str(new), 0.05, compare.DEFAULT_METRICS) == 1
    assert "-10.0" in capsys.readouterr().out
    assert compare.main(str(base), str(new), 0.15, compare.DEFAULT_METRICS) == 0  # a looser threshold


def test_memory_increase_is_worse_and_decrease_better(base, tmp_path):
    new = tmp_path / "new"
    write(new, "a", result("megatrain", 4, host_gib=60.0))  # +20% host
    write(new, "b", result("native", 4, tflops=320.0, host_gib=2.0, device_gib=50.0))  # -29% device
    report = compare.compare(base, new)
    v = verdicts(report)
    assert v[("megatrain", "peak_host")] == "worse" and v[("native", "peak_device")] == "better"
    assert report["regressed"]


def test_faster_is_better_not_a_regression(base, tmp_path):
    new = tmp_path / "new"
    write(new, "a", result("megatrain", 4, tflops=360.0))
    write(new, "b", result("native", 4, tflops=320.0, host_gib=2.0, device_gib=70.0))
    report = compare.compare(base, new)
    assert verdicts(report)[("megatrain", "model_tflops")] == "better" and not report["regressed"]


def test_ok_to_oom_is_status_changed_and_exits_1(base, tmp_path):
    new = tmp_path / "new"
    write(new, "a", result("megatrain", 4))
    write(new, "b", result("native", 4, status="oom_device"))
    report = compare.compare(base, new)
    row = next(r for r in report["rows"] if r["point"].startswith("native"))
    assert (row["metric"], row["base"], row["new"], row["verdict"]) == ("status", "ok", "oom_device", "status changed")
    assert compare.main(str(base), str(new), 0.05, compare.DEFAULT_METRICS) == 1
    # The other way round (a point now fits) moves the status too, but is no regression.
    assert not compare.compare(new, base)["regressed"]


def test_identical_folders_exit_0_and_write_json(base, tmp_path):
    out = tmp_path / "cmp.json"
    assert compare.main(str(base), str(base), 0.05, compare.DEFAULT_METRICS, str(out)) == 0
    saved = json.loads(out.read_text())
    assert saved["matched"] == 2 and not saved["regressed"] and len(saved["rows"]) == 6


def test_non_harness_files_are_skipped_with_a_note(base, tmp_path):
    new = tmp_path / "new"
    write(new, "a", result("megatrain", 4))
    write(new, "old_tool", {"spec": {"model": {"preset": "qwen2.5-3b"}, "steps": 6}, "status": "ok",
                            "peak": {"peak_host_bytes": 1}})
    (new / "broken.json").write_text("{")
    report = compare.compare(base, new)
    assert report["matched"] == 1 and len(report["skipped"]) == 2
    assert any("not a harness result" in s for s in report["skipped"])


def test_unknown_metric_is_rejected(base):
    with pytest.raises(ValueError, match="metrics: unknown"):
        compare.compare(base, base, metrics=("flops",))


def test_cli_parses_compare(base, capsys):
    from suite.__main__ import main
    assert main(["compare", str(base), str(base), "--threshold", "0.1", "--metrics", "model_tflops"]) == 0
    assert "2 points matched (a change counts beyond the pair's noise, at least 10.0%)" in capsys.readouterr().out


@pytest.mark.skipif(not BASELINES.is_dir(), reason="no stored H100 baseline results")
def test_real_baselines_against_themselves():
    report = compare.compare(BASELINES, BASELINES)
    assert report["matched"] >= 16 and not report["regressed"]
    assert {r["verdict"] for r in report["rows"]} == {"same"}


def test_hardware_figure(base, tmp_path):
    pytest.importorskip("matplotlib")
    from workflows.scripts import hardware_compare
    other = tmp_path / "other"
    write(other, "x", result("megatrain", 4, tflops=350.0))
    write(other, "y", result("native", 4, status="oom_device"))
    png, pdf = tmp_path / "c.png", tmp_path / "c.pdf"
    assert hardware_compare.main([f"h100={base}", f"h200={other}", "--png", str(png), "--pdf", str(pdf)]) == 0
    assert png.stat().st_size > 0 and pdf.stat().st_size > 0
    labels, by_hw = hardware_compare.collect({"h100": str(base), "h200": str(other)})
    assert len(labels) == 2 and by_hw["h200"]["native qwen2.5-3b s4096 b4x1"]["status"] == "oom_device"
    # a long label wraps beside its group; the legend names each machine as its results say
    write(other, "z", result("megatrain", 4, options={"engine": {"checkpoint_every": 1, "device_tiles": 20,
                                                                 "grad_slabs": 12, "no_recompute_layers": "auto"}}))
    labels, by_hw = hardware_compare.collect({"h100": str(base), "h200": str(other)})
    fig, ax = hardware_compare.figure(labels, by_hw, "t")
    ticks = [t.get_text() for t in ax.get_yticklabels()]
    assert ticks[:2] == ["megatrain qwen2.5-3b s4096 b4x1", "native qwen2.5-3b s4096 b4x1"]  # on both first
    assert max(len(line) for t in ticks for line in t.split("\n")) <= 48
    assert "only" not in ax.get_title() and "2 of 3 points ran on every machine" in ax.get_title()
    assert [t.get_text() for t in ax.get_legend().get_texts()][0].startswith("h100: test")


H100 = {"gpu": "NVIDIA H100 80GB HBM3", "gpu_count": 1, "cpu_cores": 16, "host_memory_bytes": 135148564480,
        "driver": "580.159.04", "cuda": "13.0", "torch": "2.11.0+cu130", "git_commit": "78abc87" + "0" * 33}
H200 = {**H100, "gpu": "NVIDIA H200", "cpu_cores": 32, "host_memory_bytes": 270334464000, "git_commit": "a4bc0bd" + "0" * 33}


def test_env_differences_by_kind():
    assert compare.env_differences(H100, H100) == {}
    # the OS's reading of host memory moving by a few percent is the same memory
    assert compare.env_differences(H100, {**H100, "host_memory_bytes": int(135148564480 * 1.02)}) == {}
    diff = compare.env_differences(H100, H200)
    assert set(diff) == {"gpu", "cpu_cores", "host_memory_bytes", "git_commit"}
    assert diff["gpu"] == ("NVIDIA H100 80GB HBM3", "NVIDIA H200")
    assert set(compare.env_differences(H100, {**H100, "torch": "2.12.0", "driver": "590.1"})) == {"driver", "torch"}
    assert "NVIDIA H200 x1, 32 cores, 251.8 GiB host" in compare.describe(H200)


def test_a_pair_on_another_machine_says_so_and_is_no_regression(base, tmp_path, capsys):
    """A point run on an H200 against the same point on an H100: the verdict is the machines', the
    GPU, cores, host memory and commit are named, and the exit status does not call it a regression."""
    b, n = tmp_path / "b", tmp_path / "n"
    write(b, "a", result("megatrain", 4, tflops=300.0) | {"env": H100})
    write(b, "c", result("native", 4, tflops=300.0) | {"env": H100})
    write(n, "a", result("megatrain", 4, tflops=400.0, host_gib=60.0) | {"env": H200})
    write(n, "c", result("native", 4, status="oom_device") | {"env": H200})
    report = compare.compare(b, n)
    v = verdicts(report)
    assert v[("megatrain", "model_tflops")] == "faster on new machine"
    assert v[("megatrain", "peak_host")] == "more on new machine"
    assert v[("native", "status")] == "status differs on new machine"
    assert not report["regressed"] and report["machine_pairs"] == 2
    assert all(r["machine_differs"] and "gpu" in r["env"] for r in report["rows"])
    assert report["env_differences"]["gpu"] == [["NVIDIA H100 80GB HBM3", "NVIDIA H200"]]
    assert compare.main(str(b), str(n), 0.05, compare.DEFAULT_METRICS) == 0
    out = capsys.readouterr().out
    assert "DIFFERENT MACHINES: 2 of 2 pairs" in out and "gpu (machine): NVIDIA H100 80GB HBM3 -> NVIDIA H200" in out
    assert "cores (machine): 16 -> 32" in out and "commit (code): 78abc87 -> a4bc0bd" in out
    table = out.split("env differs\n")[1].split("\n\n")[0]
    assert "better" not in table and "worse" not in table and "REGRESSION" not in out


def test_same_machine_other_commit_is_a_code_comparison(base, tmp_path, capsys):
    b, n = tmp_path / "b", tmp_path / "n"
    write(b, "a", result("megatrain", 4, tflops=300.0) | {"env": H100})
    write(n, "a", result("megatrain", 4, tflops=250.0) | {"env": {**H100, "git_commit": "1" * 40, "torch": "2.12.0"}})
    report = compare.compare(b, n)
    row = next(r for r in report["rows"] if r["metric"] == "model_tflops")
    assert row["verdict"] == "worse" and row["regression"] and not row["machine_differs"]
    assert row["env"] == ["torch", "git_commit"]  # said, so a reader sees torch moved too
    assert compare.main(str(b), str(n), 0.05, compare.DEFAULT_METRICS) == 1
    out = capsys.readouterr().out
    assert "torch (software): 2.11.0+cu130 -> 2.12.0" in out and "DIFFERENT MACHINES" not in out


def test_the_hardware_figure_compares_every_machine_with_results_by_default(tmp_path, monkeypatch):
    """compare.hardware unset: the profile's own machine and every machine whose results hold the
    experiment (so the committed figure does not lose a machine when redrawn by default); named: those."""
    from workflows.scripts import hardware_compare
    for hw, experiment in (("h100", "shared"), ("h200x4", "shared"), ("h200", "scale")):
        (tmp_path / "results" / hw / "points" / experiment).mkdir(parents=True)
        (tmp_path / "results" / hw / "points" / experiment / "p.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    assert hardware_compare.machines(None, "shared", "h200") == ["h100", "h200", "h200x4"]
    assert hardware_compare.machines(["h100", "h200"], "shared", "h200") == ["h100", "h200"]


def timed(r: dict, times: list[float], matmul: float | None = None, **env) -> dict:
    """`r` with measured steps of these times (after one warm-up step) and its env amended."""
    steps = [{"step": i + 1, "step_time_s": t} for i, t in enumerate([times[0]] + times)]
    out = {**r, "steps": steps, "spec": {**r["spec"], "warmup": 1}, "env": {**r["env"], **env}}
    if matmul is not None:
        out["env"]["matmul_tflops"] = matmul
    return out


def test_a_change_within_the_pairs_noise_is_the_same_and_beyond_it_worse(base, tmp_path):
    """The verdict's threshold is the two medians' measured noise: -10% between points whose step
    times spread over +-15% is noise; the same -10% between steady points is worse."""
    noisy = [1.0, 0.85, 1.15, 0.9, 1.1]
    steady = [1.0, 1.01, 0.99, 1.0, 1.005]
    for times, verdict in ((noisy, "same"), (steady, "worse")):
        b, n = tmp_path / f"b{verdict}", tmp_path / f"n{verdict}"
        write(b, "a", timed(result("megatrain", 4, tflops=300.0), times))
        write(n, "a", timed(result("megatrain", 4, tflops=270.0), times))
        report = compare.compare(b, n, threshold=0.05)
        row = next(r for r in report["rows"] if r["metric"] == "model_tflops")
        assert row["verdict"] == verdict and report["regressed"] == (verdict == "worse")
        assert row["threshold"] > 0.2 if times is noisy else row["threshold"] == 0.05


def test_smoke_points_are_never_judged_on_speed(base, tmp_path):
    b, n = tmp_path / "b", tmp_path / "n"
    def smoke(r):
        return {**r, "spec": {**r["spec"], "smoke": True}}
    write(b, "a", smoke(result("megatrain", 4, tflops=300.0)))
    write(n, "a", smoke(result("megatrain", 4, tflops=100.0)))
    report = compare.compare(b, n)
    assert verdicts(report)[("megatrain", "model_tflops")] == "smoke: not judged" and not report["regressed"]


def test_another_machine_is_judged_by_the_speed_in_its_own_units(base, tmp_path, capsys):
    """On a machine with a 1.5x matmul rate, a point 1.2x faster is the code 20% slower per the
    matmul yardstick: a regression across machines; 1.5x faster is the same code."""
    steady = [1.0, 1.01, 0.99, 1.0, 1.005]
    b = tmp_path / "b"
    write(b, "a", timed(result("megatrain", 4, tflops=300.0), steady, matmul=600.0) | {"env": {**H100, "matmul_tflops": 600.0}})
    for rate, slower in ((360.0, True), (450.0, False)):
        n = tmp_path / f"n{rate}"
        write(n, "a", timed(result("megatrain", 4, tflops=rate) | {"env": {**H200, "matmul_tflops": 900.0}}, steady))
        report = compare.compare(b, n)
        row = next(r for r in report["rows"] if r["metric"] == "model_tflops")
        assert row["machine_differs"] and report["regressed"] == slower, row
        assert row["verdict"].startswith("code slower per fraction of the matmul rate") if slower else "code same" in row["verdict"]
    assert compare.main(str(b), str(tmp_path / "n360.0"), 0.05, compare.DEFAULT_METRICS) == 1
    assert "REGRESSION" in capsys.readouterr().out


def test_one_run_under_two_names_pairs_once(base, tmp_path):
    """A grid's `same_as` files one run under a second point whose spec names the model otherwise
    (`layers: 28` of a 28-layer preset): it is one pair, not two."""
    times = [1.0, 1.01, 0.99]
    b, n = tmp_path / "b", tmp_path / "n"
    one = timed(result("megatrain", 4), times)
    two = {**one, "spec": {**one["spec"], "model": {"preset": "qwen2.5-3b", "overrides": {"num_hidden_layers": 36}}}}
    for folder in (b, n):
        write(folder, "a", one)
        write(folder, "a_copy", two)
    report = compare.compare(b, n)
    assert len({r["point"] for r in report["rows"]}) == 1
    assert any("the same runs as a pair already compared" in s for s in report["skipped"])


def test_settings_resolved_differently_are_named_on_the_row(base, tmp_path, capsys):
    b, n = tmp_path / "b", tmp_path / "n"
    engine = {"device": "cuda:0", "optimizer_kernel": "compiled", "grad_slabs": 8}
    write(b, "a", result("megatrain", 4) | {"info": {"engine": engine}})
    write(n, "a", result("megatrain", 4) | {"info": {"engine": {**engine, "optimizer_kernel": "eager"}}})
    report = compare.compare(b, n)
    assert report["rows"][0]["resolved"] == ["optimizer_kernel compiled->eager"]
    compare.main(str(b), str(n), 0.05, compare.DEFAULT_METRICS)
    assert "resolved differently: optimizer_kernel compiled->eager" in capsys.readouterr().out


def test_a_link_bound_point_on_another_machine_is_judged_by_its_link(base, tmp_path):
    """A point whose step is its bytes over the link (20 GB up, 10 GB down a step on a 25 GB/s link:
    0.8 of its 1 s) moved to a machine of a 1.5x matmul and a 2x link: half the step is the same
    code, though the matmul yardstick alone would call it faster; 0.8 of the step is the code slower."""
    steady = [1.0, 1.01, 0.99, 1.0, 1.005]
    link = {"bytes_h2d": 20e9, "bytes_d2h": 10e9}

    def point(step: float, env: dict, matmul: float, gbps: float) -> dict:
        r = result("megatrain", 4, tflops=100.0 / step)
        r["median"] |= {"step_time_s": step, **link}
        return timed(r | {"env": env}, [step * t for t in steady], matmul, h2d_gbps=gbps, d2h_gbps=gbps)

    b = tmp_path / "b"
    write(b, "a", point(1.0, H100, 600.0, 25.0))
    assert compare.normalised(json.loads((b / "a.json").read_text())) == pytest.approx(
        ("fraction of its matmul or link bound", 0.8))
    for step, slower in ((0.5, False), (0.8, True)):
        n = tmp_path / f"n{step}"
        write(n, "a", point(step, H200, 900.0, 50.0))
        row = next(r for r in compare.compare(b, n)["rows"] if r["metric"] == "model_tflops")
        assert row["verdict"].startswith("code slower per fraction of its matmul or link bound") if slower \
            else "code same" in row["verdict"], row
    # a side without the link's rates: both judged by the matmul rate alone
    old = point(1.0, H100, 600.0, 25.0)
    del old["env"]["h2d_gbps"]
    write(tmp_path / "old", "a", old)
    row = next(r for r in compare.compare(tmp_path / "old", tmp_path / "n0.5")["rows"] if r["metric"] == "model_tflops")
    assert "fraction of the matmul rate" in row["verdict"], row

"""The paper's numbers as data (workflows/paper/): every file validates, and spot checks against the
paper text (arXiv 2604.05091) catch a mistyped number."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("paper_data", ROOT / "workflows" / "paper.py")
paper = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(paper)

EXPECTED = {
    "table1_memory_hierarchy": "Table 1", "table2_models": "Table 2", "table3_accuracy": "Table 3",
    "table4_ablations": "Table 4", "table5_depth": "Table 5", "table6_width": "Table 6",
    "table7_context": "Table 7", "table8_pcie_systems": "Table 8", "table9_consumer_gpus": "Table 9",
    "figure1_scale": "Figure 1", "figure4_host_memory": "Figure 4", "figure5_depth": "Figure 5",
    "figure6_width": "Figure 6", "figure7_devices": "Figure 7", "appendix_b_ratel": "Appendix B table",
}


def one(rows: list[dict], **match) -> dict:
    hits = [r for r in rows if all(r.get(k) == v for k, v in match.items())]
    assert len(hits) == 1, (match, hits)
    return hits[0]


@pytest.mark.parametrize("path", paper.files(), ids=lambda p: p.stem)
def test_every_file_loads_and_validates(path):
    data = paper.load(path)
    assert data["artefact"] == EXPECTED[path.stem]


def test_every_artefact_has_a_file():
    assert {p.stem for p in paper.files()} == set(EXPECTED)


def test_validation_names_the_file_and_the_problem(tmp_path):
    good = yaml.safe_load((paper.PAPER_DIR / "appendix_b_ratel.yaml").read_text(encoding="utf-8"))
    bad_row = dict(good, rows=[{"model": "7B", "tflop": 2.03}])
    no_hw = {k: v for k, v in good.items() if k != "hardware"}
    for name, data, problem in [("bad_row.yaml", bad_row, "undeclared columns ['tflop']"),
                                ("no_hw.yaml", no_hw, "missing required keys ['hardware']")]:
        f = tmp_path / name
        f.write_text(yaml.safe_dump(data, allow_unicode=True), encoding="utf-8")
        with pytest.raises(ValueError, match=r"no_hw|bad_row") as err:
            paper.load(f)
        assert name in str(err.value) and problem in str(err.value)


def test_ratios_agree_with_the_values_beside_them():
    # The paper prints ratios to two decimals, sometimes truncated (295/174 = 1.695 -> "1.69").
    checked = 0
    for stem in ("figure5_depth", "figure6_width", "figure7_devices"):
        rows = paper.load(stem)["rows"]
        for r in rows:
            if r.get("ratio") is None:
                continue
            x = {k: r[k] for k in ("panel", "layers", "width_scale", "model") if k in r}
            q = "host_memory_GB" if r.get("panel") == "b" else "tflops"
            a = [s[q] for s in rows if s["system"] == r["system"] and s.get(q) is not None
                 and all(s.get(k) == v for k, v in x.items())]
            b = [s[q] for s in rows if s["system"] == r["versus"] and s.get(q) is not None
                 and all(s.get(k) == v for k, v in x.items())]
            if a and b:
                assert a[0] / b[0] == pytest.approx(r["ratio"], abs=0.006), (stem, r)
                checked += 1
    assert checked == 13


def test_headline_claims():
    fig1 = paper.load("figure1_scale")["rows"]
    assert one(fig1, hardware="GH200", system="MegaTrain", model="7B", ratio=None)["tflops"] == 284
    assert one(fig1, model="14B", versus="ZeRO-3 Offload")["ratio"] == 1.84
    t7 = paper.load("table7_context")["rows"]
    assert one(t7, context_K=1)["tflops"] == 284.7
    assert one(t7, context_K=512) == {"context_K": 512, "mark": "∗", "batch_size": 1, "tokens_K": 524.3,
                                      "step_s": 871.4, "tflops": 407.4, "mem_GB": 81.9}


def test_spot_checks_from_the_tables():
    t3 = paper.load("table3_accuracy")["rows"]
    assert one(t3, model="14B")["pytorch_native"] == "-"
    assert one(t3, model="7B")["megatrain"] == 88.99
    t4 = paper.load("table4_ablations")["rows"]
    assert one(t4, configuration="MegaTrain (full)")["tflops"] == 266.3
    assert one(t4, configuration="w/ Checkpoint Interval=1")["batch_size"] == "64 (96 OOM)"
    t5 = paper.load("table5_depth")["rows"]
    assert [r["params_B"] for r in t5] == [7.62, 10.88, 14.14, 20.67, 31.85, 43.04]
    t9 = paper.load("table9_consumer_gpus")["rows"]
    assert one(t9, gpu="RTX A6000", model="Qwen2.5-14B", method="MegaTrain")["tflops"] == 56.82
    assert one(t9, gpu="RTX 3090", model="Qwen2.5-14B", method="ZeRO-3 Offload")["tflops"] == "OOM"
    fig7 = paper.load("figure7_devices")["rows"]
    assert one(fig7, system="MegaTrain", model="32B")["tflops"] == 114


def test_figure_without_printed_numbers_has_no_rows():
    assert paper.load("figure4_host_memory")["rows"] == []


def test_appendix_b_matches_baselines_json():
    printed = json.loads((ROOT / "baselines" / "paper_ratel.json").read_text(encoding="utf-8"))
    from_json = {e["model"]: e["value"] for e in printed["entries"]}
    from_yaml = {r["model"]: r["tflops"] for r in paper.load("appendix_b_ratel")["rows"]}
    assert from_yaml == from_json == {"7B": 2.03, "14B": 10.90, "32B": 10.91}


def test_rows_are_labelled_paper():
    pytest.importorskip("pandas")
    for path in paper.files():
        df = paper.rows(path)
        assert len(df) == len(paper.load(path)["rows"])
        assert (df["source"] == "paper").all()
    df = paper.rows("table2_models")
    assert list(df.columns) == ["model", "total_params_B", "layers", "hidden_size", "ffn_size",
                                "artefact", "source"]

"""The workflow's Table 1 and Table 2 without running Snakemake: Table 2's parameter counts from our
presets, Table 1's rows from a synthetic probe JSON, and computed/measured rows kept apart from the
paper's printed ones."""
from __future__ import annotations

import json

import pytest

pd = pytest.importorskip("pandas")

from workflows.scripts import memory_table, model_table  # noqa: E402


def test_table2_qwen25_7b_counts():
    row = model_table.computed_row("Qwen2.5-7B")
    # Embedding and LM head are untied, so both count; the matmul N leaves out the embedding lookup
    # and the norms (a lookup is no matmul FLOP).
    assert row["status"] == "ok" and row["preset"] == "qwen2.5-7b"
    assert row["total_params"] == 7_615_616_512
    assert round(row["total_params_B"], 2) == 7.62
    assert row["matmul_params"] == 7_070_285_824
    assert (row["layers"], row["hidden_size"], row["heads"], row["kv_heads"], row["ffn_size"], row["vocab_size"]) \
        == (28, 3584, 28, 4, 18944, 152064)


def test_table2_rows_apart_and_unknown_model_kept():
    df = model_table.table()
    ours, ref = df[df["source"] == "computed"], df[df["source"] == "paper"]
    assert list(ours["model"]) == list(ref["model"])  # one computed row per model the paper lists
    moe = ours[ours["model"].str.startswith("GPT-OSS")].iloc[0]
    # the paper prints hidden and FFN as "per-expert width times experts" (2880×128); 116.8 B is its "120"
    assert moe["status"] == "ok" and (moe["layers"], moe["hidden_size"], moe["ffn_size"]) == (36, 2880, 2880)
    assert round(moe["total_params_B"], 1) == 116.8
    assert ref["total_params"].isna().all() and ref["status"].isna().all()  # nothing computed leaks in
    # The computed shapes agree with the printed ones wherever the paper prints plain numbers.
    dense = ref[ref["hidden_size"].astype(str).str.isdigit()]
    both = ours[ours["status"] == "ok"].merge(dense, on="model", suffixes=("", "_paper"))
    assert len(both) == len(dense)
    for col in ("layers", "hidden_size", "ffn_size"):
        assert (both[col].astype(int) == both[f"{col}_paper"].astype(int)).all(), col
    unknown = model_table.computed_row("Unheard-1T (MoE)")  # a model without a preset stays a row
    assert unknown["status"] == "paper_only" and unknown["reason"] and "total_params" not in unknown
    assert "Computed" in model_table.markdown(df) and "## Paper" in model_table.markdown(df)


PROBE = {"probe": "bandwidth", "config": {"quick": True},
         "tiers": [
             {"tier": "host", "direction": "copy", "status": "ok", "gbps": 12.5, "bytes": 2 << 20,
              "counts": "read+write", "repeats": 3, "method": "copy_", "median_s": 1.6e-4},
             {"tier": "hbm", "direction": "device-to-device", "status": "absent", "reason": "no CUDA device",
              "gbps": None, "bytes": None, "repeats": 0, "method": None},
             {"tier": "disk", "direction": "read", "status": "error", "reason": "OSError: boom",
              "gbps": None, "bytes": None, "repeats": 0, "method": None}]}


def test_table1_measured_and_paper_rows_apart(tmp_path):
    df = memory_table.table(PROBE, "testbox")
    ours, ref = df[df["source"] == "measured"], df[df["source"] == "paper"]
    assert list(zip(ours["tier"], ours["status"])) == [("host", "ok"), ("hbm", "absent"), ("disk", "error")]
    assert ours["measured_GB_per_s"].iloc[0] == 12.5 and ours["measured_GB_per_s"].iloc[1:].isna().all()
    assert ours["reason"].iloc[1] == "no CUDA device"
    assert len(ref) == 8 and ref["measured_GB_per_s"].isna().all() and ref["status"].isna().all()
    assert ours["bandwidth"].isna().all()  # the paper's printed bandwidth never lands on a measured row

    probe = tmp_path / "bandwidth.json"
    probe.write_text(json.dumps(PROBE))
    csv, md = tmp_path / "t1.csv", tmp_path / "t1.md"
    assert memory_table.main(["--hardware", "testbox", "--csv", str(csv), "--md", str(md), str(probe)]) == 0
    back = pd.read_csv(csv)
    assert list(back["source"]) == ["measured"] * 3 + ["paper"] * 8
    text = md.read_text()
    measured_part, paper_part = text.split("## Paper")
    assert "12.5" in measured_part and "--quick" in measured_part and "absent" in measured_part
    assert "4.8 TB/s" in paper_part and "4.8 TB/s" not in measured_part

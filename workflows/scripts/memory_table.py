"""The paper's Table 1 (memory hierarchy): the bandwidth probe's tiers as measured, the paper's rows apart.

    python -m workflows.scripts.memory_table --hardware H --csv OUT.csv --md OUT.md BANDWIDTH.json

One row per tier and direction of experiments/probes/bandwidth.py's JSON, measured or not (a tier
this machine lacks keeps its row with status "absent" and the reason). Measured rows carry
source="measured"; the paper's rows (vendor specifications of H200 SXM and GH200, not
measurements) keep their own columns and source="paper", so no bandwidth is ever compared across
the two by sharing a column.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pandas as pd

from megatrain.io import atomic_file, write_text
from workflows.scripts.aggregate import md_table

ARTEFACT = "table1_memory_hierarchy"
MEASURED_COLUMNS = ["source", "hardware", "tier", "direction", "status", "measured_GB_per_s", "paper_tier",
                    "counts", "bytes", "repeats", "median_s", "reason", "method"]
# The probe's tier -> the rows of the paper's Table 1 it corresponds to (the paper's tier names).
PAPER_TIER = {"host": "Host DDR5 / Host LPDDR5X", "hbm": "HBM3e / HBM3 (per GPU)",
              "pcie": "PCIe Gen5 link", "disk": "NVMe SSD"}


def measured(probe: dict, hardware: str) -> pd.DataFrame:
    """The probe's tiers as rows, in the probe's order."""
    rows = [{"source": "measured", "hardware": hardware, "tier": t["tier"], "direction": t["direction"],
             "status": t["status"], "measured_GB_per_s": t.get("gbps"), "paper_tier": PAPER_TIER.get(t["tier"]),
             "counts": t.get("counts"), "bytes": t.get("bytes"), "repeats": t.get("repeats"),
             "median_s": t.get("median_s"), "reason": t.get("reason"), "method": t.get("method")}
            for t in probe["tiers"]]
    return pd.DataFrame(rows, columns=MEASURED_COLUMNS).astype({"bytes": "Int64", "repeats": "Int64"})


def table(probe: dict, hardware: str, paper: str | None = ARTEFACT) -> pd.DataFrame:
    """Measured rows, then the paper artefact's rows (their own columns; source="paper")."""
    df = measured(probe, hardware)
    if paper:
        from workflows.paper import rows
        df = pd.concat([df, rows(paper)], ignore_index=True, sort=False)
        df = df.astype({"bytes": "Int64", "repeats": "Int64"})
    return df


def markdown(df: pd.DataFrame, hardware: str, quick: bool) -> str:
    """The measured rows and the paper's rows as two separate Markdown tables."""
    ours = df[df["source"] == "measured"][MEASURED_COLUMNS].drop(columns=["source", "hardware", "method"])
    mode = " (--quick: small buffers, few repetitions)" if quick else ""
    out = ["# Table 1: memory hierarchy", "", f"## Measured on {hardware}{mode}", "",
           "GB/s = 1e9 bytes/s of `bytes`, which `counts` describes; median of `repeats` timed repetitions.", "",
           md_table(ours)]
    ref = df[df["source"] == "paper"]
    if len(ref):
        own = [c for c in ref.columns if c not in MEASURED_COLUMNS + ["artefact"]]
        cols = [c for c in own[:1] + ["tier"] + own[1:] if ref[c].notna().any()]  # platform, tier, ...
        out += ["", f"## Paper ({ref['artefact'].iloc[0]}; vendor specifications of H200 SXM and GH200, "
                f"not {hardware})", "", md_table(ref[cols], printed=True)]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m workflows.scripts.memory_table", description=__doc__)
    p.add_argument("--hardware", required=True)
    p.add_argument("--paper", default=ARTEFACT, help="workflows/paper artefact (file stem) to append")
    p.add_argument("--csv", required=True)
    p.add_argument("--md", required=True)
    p.add_argument("probe", help="the bandwidth probe's JSON")
    a = p.parse_args(argv)
    probe = json.loads(Path(a.probe).read_text())
    df = table(probe, a.hardware, a.paper)
    with atomic_file(a.csv) as tmp:
        df.to_csv(tmp, index=False)
    write_text(a.md, markdown(df, a.hardware, bool((probe.get("config") or {}).get("quick"))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

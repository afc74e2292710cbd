"""One experiment's result JSONs -> a tidy table (CSV and Markdown), the paper's rows appended apart.

    python -m workflows.scripts.aggregate --experiment E --hardware H [--paper ARTEFACT] \
        --csv OUT.csv --md OUT.md RESULT.json ...

Measured rows carry source="measured"; the paper's rows (workflows.paper.rows) keep their own
columns and source="paper", so the two never share a number column by accident.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pandas as pd

GiB = 2 ** 30
MEASURED_COLUMNS = ["source", "experiment", "id", "system", "preset", "layers", "batch", "accum", "seq",
                    "status", "reason", "model_tflops", "step_time_s", "tokens_per_s", "params",
                    "peak_host_GiB", "peak_device_GiB", "host_bytes_per_param"]

INTEGER_COLUMNS = ["layers", "batch", "accum", "seq", "params"]


def flatten(result: dict, point_id: str, experiment: str) -> dict:
    """One harness result (suite.runner's JSON) as one row."""
    spec, med, peak = result["spec"], result.get("median") or {}, result.get("peak") or {}
    model = spec.get("model") or {}
    host, device, params = peak.get("host_rss_bytes"), peak.get("device_allocated_bytes"), result.get("params")
    reason = result.get("reason")
    return {
        "source": "measured", "experiment": experiment, "id": point_id, "system": result["system"],
        "preset": model.get("preset") or model.get("config"),
        "layers": (model.get("overrides") or {}).get("num_hidden_layers"),
        "batch": spec["batch_size"], "accum": spec["grad_accum"], "seq": spec["seq_len"],
        "status": result["status"],
        "reason": " ".join(reason.split())[:300] if reason else None,
        "model_tflops": med.get("model_tflops"), "step_time_s": med.get("step_time_s"),
        "tokens_per_s": med.get("tokens_per_s"), "params": params,
        "peak_host_GiB": host / GiB if host else None,
        "peak_device_GiB": device / GiB if device else None,
        "host_bytes_per_param": host / params if host and params else None,
    }


def measured(paths: list[str | Path], experiment: str) -> pd.DataFrame:
    rows = [flatten(json.loads(Path(p).read_text()), Path(p).stem, experiment) for p in paths]
    df = pd.DataFrame(rows, columns=MEASURED_COLUMNS)
    return df.astype({c: "Int64" for c in INTEGER_COLUMNS})


def table(paths: list[str | Path], experiment: str, paper: str | None = None) -> pd.DataFrame:
    """Measured rows, then the paper artefact's rows (its own columns; source="paper")."""
    df = measured(paths, experiment)
    if paper:
        from workflows.paper import rows
        ref = rows(paper).assign(experiment=experiment)
        df = pd.concat([df, ref], ignore_index=True, sort=False)
        df = df.astype({c: "Int64" for c in INTEGER_COLUMNS})  # concat turns missing ints to float
    return df


def _cell(v) -> str:
    if v is None or (not isinstance(v, str) and pd.isna(v)):
        return ""
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v).replace("|", "/")


def _md(df: pd.DataFrame) -> str:
    cols = [c for c in df.columns if df[c].notna().any()]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in df[cols].itertuples(index=False)]
    return "\n".join(lines)


def markdown(df: pd.DataFrame, experiment: str, hardware: str) -> str:
    """The measured rows and the paper's rows as two separate Markdown tables."""
    out = [f"# {experiment} ({hardware})", "", f"## Measured ({hardware})", "",
           _md(df[df["source"] == "measured"][MEASURED_COLUMNS].drop(columns=["source", "experiment"]))]
    ref = df[df["source"] == "paper"]
    if len(ref):
        paper_cols = [c for c in ref.columns if c not in MEASURED_COLUMNS or c in ("system", "layers")]
        out += ["", f"## Paper ({ref['artefact'].iloc[0]}; its hardware, not {hardware})", "",
                _md(ref[[c for c in paper_cols if c != "artefact"]])]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m workflows.scripts.aggregate", description=__doc__)
    p.add_argument("--experiment", required=True)
    p.add_argument("--hardware", required=True)
    p.add_argument("--paper", help="workflows/paper artefact (file stem) to append")
    p.add_argument("--csv", required=True)
    p.add_argument("--md", required=True)
    p.add_argument("results", nargs="+")
    a = p.parse_args(argv)
    df = table(a.results, a.experiment, a.paper)
    df.to_csv(a.csv, index=False)
    Path(a.md).write_text(markdown(df, a.experiment, a.hardware))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

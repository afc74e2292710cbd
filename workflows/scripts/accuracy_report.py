"""The accuracy experiment's summary (suite.accuracy.experiment) -> Table 3 and the loss curves.

    python -m workflows.scripts.accuracy_report --summary S.json --hardware H --csv T.csv --md T.md \
        --png F.png --pdf F.pdf

Table 3: one measured row per system (untrained first) with its status, exact-match accuracy,
steps and largest per-step loss gap to native; the paper's printed rows (7B and 14B on
MetaMathQA) follow as a table of their own, never in the measured columns. The figure overlays the
systems' loss curves and, below, each system's loss minus native's at every step.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pandas as pd

from megatrain.io import atomic_file, save_figure, write_text
from workflows.paper import rows as paper_rows
from workflows.scripts import outputs
from workflows.scripts.aggregate import md_table

PAPER = "table3_accuracy"


def measured(summary: dict) -> pd.DataFrame:
    s = summary["settings"]
    task = f"MetaMathQA file ({s['metamath']})" if s.get("metamath") else f"generated arithmetic ({s['problems']} problems)"
    model = s.get("pretrained") or f"llama {s['model']}"
    out = []
    for system, row in summary["systems"].items():
        gap = summary["loss_gap_to_native"].get(system, {})
        out.append({"source": "measured", "system": system, "status": row["status"],
                    "accuracy_pct": 100 * row["accuracy"] if "accuracy" in row else None,
                    "correct": row.get("correct"), "evaluated": row.get("evaluated"),
                    "steps": 0 if system == "untrained" else len(row.get("losses") or []),
                    "max_loss_gap_to_native": gap.get("max_abs"), "max_rel_loss_gap_to_native": gap.get("max_rel"),
                    "model": model, "task": task, "reason": row.get("reason")})
    return pd.DataFrame(out)


def _gap(largest: dict) -> str:
    return f"{largest['max_abs']:.3f} nats/token ({largest['system']})" if largest.get("system") else "none (no system beside native)"


def markdown(ours: pd.DataFrame, paper: pd.DataFrame, hardware: str, summary: dict) -> str:
    largest = summary["largest_loss_gap"]
    head = [f"# Table 3: accuracy ({hardware})", "",
            f"Same initial weights, data order and hyper-parameters for every system; exact match of the "
            f"final answer, greedy decoding, {summary['evaluated']} held-out problems. Largest per-step loss "
            f"gap to native: {_gap(largest)}.", "",
            f"## Measured ({hardware})", "", md_table(ours.drop(columns=["source"]))]
    cols = [c for c in paper.columns if c not in ("source", "artefact")]
    return "\n".join(head + ["", "## Paper (Table 3; Qwen2.5 on MetaMathQA, its hardware, not ours)", "",
                             md_table(paper[cols], printed=True)]) + "\n"


def figure(summary: dict, hardware: str):
    systems = {k: v["losses"] for k, v in summary["systems"].items() if v.get("losses")}
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True, height_ratios=(2, 1))
    color = {system: f"C{i}" for i, system in enumerate(systems)}  # one colour per system in both panels
    for system, losses in systems.items():
        top.plot(range(1, len(losses) + 1), losses, label=system, linewidth=1, color=color[system])
    ref = systems.get("native")
    if ref:
        for system, losses in systems.items():
            if system != "native":
                n = min(len(ref), len(losses))
                bottom.plot(range(1, n + 1), [losses[i] - ref[i] for i in range(n)], label=system, linewidth=1,
                            color=color[system])
    top.set(ylabel="training loss (cross-entropy, nats/token)",
            title=f"Loss curves, measured on {hardware} (same init, data order, hyper-parameters)")
    bottom.set(xlabel="optimizer step", ylabel="loss - native's loss")
    bottom.axhline(0, color="black", linewidth=0.5)
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m workflows.scripts.accuracy_report", description=__doc__)
    p.add_argument("--summary", required=True)
    p.add_argument("--hardware", required=True)
    p.add_argument("--csv", required=True)
    p.add_argument("--md", required=True)
    p.add_argument("--png", required=True)
    p.add_argument("--pdf", required=True)
    a = p.parse_args(argv)
    summary = json.loads(Path(a.summary).read_text())
    ours, paper = measured(summary), paper_rows(PAPER)
    with atomic_file(a.csv) as tmp:
        pd.concat([ours, paper], ignore_index=True, sort=False).to_csv(tmp, index=False)
    write_text(a.md, markdown(ours, paper, a.hardware, summary))
    fig = figure(summary, a.hardware)
    save_figure(fig, a.png, a.pdf)
    outputs.record([a.png, a.pdf], [a.summary], [__file__])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

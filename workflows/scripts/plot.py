"""One experiment's table (workflows.scripts.aggregate's CSV) -> a PNG and a PDF figure.

    python -m workflows.scripts.plot --csv T.csv --experiment E --hardware H --png F.png --pdf F.pdf

How an experiment is drawn comes from aggregate.EXPERIMENTS (x axis, its label, line or bars, the
panels and the paper's matching columns); an unknown experiment gets bars of TFLOP/s per point id.
Measured points are filled markers with solid lines, labelled "measured (<hardware>)"; the paper's
are open black markers with dashed lines, a marker shape per system (or hatched open bars), labelled
"paper (<its hardware>)[: <system>]".
Points that did not run (out of memory, timeout, unsupported) are red crosses on the axis floor
with their status. The paper's memory (printed in GB, 10^9 bytes) is drawn in GiB like ours.
"""
from __future__ import annotations

import argparse
import textwrap

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")  # files only; no display on the workflow's machines
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from megatrain.io import save_figure
from megatrain.units import GB_PER_GiB
from workflows.scripts.aggregate import Experiment, experiment

MEASURED = dict(marker="o", linestyle="-")
PAPER = dict(marker="s", linestyle="--", markerfacecolor="none", color="black")
PAPER_MARKERS = ("s", "^", "D", "v", "P", "X")  # one per system the paper prints in a panel
LEGEND_COLUMNS = 3
YLABELS = {"model_tflops": "throughput (model TFLOP/s)", "peak_host_GiB": "peak host memory (GiB)",
           "peak_device_GiB": "peak device memory (GiB)"}
TITLES = {"model_tflops": "Throughput", "peak_host_GiB": "Host memory", "peak_device_GiB": "Device memory"}


def _tick(value: float, _) -> str:
    """Tick labels: sequence lengths as 1K..512K (powers of two), other values to three digits."""
    if value >= 1024 and value % 1024 == 0:
        return f"{value / 1024:g}K"
    return f"{value:.3g}"


def _split(df: pd.DataFrame):
    return df[df["source"] == "measured"], df[df["source"] == "paper"]


def _paper_y(paper: pd.DataFrame, spec: Experiment, y: str) -> pd.Series | None:
    """The paper's value of measured column `y` (GB converted to GiB), or None if it prints none."""
    col = spec.paper_y.get(y)
    if col is None or col not in paper or "x" not in paper:
        return None
    v = pd.to_numeric(paper[col], errors="coerce")  # "OOM", "–" -> NaN: printed, not plotted
    return v / GB_PER_GiB if y.endswith("_GiB") else v


def _failed(ax, rows: pd.DataFrame):
    """A red cross at zero for each point that did not run; `_failed_note` says which and why."""
    bad = rows[(rows["status"] != "ok") & rows["x"].notna()]
    if len(bad):
        ax.scatter(bad["x"], [0] * len(bad), marker="x", color="red", zorder=3,
                   label="did not run (see the note below)")


def _failed_note(rows: pd.DataFrame, label: str) -> str:
    """One line per system and status of the points that did not run, with their x values."""
    bad = rows[rows["status"] != "ok"]
    parts = []
    for (system, status), g in bad.groupby(["system", "status"], sort=True):
        xs = ", ".join(f"{x:.3g}" if isinstance(x, float) else str(x) for x in g["x"])
        parts.append(f"{system} {status} at {xs}")
    return f"did not run (x: {label}): " + "; ".join(parts) if parts else ""


def _series(rows: pd.DataFrame, spec: Experiment) -> pd.Series:
    """One line per system; where points of one experiment run at different depths (Table 7's
    longest contexts on fewer layers) and depth is not the x axis, one line per system and depth."""
    layers = rows["layers"].dropna() if "layers" in rows else pd.Series(dtype=object)
    if spec.x == "layers" or layers.nunique() + rows["layers"].isna().any() <= 1:
        return rows["system"]
    depth = rows["layers"].map(lambda n: "all layers" if pd.isna(n) else f"{int(n)} layer{'s' * (n != 1)}")
    return rows["system"] + " (" + depth + ")"


def lines(df: pd.DataFrame, spec: Experiment, hardware: str):
    """One panel per quantity; one line per system over the experiment's x."""
    ours, paper = _split(df)
    ours = ours.assign(x=pd.to_numeric(ours["x"], errors="coerce"))
    paper = paper.assign(x=pd.to_numeric(paper["x"], errors="coerce")) if "x" in paper else paper
    fig, axes = plt.subplots(1, len(spec.panels), figsize=(4.7 * len(spec.panels), 4.2), squeeze=False)
    axes = list(axes[0])
    named = paper["system"].dropna().unique() if "system" in paper else ()
    markers = {"": PAPER_MARKERS[0]} | {s: PAPER_MARKERS[i % len(PAPER_MARKERS)] for i, s in enumerate(named)}
    for ax, y in zip(axes, spec.panels):
        ok = ours[(ours["status"] == "ok") & ours[y].notna() & ours["x"].notna()].sort_values("x")
        for system, g in ok.groupby(_series(ok, spec)):
            ax.plot(g["x"], g[y], label=f"measured ({hardware}): {system}", **MEASURED)
        _failed(ax, ours)
        ref_y = _paper_y(paper, spec, y)
        if ref_y is not None:
            ref = paper.assign(y=ref_y).dropna(subset=["x", "y"]).sort_values("x")
            systems = ref["system"].fillna("") if "system" in ref else pd.Series("", index=ref.index)
            for system, g in ref.groupby(systems, sort=False):
                label = f"paper ({spec.paper_hardware})" + (f": {system}" if system else "")
                ax.plot(g["x"], g["y"], label=label, **{**PAPER, "marker": markers[system]})
        ax.set(xlabel=spec.label, ylabel=YLABELS[y], title=f"{TITLES[y]} by {spec.label.split(' (')[0]}")
        if spec.log_x and (ax.has_data() and (ours["x"].dropna() > 0).all()):
            ax.set_xscale("log")
            # ticks at the measured x values (a log axis over 3-33 would label only 10), and at the
            # paper's where none of ours is near (its 7B beside our 7.62 would overprint)
            ticks = set(ours["x"].dropna())
            theirs = paper["x"].dropna() if "x" in paper else ()
            ticks = sorted(ticks | {x for x in theirs if all(abs(np.log(x / t)) > 0.15 for t in ticks)})
            ax.set_xticks(ticks if len(ticks) <= 12 else ticks[:: -(-len(ticks) // 12)])
            ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(_tick))
            ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    return fig, axes


def bars(df: pd.DataFrame, spec: Experiment, hardware: str):
    """One horizontal bar per measured point (labelled by the experiment's x), then the paper's
    rows as open hatched bars below; a point that did not run is a red status note at zero."""
    ours, paper = _split(df)
    labels = [f"measured: {i}" if str(x) == str(i) else f"measured: {x} ({i})" for x, i in zip(ours["x"], ours["id"])]
    n = len(ours)
    paper_rows = pd.concat([paper.assign(_y=_paper_y(paper, spec, y)) for y in spec.panels]) if len(paper) else paper
    keep = paper_rows.dropna(subset=["_y"]).index.unique() if len(paper_rows) else []
    paper = paper.loc[keep] if len(paper) else paper
    labels += [f"paper: {v}" for v in paper["x"].astype(str)] if len(paper) else []
    fig, axes = plt.subplots(1, len(spec.panels), figsize=(5.5 * len(spec.panels), 0.35 * len(labels) + 1.8),
                             squeeze=False, sharey=True)
    axes = list(axes[0])
    for ax, y in zip(axes, spec.panels):
        vals = pd.to_numeric(ours[y], errors="coerce").where(ours["status"] == "ok")
        ax.barh(range(n), vals.fillna(0), label=f"measured ({hardware})")
        for i, (status, v) in enumerate(zip(ours["status"], vals)):
            if status != "ok":
                ax.annotate(status, (0, i), xytext=(3, 0), textcoords="offset points", va="center",
                            fontsize=7, color="red")
        ref_y = _paper_y(paper, spec, y)
        if ref_y is not None and len(paper):
            ax.barh(range(n, n + len(paper)), ref_y.fillna(0), fill=False, hatch="//", edgecolor="black",
                    label=f"paper ({spec.paper_hardware})")
        ax.set(xlabel=YLABELS[y], title=TITLES[y])
    axes[0].set_yticks(range(len(labels)), labels, fontsize=7)
    axes[0].invert_yaxis()
    axes[0].set_ylabel(spec.label)
    return fig, axes


def figure(df: pd.DataFrame, name: str, hardware: str):
    spec = experiment(name)
    if "x" not in df:  # a table from before aggregate wrote `x`
        df = df.assign(x=df[spec.x] if spec.x in df else df["id"])
    fig, axes = (bars if spec.kind == "bars" else lines)(df, spec, hardware)
    entries: dict = {}  # one legend for the figure, below the panels (inside one, it covered data)
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            entries.setdefault(label, handle)
        ax.grid(alpha=0.3)
    width, height = fig.get_figwidth(), fig.get_figheight()  # inches
    # the texts wrapped to the width (about 13 characters an inch at size 10, 19 at size 7)
    fig.suptitle(textwrap.fill(f"{name}: measured on {hardware}; the paper's points are the paper's, not "
                               "measured here", int(13 * width)), fontsize=10)
    note = _failed_note(df[df["source"] == "measured"], spec.label) if spec.kind != "bars" else ""
    note_lines = textwrap.wrap(note, int(19 * width))
    note_in = 0.13 * len(note_lines) + (0.05 if note_lines else 0)
    legend_in = 0.17 * -(-len(entries) // LEGEND_COLUMNS) + 0.1
    fig.set_figheight(height + note_in + legend_in)
    total = fig.get_figheight()
    if entries:
        fig.legend(list(entries.values()), list(entries), loc="lower center", bbox_to_anchor=(0.5, note_in / total),
                   ncol=LEGEND_COLUMNS, fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, (note_in + legend_in) / total, 1, 1))
    if note_lines:
        fig.text(0.01, 0.01, "\n".join(note_lines), fontsize=7, color="red", va="bottom")
    return fig


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m workflows.scripts.plot", description=__doc__)
    p.add_argument("--csv", required=True)
    p.add_argument("--experiment", required=True)
    p.add_argument("--hardware", required=True)
    p.add_argument("--png", required=True)
    p.add_argument("--pdf", required=True)
    a = p.parse_args(argv)
    fig = figure(pd.read_csv(a.csv), a.experiment, a.hardware)
    save_figure(fig, a.png, a.pdf)
    plt.close(fig)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

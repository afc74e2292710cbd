"""One experiment's table (workflows.scripts.aggregate's CSV) -> a PNG and a PDF figure.

    python -m workflows.scripts.plot --csv T.csv --experiment E --hardware H --png F.png --pdf F.pdf

Measured points are filled circles joined by solid lines, labelled "measured (<hardware>)"; the
paper's are open squares with dashed lines, labelled "paper (GH200)". Points that did not run
(out of memory, timeout, unsupported) are drawn as crosses on the axis floor with their status.
"""
from __future__ import annotations

import argparse
import re

import matplotlib

matplotlib.use("Agg")  # files only; no display on the workflow's machines
import matplotlib.pyplot as plt
import pandas as pd

GB_PER_GiB = 2 ** 30 / 1e9
MEASURED = dict(marker="o", linestyle="-")
PAPER = dict(marker="s", linestyle="--", markerfacecolor="none", color="black")


def _split(df: pd.DataFrame):
    return df[df["source"] == "measured"], df[df["source"] == "paper"]


def _failed(ax, rows: pd.DataFrame, x: str):
    bad = rows[(rows["status"] != "ok") & rows[x].notna()]
    if len(bad):
        ax.scatter(bad[x], [0] * len(bad), marker="x", color="red", zorder=3, label="did not run (status)")
        for _, r in bad.iterrows():
            ax.annotate(r["status"], (r[x], 0), textcoords="offset points", xytext=(3, 4), fontsize=7,
                        color="red", rotation=45)


def _series(ax, rows: pd.DataFrame, x: str, y: str, hardware: str, by: str = "system"):
    ok = rows[(rows["status"] == "ok") & rows[y].notna()].sort_values(x)
    for key, g in ok.groupby(by):
        ax.plot(g[x], g[y], label=f"measured ({hardware}): {key}", **MEASURED)


def _size_b(model: str) -> float | None:
    m = re.fullmatch(r"\s*([\d.]+)\s*B\s*", str(model))
    return float(m.group(1)) if m else None


def scale(df: pd.DataFrame, hardware: str):
    ours, paper = _split(df)
    ours = ours.assign(params_B=ours["params"].astype(float) / 1e9)
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    _series(a, ours, "params_B", "model_tflops", hardware)
    _failed(a, ours, "params_B")
    ref = paper.assign(params_B=paper["model"].map(_size_b)).dropna(subset=["tflops"]) if len(paper) else paper
    if len(ref):
        a.plot(ref["params_B"], ref["tflops"], label="paper (GH200): MegaTrain", **PAPER)
    a.set(xscale="log", xlabel="model size (billion parameters)", ylabel="throughput (TFLOP/s)",
          title="Throughput by model size")
    _series(b, ours, "params_B", "peak_host_GiB", hardware)
    b.set(xscale="log", xlabel="model size (billion parameters)", ylabel="peak host memory (GiB)",
          title="Host memory by model size")
    return fig, (a, b)


def depth(df: pd.DataFrame, hardware: str):
    ours, paper = _split(df)
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    for ax, y, label in zip(axes, ("model_tflops", "peak_host_GiB", "peak_device_GiB"),
                            ("throughput (TFLOP/s)", "peak host memory (GiB)", "peak device memory (GiB)")):
        _series(ax, ours, "layers", y, hardware)
        ax.set(xlabel="decoder layers", ylabel=label)
    _failed(axes[0], ours, "layers")
    if len(paper) and "device_alloc_GB" in paper:
        ref = paper.dropna(subset=["device_alloc_GB"])
        # The paper prints GB; read as 10^9 bytes and drawn in GiB like our measurements.
        axes[2].plot(ref["layers"], ref["device_alloc_GB"] / GB_PER_GiB, label="paper (GH200): device alloc", **PAPER)
    axes[0].set_title("Throughput by depth")
    axes[1].set_title("Host memory by depth")
    axes[2].set_title("Device memory by depth")
    return fig, axes


def ablations(df: pd.DataFrame, hardware: str):
    ours, paper = _split(df)
    fig, ax = plt.subplots(figsize=(8, 0.45 * (len(ours) + len(paper)) + 1.5))
    labels, y = [], 0
    ok = ours[ours["status"] == "ok"]
    ax.scatter(ok["model_tflops"], range(len(ok)), label=f"measured ({hardware})", marker="o")
    labels += list(ok["id"])
    y = len(ok)
    if len(paper):
        ax.scatter(paper["tflops"], range(y, y + len(paper)), label="paper (GH200)", marker="s",
                   facecolors="none", edgecolors="black")
        labels += list(paper["configuration"])
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()
    ax.set(xlabel="throughput (TFLOP/s)", title="Ablations", xscale="log")
    return fig, [ax]


def generic(df: pd.DataFrame, hardware: str):
    ours, _ = _split(df)
    fig, ax = plt.subplots(figsize=(8, 4))
    ok = ours[ours["status"] == "ok"]
    ax.bar(ok["id"], ok["model_tflops"], label=f"measured ({hardware})")
    ax.set(xlabel="point", ylabel="throughput (TFLOP/s)")
    return fig, [ax]


PLOTS = {"scale": scale, "depth": depth, "ablations": ablations}


def figure(df: pd.DataFrame, experiment: str, hardware: str):
    fig, axes = PLOTS.get(experiment, generic)(df, hardware)
    for ax in axes:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.suptitle(f"{experiment}: measured on {hardware} vs the paper", fontsize=10)
    fig.tight_layout()
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
    fig.savefig(a.png, dpi=150)
    fig.savefig(a.pdf)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

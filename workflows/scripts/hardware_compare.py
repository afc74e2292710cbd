"""The same points on several machines, side by side -> a PNG and a PDF figure.

    python -m workflows.scripts.hardware_compare --title T --png F.png --pdf F.pdf h100=DIR h200=DIR ...

Each DIR is a folder of harness results (e.g. results/<hardware>/points/<experiment>). Points pair
up across machines by what was run (suite.compare.point_key), not by file name. One group of
horizontal bars per point (those every machine ran first), one bar per machine: its median model
TFLOP/s; the legend names each machine as its results' env does (GPU, cores, host memory). A point
that did not run there (out of memory, timeout, unsupported) is a hatched stub with its status, its
length a marker and not a value; a point the machine has no result for is marked "n/a".
"""
from __future__ import annotations

import argparse
import glob
import sys
import textwrap

import matplotlib

matplotlib.use("Agg")  # files only; no display on the workflow's machines
import matplotlib.pyplot as plt

from suite.compare import describe, load, point_label

from megatrain.io import save_figure
from workflows.scripts import outputs


def machines(hardware: list[str] | None, experiment: str, own: str) -> list[str]:
    """The machines to compare: those named, or, with none named, the profile's own and every
    machine with results of the experiment under results/ (by name)."""
    if hardware:
        return list(hardware)
    found = {path.split("/")[1] for path in glob.glob(f"results/*/points/{experiment}/*.json")}
    return sorted(found | {own})


def inputs(hardware: list[str], experiment: str, own: str, own_files: list[str]) -> list[str]:
    """The workflow's inputs: the profile's machine's points as the grid builds them, the others' as found."""
    files = []
    for hw in hardware:
        if hw == own:
            files += own_files
            continue
        found = sorted(glob.glob(f"results/{hw}/points/{experiment}/*.json"))
        if not found:
            raise ValueError(f"compare.hardware: no results in results/{hw}/points/{experiment}/; "
                             f"copy them from the {hw} machine or leave {hw} out of compare.hardware")
        files += found
    return files


def folder_args(hardware: list[str], experiment: str) -> str:
    return " ".join(f"{hw}=results/{hw}/points/{experiment}" for hw in hardware)


def collect(folders: dict[str, str]) -> tuple[list[str], dict[str, dict[str, dict]]]:
    """(point labels in order, {hardware: {label: result}}); files that are not results are reported."""
    by_hw = {}
    for hw, folder in folders.items():
        found, notes = load(folder)
        for note in notes:
            print(note, file=sys.stderr)
        by_hw[hw] = {point_label(r["spec"]): r for _, r in found.values()}
    labels = sorted({label for results in by_hw.values() for label in results})
    return labels, by_hw


def _wrapped(label: str, width: int = 48) -> str:
    """A point's label over lines of `width` characters, broken between its words."""
    return "\n".join(textwrap.wrap(label, width, break_long_words=False)) or label


def _machine(results: dict[str, dict]) -> str:
    """What a machine's results say it is (the GPU, cores, host memory), for the legend."""
    envs = sorted({describe(r.get("env")).split(", driver")[0] for r in results.values()})
    return "; ".join(envs) if envs else "no results"


def figure(labels: list[str], by_hw: dict[str, dict[str, dict]], title: str):
    """Horizontal bars: one group per point (the points every machine ran first), one bar per machine,
    the point's label wrapped beside its group."""
    n = max(len(by_hw), 1)
    shared = [lab for lab in labels if all(lab in res for res in by_hw.values())]
    ordered = shared + [lab for lab in labels if lab not in shared]
    wrapped = [_wrapped(lab) for lab in ordered]
    heights = [max(0.22 * n, 0.14 * w.count("\n") + 0.16) + 0.12 for w in wrapped]  # inches per group
    fig, ax = plt.subplots(figsize=(10.0, sum(heights) + 2.0))
    centres, y = [], 0.0
    for h in heights:
        centres.append(y + h / 2)
        y += h
    top = max([(r.get("median") or {}).get("model_tflops") or 0 for res in by_hw.values() for r in res.values()]
              + [1e-9])
    stub = 0.02 * top
    bar = min(heights) * 0.8 / n
    for i, (hw, results) in enumerate(by_hw.items()):
        color = f"C{i}"
        ys = [c - bar * n / 2 + bar * (i + 0.5) for c in centres]
        ok_y, ok_x = [], []
        for yy, label in zip(ys, ordered):
            r = results.get(label)
            if r is None:
                ax.text(0, yy, f" n/a on {hw}", va="center", fontsize=6, color="grey")
            elif r["status"] != "ok" or not (r.get("median") or {}).get("model_tflops"):
                ax.barh(yy, stub, bar, fill=False, hatch="///", edgecolor=color)
                ax.text(stub, yy, f" {r['status']} on {hw}", va="center", fontsize=6, color=color)
            else:
                ok_y.append(yy)
                ok_x.append(r["median"]["model_tflops"])
        bars = ax.barh(ok_y, ok_x, bar, color=color, label=f"{hw}: {_machine(results)}")
        ax.bar_label(bars, fmt="%.0f" if top >= 10 else "%.2g", fontsize=6, padding=2)
    ax.set_yticks(centres, wrapped, fontsize=6.5)
    ax.set_ylim(y, 0)
    if shared and len(shared) < len(ordered):
        ax.axhline(sum(heights[:len(shared)]), color="black", lw=0.6, ls="--")
    ax.set(xlabel="model TFLOP/s (median step)", xlim=(0, top * 1.2))
    on_all = (f"{len(shared)} of {len(ordered)} points ran on every machine (above the dashed line)"
              if shared else "no point ran on every machine with one spec: bars of one machine only "
                             "(the grids' `shared` experiment pairs them)")
    ax.set_title("\n".join(textwrap.fill(t, 110) for t in (title, on_all)), fontsize=9)
    ax.legend(title="hardware (as its results' env says)", fontsize=7, title_fontsize=7, loc="best")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    return fig, ax


def _folder(text: str) -> tuple[str, str]:
    hw, sep, folder = text.partition("=")
    if not sep or not hw or not folder:
        raise argparse.ArgumentTypeError(f"{text!r}: expected HARDWARE=FOLDER")
    return hw, folder


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folders", nargs="+", type=_folder, help="HARDWARE=FOLDER, one per machine, in legend order")
    p.add_argument("--title", default="model TFLOP/s by hardware")
    p.add_argument("--png", required=True)
    p.add_argument("--pdf", required=True)
    args = p.parse_args(argv)
    labels, by_hw = collect(dict(args.folders))
    if not labels:
        print("error: no harness results in " + ", ".join(f for _, f in args.folders), file=sys.stderr)
        return 1
    fig, _ = figure(labels, by_hw, args.title)
    save_figure(fig, args.png, args.pdf)
    read = [f for _, folder in args.folders for f in glob.glob(f"{folder}/**/*.json", recursive=True)]
    outputs.record([args.png, args.pdf], read, [__file__])
    print(f"{len(labels)} points on {', '.join(by_hw)} -> {args.png}, {args.pdf}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

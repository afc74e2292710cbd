"""The same points on several machines, side by side -> a PNG and a PDF figure.

    python -m workflows.scripts.hardware_compare --title T --png F.png --pdf F.pdf h100=DIR h200=DIR ...

Each DIR is a folder of harness results (e.g. results/<hardware>/points/<experiment>). Points pair
up across machines by what was run (suite.compare.point_key), not by file name. One group of bars
per point, one bar per machine: its median model TFLOP/s. A point that did not run there
(out of memory, timeout, unsupported) is a hatched stub on the floor with its status, its height a
marker and not a value; a point the machine has no result for is marked "n/a".
"""
from __future__ import annotations

import argparse
import glob
import sys

import matplotlib

matplotlib.use("Agg")  # files only; no display on the workflow's machines
import matplotlib.pyplot as plt

from suite.compare import load, point_label

from megatrain.io import save_figure


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


def figure(labels: list[str], by_hw: dict[str, dict[str, dict]], title: str):
    n = len(by_hw)
    width = 0.8 / max(n, 1)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.5 + len(labels) * (0.35 + 0.3 * n)), 4.8))
    top = max([(r.get("median") or {}).get("model_tflops") or 0 for res in by_hw.values() for r in res.values()]
              + [1e-9])
    stub = 0.03 * top
    for i, (hw, results) in enumerate(by_hw.items()):
        xs = [j - 0.4 + width * (i + 0.5) for j in range(len(labels))]
        color = f"C{i}"
        ok_x, ok_y = [], []
        for x, label in zip(xs, labels):
            r = results.get(label)
            if r is None:
                ax.text(x, 0, "n/a", ha="center", va="bottom", fontsize=7, color="grey", rotation=90)
            elif r["status"] != "ok" or not (r.get("median") or {}).get("model_tflops"):
                ax.bar(x, stub, width, fill=False, hatch="///", edgecolor=color)
                ax.text(x, stub, f" {r['status']}", ha="center", va="bottom", fontsize=7, color=color, rotation=90)
            else:
                ok_x.append(x)
                ok_y.append(r["median"]["model_tflops"])
        bars = ax.bar(ok_x, ok_y, width, color=color, label=hw)
        ax.bar_label(bars, fmt="%.0f" if top >= 10 else "%.2g", fontsize=7, padding=1)
    ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=8)
    ax.set(ylabel="model TFLOP/s", title=title, ylim=(0, top * 1.25))
    ax.legend(title="hardware")
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
    print(f"{len(labels)} points on {', '.join(by_hw)} -> {args.png}, {args.pdf}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

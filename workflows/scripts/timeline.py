"""Draw a window of a step's timeline (a Chrome trace from `Trainer.write_trace`, or the harness's
megatrain option `trace=PATH`) as one lane per stream and CPU thread, each span coloured by its
kind (the event's `cat`, a `megatrain.timeline.Kind`):

    python -m workflows.scripts.timeline TRACE.json OUT.png [--window START_S END_S ...]
"""
from __future__ import annotations

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from megatrain.io import atomic_file
from megatrain.timeline import Kind  # noqa: E402
from workflows.scripts import outputs  # noqa: E402

COLORS = {Kind.FORWARD: "tab:blue", Kind.RECOMPUTE: "tab:cyan", Kind.BACKWARD: "tab:green",
          Kind.HEAD: "tab:purple", Kind.EMBEDDING: "tab:olive", Kind.LOAD: "tab:orange",
          Kind.CHECKPOINT: "tab:brown", Kind.GRADIENT: "tab:red", Kind.UPDATE: "tab:pink",
          Kind.WAIT_WEIGHTS: "tab:gray", Kind.WAIT_OPTIMIZER: "silver", Kind.OPTIMIZER_STEP: "black",
          Kind.ISSUE: "wheat", Kind.REDUCE: "darkgoldenrod"}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("trace")
    p.add_argument("out")
    p.add_argument("--window", nargs=2, type=float, action="append", metavar=("START_S", "END_S"))
    p.add_argument("--title", default="")
    args = p.parse_args(argv)
    events = json.load(open(args.trace))["traceEvents"]
    lanes = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M"}
    spans = [e for e in events if e["ph"] == "X"]
    windows = args.window or [(0.0, max(e["ts"] + e["dur"] for e in spans) / 1e6)]
    fig, axes = plt.subplots(len(windows), 1, figsize=(12, 2.2 * len(windows) + 0.6), squeeze=False)
    for ax, (lo, hi) in zip(axes[:, 0], windows):
        for e in spans:
            start, end = e["ts"] / 1e3, (e["ts"] + e["dur"]) / 1e3  # ms
            if end < lo * 1e3 or start > hi * 1e3:
                continue
            ax.broken_barh([(start, max(end - start, 0.05))], (e["tid"] - 0.4, 0.8),
                           facecolors=COLORS[Kind(e["cat"])], edgecolor="none")
        ax.set_xlim(lo * 1e3, hi * 1e3)
        ax.set_yticks(list(lanes), [lanes[t] for t in lanes])
        ax.invert_yaxis()
        ax.set_xlabel("time since step start (ms)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLORS.values()]
    fig.legend(handles, [str(k) for k in COLORS], loc="upper center", ncol=len(COLORS) // 2, fontsize=8,
               frameon=False)
    if args.title:
        fig.suptitle(args.title, y=0.01, va="bottom", fontsize=9)  # a caption below the axis
    fig.tight_layout(rect=(0, 0.07, 1, 1 - 0.45 / fig.get_figheight()))  # two legend rows above
    with atomic_file(args.out) as tmp:
        fig.savefig(tmp, dpi=130)
    outputs.record([args.out], [args.trace], [__file__])


if __name__ == "__main__":
    main()

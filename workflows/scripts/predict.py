"""The step model's predictions for a grid's MegaTrain points on a machine, written before they run.

Each point is projected (suite/projection.py) with the engine's defaults and the point's options on
the machine's description (machines/*.yaml), its step time given the band that the committed runs'
errors give it (the data-parallel runs' for a point on several GPUs); a point on several GPUs is set
beside the grid's point of the same model and batch per GPU on one. Predictions, not measurements:
once the grid has run, `python -m suite project` checks the model against its points.

    python -m workflows.scripts.predict GRID MACHINE --out results/projection/NAME [--points EXPERIMENT/ID ...]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megatrain.config import set_dotted
from megatrain.io import write_json, write_text
from megatrain.units import GiB
from suite.machines import MACHINES
from suite.projection import band, check, project, step_errors
from suite.spec import RunSpec
from workflows.scripts import grid as grids

ROOT = Path(__file__).resolve().parents[2]
RESULTS = [ROOT / "results" / hw for hw in ("h100", "h100x2", "h200", "h200x4")]


def _nested(options: dict) -> dict:
    """A grid point's dotted options (engine.checkpoint_every) as a RunSpec's tree."""
    tree: dict = {}
    for dotted, value in options.items():
        set_dotted(tree, dotted, value)
    return tree


def predict(grid_path: Path, machine: str, errors: dict[str, list[float]], only: list[str] | None = None) -> list[dict]:
    """Every MegaTrain point of the grid (`only`: those named EXPERIMENT/ID) projected on the machine,
    with its step time's band."""
    m = MACHINES[machine]
    points = grids.points(grids.load(grid_path))
    unknown = sorted(set(only or ()) - {f"{e}/{i}" for (e, i), p in points.items() if p["system"] == "megatrain"})
    if unknown:
        raise ValueError(f"--points: {', '.join(unknown)}: not a MegaTrain point of {grid_path.name}")
    rows = []
    for (experiment, pid), point in points.items():
        if point["system"] != "megatrain" or (only and f"{experiment}/{pid}" not in only):
            continue
        gpus = point.get("gpus", 1)
        spec = RunSpec(system="megatrain", model=grids.model(point), seq_len=point["seq"], batch_size=point["batch"],
                       grad_accum=point["accum"], gpus=gpus, options=_nested(point["options"]))
        pr = project(spec, m, ran={})
        lo, hi, basis = band(errors, pr.bound, gpus)
        tokens = point["seq"] * point["batch"] * point["accum"]
        rows.append({"experiment": experiment, "id": pid, "gpus": gpus, "per_gpu": (grids.identity(
            {**point, "batch": point["batch"] // gpus, "gpus": 1})), "host_GiB": pr.host_bytes / GiB,
            "fits_host": pr.host_bytes <= m.host_gib * GiB, "device_GiB": pr.device_bytes / GiB,
            "step_s": pr.step_s, "step_s_band": (pr.step_s / (1 + hi), pr.step_s / (1 + lo)),
            "tokens_per_s": tokens / pr.step_s, "model_tflops": pr.model_tflops, "bound": pr.bound,
            "band_basis": basis})
    one = {r["per_gpu"]: r for r in rows if r["gpus"] == 1}
    for r in rows:
        base = one.get(r.pop("per_gpu"))
        r["vs_one_gpu"] = r["tokens_per_s"] / base["tokens_per_s"] if base and r["gpus"] > 1 else None
    return rows


def report(grid_path: Path, machine: str, rows: list[dict], only: list[str] | None = None) -> str:
    m = MACHINES[machine]
    lines = [f"# Predictions (not measurements): {grid_path.name} on {machine}", "",
             f"Written before the points run, by `python -m workflows.scripts.predict {grid_path.relative_to(ROOT)} "
             f"{machine}" + (f" --points {' '.join(only)}" if only else "") + "`: the step model (suite/projection.py) with the engine's defaults and each point's options. "
             f"The machine: {m.source}; host {m.host_gib:.0f} GiB, device {m.device_gib:.1f} GiB. Step bands: the "
             "central 80% of the committed runs' step errors (the data-parallel runs' for a point on several GPUs, "
             "which the model times as one GPU's rows with each rank's part of the gradients and of the update, "
             "its gradient reduction left out). A model TFLOP/s of several GPUs is their sum.", "",
             "| point | GPUs | host GiB | device GiB | step s (band) | tokens/s | x one GPU | model TFLOP/s | bound | band of |",
             "|---" * 10 + "|"]
    for r in rows:
        host = f"{r['host_GiB']:.0f}" + ("" if r["fits_host"] else f" (> {m.host_gib:.0f}: refused)")
        vs = f"{r['vs_one_gpu']:.2f}" if r["vs_one_gpu"] else ""
        lines.append(f"| {r['experiment']}/{r['id']} | {r['gpus']} | {host} | {r['device_GiB']:.0f} | {r['step_s']:.2f} "
                     f"({r['step_s_band'][0]:.2f}-{r['step_s_band'][1]:.2f}) | {r['tokens_per_s']:,.0f} | {vs} "
                     f"| {r['model_tflops']:.0f} | {r['bound']} | {r['band_basis']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("grid", help="a grid file (workflows/grids/*.yaml)")
    ap.add_argument("machine", help=f"a machine description's name: {', '.join(MACHINES)}")
    ap.add_argument("--out", required=True, help="writes OUT.md and OUT.json")
    ap.add_argument("--points", nargs="+", metavar="EXPERIMENT/ID", help="only these points (those not yet run)")
    args = ap.parse_args(argv)
    if args.machine not in MACHINES:
        ap.error(f"machine {args.machine!r}: not one of {', '.join(MACHINES)} (machines/*.yaml)")
    try:
        grid_path = Path(args.grid).resolve()
        rows = predict(grid_path, args.machine, step_errors(check(RESULTS)), args.points)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    text = report(grid_path, args.machine, rows, args.points)
    out = Path(args.out)
    write_json(out.with_suffix(".json"), {"grid": str(grid_path.relative_to(ROOT)), "machine": args.machine, "points": rows})
    write_text(out.with_suffix(".md"), text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())

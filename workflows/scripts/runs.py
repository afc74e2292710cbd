"""A user's run of the workflow measures this machine into a folder of its own, then compares it.

    python -m workflows.scripts.runs name PROFILE     # the folder a new run of PROFILE writes
    python -m workflows.scripts.runs compare RUN      # RUN against its baseline: the regression table
    python -m workflows.scripts.runs promote RUN      # RUN's points, tables and figures become the committed ones

`make run` does the first two around `snakemake --profile profiles/<P> --config run=<folder>`. A
run folder is `runs/<hardware>/<UTC time>-<commit>-<machine>` (the machine: GPU and count, host
memory, cores), so two runs never share one and each says where and from what it was measured.
Its baseline is the committed `results/<hardware>/points` where there are any, else the newest
earlier run of the same hardware (a machine with no committed results, such as the CPU grid's,
compares with its own last run). Committed results change only by `promote`, a deliberate step.
"""
from __future__ import annotations

import argparse
import datetime
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import psutil
import yaml

from megatrain.metrics import git
from workflows.scripts import outputs

RUNS = Path("runs")


def hardware(profile: str | Path) -> str:
    """The hardware name of a profile's grid (its `hardware:`)."""
    config = Path(profile) / "workflow.yaml"
    try:
        grid = yaml.safe_load(config.read_text())["grid"]
        return yaml.safe_load(Path(grid).read_text())["hardware"]
    except (OSError, KeyError, TypeError, yaml.YAMLError) as e:
        raise ValueError(f"{config}: no grid with a `hardware:` to name the run by ({type(e).__name__}: {e})") from None


def gpus() -> list[str]:
    """This machine's NVIDIA GPUs by name (nvidia-smi, which needs no CUDA context), or none."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else []


def machine() -> str:
    """e.g. `H200x1-125g-16c`, `cpu-23g-2c`: the GPU and count, the host's GiB, the cores."""
    found = gpus()
    gpu = re.sub(r"[^A-Za-z0-9]+", "", found[0].replace("NVIDIA", "")) + f"x{len(found)}" if found else "cpu"
    return f"{gpu}-{psutil.virtual_memory().total // 2 ** 30}g-{os.cpu_count()}c"


def commit() -> str:
    head = os.environ.get("MEGATRAIN_GIT_COMMIT") or git("rev-parse", "HEAD", cwd=".") or "nocommit"
    dirty = "-dirty" if git("status", "--porcelain", "--untracked-files=no", cwd=".") else ""
    return head[:7] + dirty


def name(profile: str | Path) -> Path:
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S")
    return RUNS / hardware(profile) / f"{stamp}-{commit()}-{machine()}"


def _points(folder: Path) -> list[Path]:
    return sorted(folder.rglob("*.json")) if folder.is_dir() else []


def baseline(run: Path) -> Path | None:
    """The committed points of the run's hardware, else its newest earlier run's, else None."""
    hw = run.parent.name
    committed = Path("results") / hw / "points"
    if _points(committed):
        return committed
    earlier = [p for p in sorted(run.parent.iterdir()) if p.name < run.name and _points(p / "points")] if run.parent.is_dir() else []
    return earlier[-1] / "points" if earlier else None


def compare(run: Path) -> int:
    """The run against its baseline: the table printed and written beside the run (compare.txt,
    compare.json); exit 1 on a regression, as `suite compare`."""
    from suite import compare as cmp
    if not _points(run / "points"):
        print(f"{run}: no point was measured (a dry run, or every job failed before its result): nothing to compare")
        return 0
    base = baseline(run)
    if base is None:
        print(f"{run}: no committed results of {run.parent.name} and no earlier run of it: this run is the first "
              f"baseline (promote it to commit it: python -m workflows.scripts.runs promote {run})")
        return 0
    report = cmp.compare(base, run / "points")
    text = cmp.render(report)
    (run / "compare.txt").write_text(text + "\n")
    from megatrain.io import write_json
    write_json(run / "compare.json", report)
    print(f"\n=== {run} against {base} ===\n{text}\n(also in {run / 'compare.txt'}; to make this run the committed "
          f"results: python -m workflows.scripts.runs promote {run})")
    return 1 if report["regressed"] else 0


def promote(run: Path) -> int:
    """Copy the run's points and tables to results/<hardware>/ and its figures to plots/<hardware>/, then
    make the results summary and README's results table from the committed points (summary.py)."""
    points = _points(run / "points")
    if not points:
        print(f"error: {run}: no points to promote (a run folder holds points/, tables/, plots/)", file=sys.stderr)
        return 2
    hw = run.parent.name
    copied = 0
    for src, dst in ((run / "points", Path("results") / hw / "points"), (run / "tables", Path("results") / hw / "tables"),
                     (run / "plots", Path("plots") / hw)):
        for f in sorted(src.rglob("*")) if src.is_dir() else []:
            if f.is_file() and not f.name.endswith(".log"):
                target = dst / f.relative_to(src)
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(f, target)
                if f.name.endswith(outputs.SUFFIX):  # a figure's record names its inputs where they now are
                    outputs.moved(target, os.path.relpath(run), f"results/{hw}")
                copied += 1
    from workflows.scripts import summary
    left = summary.problems(write=True)  # the summary and README's table, from the points now committed
    print(f"{run}: {copied} files copied into results/{hw} and plots/{hw} ({len(points)} points), "
          f"results/summary.md and README.md's results table made from them; review with git diff, then commit"
          + "".join(f"\n{line}" for line in left))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m workflows.scripts.runs", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("name", help="the folder a new run of PROFILE writes").add_argument("profile")
    sub.add_parser("compare", help="RUN against its baseline").add_argument("run", type=Path)
    sub.add_parser("promote", help="RUN's results become the committed ones").add_argument("run", type=Path)
    a = ap.parse_args(argv)
    try:
        if a.command == "name":
            print(name(a.profile))
            return 0
        if not a.run.is_dir():
            raise ValueError(f"{a.run}: not a run folder (runs/<hardware>/<run>, as `make run` names them)")
        return compare(a.run) if a.command == "compare" else promote(a.run)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""The committed tables and figures as functions of the committed points.

    python -m workflows.scripts.outputs check    # every committed table made again and compared byte for byte,
                                                 # every committed figure's record of its inputs current
    python -m workflows.scripts.outputs tables   # the committed tables made again in place

A table under `results/<hardware>/tables/` is made by the grid of that hardware that names its
experiment (`workflows/grids/*.yaml`), from the point files that exist (the workflow's
`partial=true`), with the arguments `table_argv` gives: the same function the workflow's `table`
rule takes its arguments from, so the check cannot drift from the rule. Tables 1-3 come from the
probe, the presets and the accuracy summary.

A figure cannot be compared byte for byte (fonts and matplotlib versions move its pixels), so each
records, beside it as `<name>.inputs.json`, the SHA-256 of its files, of the files it was drawn
from and of the code that drew it (`record`); the check requires all three current. A figure of an
experiment with no point that ran (`status: ok`) on its machine is not committed.
"""
from __future__ import annotations

import argparse
import contextlib
import filecmp
import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GRIDS = Path("workflows/grids")
SUFFIX = ".inputs.json"
# the CPU grid's outputs: a smoke test's, never committed (.gitignore), so never checked
UNCOMMITTED = "cpu"


def sha256(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


# --- the table rule's arguments (workflows/report.smk takes them from here) ---

def point_files(grid: dict, experiment: str, results: str, partial: bool) -> list[str]:
    """The experiment's point files in the grid's order; with `partial`, only those that exist."""
    files = [f"{results}/points/{experiment}/{p['id']}.json" for p in grid["experiments"][experiment]["points"]]
    return [f for f in files if os.path.exists(f)] if partial else files


def moe_files(experiment: str, results: str) -> list[str]:
    """For the scale table: the mixtures of experts measured at reduced depth on this hardware (the
    `moe` experiment, which a scale grid of the same hardware runs), as they are now."""
    folder = f"{results}/points/moe"
    if experiment != "scale" or not os.path.isdir(folder):
        return []
    return sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".json"))


def paper_args(grid: dict, experiment: str) -> list[str]:
    paper = grid["experiments"][experiment].get("paper") or []
    return [a for name in ([paper] if isinstance(paper, str) else paper) for a in ("--paper", name)]


def table_argv(grid_file: str, grid: dict, experiment: str, results: str, points: list[str],
               moe: list[str]) -> list[str]:
    """`python -m workflows.scripts.aggregate`'s arguments but --csv and --md."""
    return (["--experiment", experiment, "--hardware", grid["hardware"], *paper_args(grid, experiment),
             "--grid", grid_file] + [a for f in moe for a in ("--moe", f)] + points)


# --- which grid makes a committed table ---

def grids(hardware: str) -> dict[str, dict]:
    """The grid files of `hardware` (its own and `<hardware>-<purpose>`), loaded with their includes."""
    from workflows.scripts import grid as gridlib
    out = {}
    for f in sorted(GRIDS.glob("*.yaml")):
        if f.stem == hardware or f.stem.startswith(f"{hardware}-"):
            out[str(f)] = gridlib.load(f)
    return out


def maker(hardware: str, experiment: str) -> tuple[str, dict]:
    """The one grid file of `hardware` that names `experiment`, and the grid."""
    found = [(f, g) for f, g in grids(hardware).items() if experiment in g["experiments"]]
    if len(found) != 1:
        raise ValueError(f"results/{hardware}/tables/{experiment}: {len(found)} grids of {hardware} name the "
                         f"experiment ({', '.join(f for f, _ in found) or 'none'}), not one")
    return found[0]


def remake_table(hardware: str, name: str, out: Path) -> list[Path]:
    """Make `results/<hardware>/tables/<name>.{csv,md}` again into `out` (run from the repository
    root); return the files made, in the committed files' names."""
    results = f"results/{hardware}"
    csv, md = out / f"{name}.csv", out / f"{name}.md"
    files = ["--csv", str(csv), "--md", str(md)]
    if name == "table1_memory_hierarchy":
        from workflows.scripts import memory_table
        memory_table.main(["--hardware", hardware, "--paper", "workflows/paper/table1_memory_hierarchy.yaml",
                           *files, f"{results}/probes/bandwidth.json"])
    elif name == "table2_models":
        from workflows.scripts import model_table
        model_table.main(["--paper", "workflows/paper/table2_models.yaml", *files])
    elif name == "table3_accuracy":
        from workflows.scripts import accuracy_report
        accuracy_report.main(["--summary", f"{results}/accuracy/summary.json", "--hardware", hardware, *files,
                              "--png", str(out / f"{name}.png"), "--pdf", str(out / f"{name}.pdf")])
    else:
        from workflows.scripts import aggregate
        grid_file, grid = maker(hardware, name)
        points = point_files(grid, name, results, partial=True)
        aggregate.main(table_argv(grid_file, grid, name, results, points, moe_files(name, results)) + files)
    return [csv, md]


# --- a figure's record of its inputs ---

def record_path(png: str | Path) -> Path:
    return Path(png).with_suffix(SUFFIX)


def _relative(path: str | Path) -> str:
    """A path from the folder the workflow runs in (the repository root), as the check reads it."""
    return os.path.relpath(path)


def record(figures: list[str | Path], inputs: list[str | Path], code: list[str | Path]) -> Path:
    """Beside the first figure, the SHA-256 of each figure file (by name: they sit beside it), of each
    input and each code file (by path from the folder it runs in, the repository root); written
    after the figures."""
    data = {"figures": {Path(f).name: sha256(f) for f in figures},
            "inputs": {_relative(f): sha256(f) for f in sorted(map(str, inputs))},
            "code": {_relative(f): sha256(f) for f in code}}
    path = record_path(figures[0])
    _write(path, data)
    return path


def _write(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


def moved(path: Path, old: str, new: str) -> None:
    """A figure's record whose inputs under folder `old` now lie under `new` (a run's promotion:
    runs/<hardware>/<run> -> results/<hardware>)."""
    data = json.loads(path.read_text())
    data["inputs"] = {(new + f[len(old):] if f.startswith(old + "/") else f): h for f, h in data["inputs"].items()}
    _write(path, data)


def stale_record(path: Path) -> list[str]:
    """What in a figure's record no longer holds (run from the repository root): a figure file,
    input or code file changed or gone."""
    data = json.loads(path.read_text())
    out = []
    for kind, files in (("figure", {str(path.parent / n): h for n, h in data["figures"].items()}),
                        ("input", data["inputs"]), ("code", data["code"])):
        for f, h in files.items():
            if not os.path.exists(f):
                out.append(f"{path}: its {kind} {f} is gone")
            elif sha256(f) != h:
                out.append(f"{path}: its {kind} {f} changed since the figure was drawn"
                           + (" (edited by hand?)" if kind == "figure" else ": draw it again"))
    return out


def measured_experiments(results: str) -> set[str]:
    """The experiments with at least one point that ran (`status: ok`) among a results folder's points."""
    out = set()
    for f in Path(results, "points").glob("*/*.json"):
        with contextlib.suppress(ValueError, KeyError):
            if json.loads(f.read_text()).get("status") == "ok":
                out.add(f.parent.name)
    return out


# --- the check ---

def committed_tables() -> list[Path]:
    return [p for p in sorted(Path("results").glob("*/tables/*.csv")) if p.parts[1] != UNCOMMITTED]


def check_tables(only: set[str] | None = None) -> list[str]:
    """Every committed table made again in a temporary folder: the ones that differ ([] if none).
    `only`: the `<hardware>/<name>` tables to check."""
    problems = []
    with tempfile.TemporaryDirectory() as tmp:
        for committed in committed_tables():
            hardware, name = committed.parts[1], committed.stem
            if only is not None and f"{hardware}/{name}" not in only:
                continue
            out = Path(tmp) / hardware
            out.mkdir(exist_ok=True)
            try:
                made = remake_table(hardware, name, out)
            except (ValueError, OSError) as e:
                problems.append(f"{committed}: cannot be made again: {e}")
                continue
            for f in made:
                mine = committed.with_suffix(f.suffix)
                if not mine.exists() or not filecmp.cmp(f, mine, shallow=False):
                    problems.append(f"{mine}: not what the committed points make (made again: differs)")
    return problems


def check_figures(only: set[str] | None = None) -> list[str]:
    """Every figure under plots/ has a current record of its inputs, and a figure of a grid's
    experiment has a point of that experiment that ran on its machine."""
    problems = []
    for png in sorted(Path("plots").rglob("*.png")):
        if png.parent.name == UNCOMMITTED or only is not None and f"{png.parent.name}/{png.stem}" not in only:
            continue
        rec = record_path(png)
        if not rec.exists():
            problems.append(f"{png}: no record of its inputs ({rec.name})")
            continue
        problems += stale_record(rec)
        hardware = png.parent.name
        experiments = {e for g in grids(hardware).values() for e in g["experiments"]}
        if png.stem in experiments and png.stem not in measured_experiments(f"results/{hardware}"):
            problems.append(f"{png}: {png.stem} has no point that ran on {hardware}: a figure of nothing measured")
    for rec in sorted(Path("plots").rglob(f"*{SUFFIX}")):
        stem = rec.name[:-len(SUFFIX)]
        if not (rec.parent / f"{stem}.png").exists() and (only is None or f"{rec.parent.name}/{stem}" in only):
            problems.append(f"{rec}: a record without its figure")
    return problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m workflows.scripts.outputs", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=("check", "tables"))
    a = p.parse_args(argv)
    with contextlib.chdir(ROOT):
        if a.command == "tables":
            with tempfile.TemporaryDirectory() as tmp:  # Table 3's script draws its figure too: not here
                for committed in committed_tables():
                    for f in remake_table(committed.parts[1], committed.stem, Path(tmp)):
                        shutil.copyfile(f, committed.with_suffix(f.suffix))
            return 0
        problems = check_tables() + check_figures()
    print("\n".join(problems) or "every committed table and figure is what the committed points make")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

"""The results summary: one row per committed point, the one place README.md takes its numbers from.

    python -m workflows.scripts.summary            # write results/summary.md, results/summary.csv, README's table
    python -m workflows.scripts.summary --check    # write nothing; exit 1 naming what is not current

A row is one harness result under `results/<machine>/points/` of a machine that a grid in
`workflows/grids/` names (a smoke grid's, the CPU's, left out: its numbers measure nothing): the
machine, the point, the system, the model, the setting (sequences x micro-batches x tokens, GPUs,
options), its status and, where it did not run, why, the figures (model and executed
TFLOP/s, the step, tokens per second, the speed-up over the same point on one GPU, host and device
peaks, the ratio to the single-layer ceiling), the commit it ran at and its file. A result whose
grid point has changed since it ran is marked stale (`workflows.scripts.grid.stale`). README.md's
results table is HEADLINE's rows rendered from the same rows, between the two markers there, and
every decimal number of README's prose (outside code) must be a figure of the summary: `--check`
and tests/workflow/test_docs.py fail on one typed by hand. `python -m workflows.scripts.runs promote` runs
this after copying a run's points in.
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import re
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
GiB = 2**30

# README's results table: a handful of points (machine, experiment/id), the rest in results/summary.md.
HEADLINE = [
    ("h200x4", "scale/32b_megatrain"),
    ("h200x4", "largest/32b_L88_16seq_megatrain"),
    ("h200x4", "scale/14b_megatrain"),
    ("h200x4", "scale/14b_zero3"),
    ("h200x4", "scale/14b_fsdp2"),
    ("h200x4", "gpus/7b_g4"),
    ("h200", "gpus/7b_g2"),
    ("h200", "gpus/14b_g2"),
    ("h200", "long_context/ctx512k_L28"),
    ("h100", "scale/3b_megatrain"),
    ("h100", "scale/3b_native"),
]
BEGIN, END = "<!-- results table: python -m workflows.scripts.summary -->", "<!-- end of the results table -->"

COLUMNS = ["machine", "point", "system", "model", "params_B", "setting", "status", "why", "model_tflops",
           "executed_tflops", "step_s", "tokens_per_s", "vs_1_gpu", "host_GiB", "device_GiB",
           "ceiling_ratio", "stale", "commit", "file"]
# The Markdown's figures, each as README quotes it.
FORMATS = {"params_B": "{:.2f}", "model_tflops": "{:.1f}", "executed_tflops": "{:.1f}", "step_s": "{:.2f}",
           "tokens_per_s": "{:.0f}", "vs_1_gpu": "{:.3f}x", "host_GiB": "{:.1f}", "device_GiB": "{:.1f}",
           "ceiling_ratio": "{:.3f}"}


def machines(root: Path = ROOT) -> list[str]:
    """The machines with points under results/ whose grids are in workflows/grids, a smoke grid's left
    out (a folder of another hardware name is no grid's: a test's, or a copy from elsewhere)."""
    grids = [yaml.safe_load(g.read_text(encoding="utf-8")) for g in (root / "workflows" / "grids").glob("*.yaml")]
    measured = {g["hardware"] for g in grids if not g.get("smoke_test")} - {g["hardware"] for g in grids if g.get("smoke_test")}
    return sorted(p.parent.name for p in (root / "results").glob("*/points") if p.parent.name in measured)


def point_files(root: Path = ROOT) -> list[Path]:
    """Every harness result of those machines (a step's Chrome trace beside one is not a result)."""
    return sorted(p for hw in machines(root) for p in (root / "results" / hw / "points").glob("*/*.json")
                  if not p.name.endswith(".trace.json"))


def _grid_points(root: Path, hw: str) -> dict[tuple[str, str], dict]:
    """(experiment, id) -> the grid point as it is now, over every grid of the machine."""
    from workflows.scripts import grid
    out: dict[tuple[str, str], dict] = {}
    for path in sorted((root / "workflows" / "grids").glob(f"{hw}*.yaml")):
        g = grid.load(path)
        if g.get("hardware") == hw:
            out.update(grid.points(g))
    return out


def _setting(result: dict) -> str:
    from workflows.scripts.grid import DIAGNOSTIC_OPTIONS, dotted
    spec = result["spec"]
    words = [f"{spec['batch_size']} x {spec['grad_accum']} x {spec['seq_len']}"]
    if (spec.get("gpus") or 1) > 1:
        words.append(f"{spec['gpus']} GPUs")
    options = {k: v for k, v in dotted(spec.get("options") or {}).items() if k.split(".")[0] not in DIAGNOSTIC_OPTIONS}
    words += [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in sorted(options.items())]
    return ", ".join(words)


def _model(result: dict) -> str:
    model = result["spec"]["model"]
    overrides = dict(model.get("overrides") or {})
    layers = overrides.pop("num_hidden_layers", None)
    name = model.get("preset") or model.get("config")
    extra = ([f"{layers} layers"] if layers else []) + [f"{k}={v}" for k, v in sorted(overrides.items())]
    return f"{name} ({', '.join(extra)})" if extra else name


def _why(result: dict) -> str:
    """A result that did not run: its reason's first clause (a refusal up front says what does not fit,
    with the bytes needed and available; an out-of-memory, a timeout or an error says so)."""
    if result["status"] == "ok" or not result.get("reason"):
        return ""
    return " ".join(result["reason"].split()).split(" (")[0][:160]


def _ranks_key(result: dict) -> tuple:
    """What a point runs but its GPU count, per GPU: the 1-GPU point a data-parallel one scales."""
    spec, gpus = result["spec"], result["spec"].get("gpus") or 1
    return (result["system"], json.dumps(spec["model"], sort_keys=True), spec["seq_len"], spec["batch_size"] // gpus,
            spec["grad_accum"], json.dumps(spec.get("options") or {}, sort_keys=True))


def rows(root: Path = ROOT) -> list[dict]:
    """The summary's rows, raw values (None where a result has none)."""
    from workflows.scripts.aggregate import executed_tflops
    from workflows.scripts.grid import stale
    results = [(p, json.loads(p.read_text(encoding="utf-8"))) for p in point_files(root)]
    grids = {hw: _grid_points(root, hw) for hw in machines(root)}
    one_gpu = {(p.parts[-4], p.parts[-2], _ranks_key(r)): r for p, r in results
               if (r["spec"].get("gpus") or 1) == 1 and r["status"] == "ok"}
    out = []
    for path, r in results:
        hw, experiment, point_id = path.parts[-4], path.parts[-2], path.stem
        med, peak, env = r.get("median") or {}, r.get("peak") or {}, r.get("env") or {}
        ok = r["status"] == "ok"
        point = grids[hw].get((experiment, point_id))
        why = "not in a grid now" if point is None else stale(point, r)
        base = one_gpu.get((hw, experiment, _ranks_key(r))) if (r["spec"].get("gpus") or 1) > 1 and ok else None
        commit = env.get("git_commit")
        out.append({
            "machine": hw, "point": f"{experiment}/{point_id}", "system": r["system"], "model": _model(r),
            "params_B": r["params"] / 1e9 if r.get("params") else None, "setting": _setting(r),
            "status": r["status"] + (f" (same run as {r['same_as']})" if r.get("same_as") else ""),
            "why": _why(r),
            "model_tflops": med.get("model_tflops") if ok else None,
            "executed_tflops": executed_tflops(r),
            "step_s": med.get("step_time_s") if ok else None,
            "tokens_per_s": med.get("tokens_per_s") if ok else None,
            "vs_1_gpu": med["tokens_per_s"] / base["median"]["tokens_per_s"] if base else None,
            "host_GiB": peak["host_rss_bytes"] / GiB if ok and peak.get("host_rss_bytes") else None,
            "device_GiB": peak["device_allocated_bytes"] / GiB if ok and peak.get("device_allocated_bytes") else None,
            "ceiling_ratio": r.get("ratio_to_ceiling"),
            "stale": why or "",
            "commit": (commit[:7] + ("*" if env.get("git_dirty") else "")) if commit else "",
            "file": path.relative_to(root).as_posix(),
        })
    return out


def _cell(row: dict, column: str) -> str:
    value = row[column]
    if value is None:
        return ""
    return FORMATS[column].format(value) if column in FORMATS else str(value).replace("|", "/")


def machines_table(root: Path = ROOT) -> list[str]:
    """Each machine as its results' environments say (GPU, GPUs a point saw, cores, host memory)."""
    lines = ["| machine | GPU | GPUs a point saw | cores | host memory (GiB, as read; as admitted against) |",
             "| --- | --- | ---: | ---: | --- |"]
    for hw in machines(root):
        envs = [json.loads(p.read_text(encoding="utf-8")).get("env") or {} for p in point_files(root)
                if p.parts[-4] == hw]

        def seen(key, fmt=str):
            return ", ".join(sorted({fmt(e[key]) for e in envs if e.get(key) is not None})) or "-"
        host = seen("host_memory_bytes", lambda b: f"{b / GiB:.1f}")
        stated = seen("host_memory_stated_gb", lambda g: f"{g:g} GB")
        lines.append(f"| {hw} | {seen('gpu')} | {seen('gpu_count')} | {seen('cpu_cores')} | {host}; {stated} |")
    return lines


def markdown(table: list[dict], root: Path = ROOT) -> str:
    head = ["# Results summary", "",
            "Generated by `python -m workflows.scripts.summary` from every committed point "
            "(`results/<machine>/points/`); do not edit. README.md takes its numbers from here; each "
            "machine's README says what its experiments are, `results/<machine>/tables/` sets them beside "
            "the paper's numbers.", "",
            "Model TFLOP/s count `6N + 12·L·h·s` FLOPs a token (this project's convention, "
            "`megatrain/metrics.py`: causal attention counted as the whole square); executed TFLOP/s "
            "are what the kernels ran (recompute included, causal attention as half the square), where the "
            "result records its executed FLOPs (MegaTrain's, since they were recorded). "
            "`setting`: sequences a micro-batch (all GPUs together) x micro-batches a step x tokens a "
            "sequence, then GPUs and options; `why`: where a point did not run, its reason's first clause; "
            "`vs_1_gpu`: tokens per second over the same point's on one GPU; host and device: peak GiB; "
            "`stale`: the grid point has changed since the result was made; `commit`: `*` where the tree "
            "had uncommitted changes.", "",
            *machines_table(root), "",
            "| " + " | ".join(COLUMNS) + " |", "|" + "|".join(" --- " for _ in COLUMNS) + "|"]
    return "\n".join(head + ["| " + " | ".join(_cell(r, c) for c in COLUMNS) + " |" for r in table]) + "\n"


def csv_text(table: list[dict]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(table)
    return buf.getvalue()


def headline(table: list[dict]) -> str:
    """README's results table: HEADLINE's rows, each linked to its point file."""
    by_key = {(r["machine"], r["point"]): r for r in table}
    missing = [f"{hw}/{p}" for hw, p in HEADLINE if (hw, p) not in by_key]
    if missing:
        raise ValueError(f"HEADLINE names points with no committed result: {', '.join(missing)}")
    lines = [BEGIN, "| machine | system | model | setting | model TFLOP/s (executed) | vs 1 GPU | host GiB | point |",
             "| --- | --- | --- | --- | ---: | ---: | ---: | --- |"]
    for key in HEADLINE:
        r = by_key[key]
        rate = _cell(r, "model_tflops") + (f" ({_cell(r, 'executed_tflops')})" if r["executed_tflops"] else "")
        if r["status"] != "ok":
            rate = r["status"]
        model = f"{r['model']}, {_cell(r, 'params_B')} B"
        lines.append(f"| {r['machine']} | {r['system']} | {model} | {r['setting']} | {rate} | {_cell(r, 'vs_1_gpu')} "
                     f"| {_cell(r, 'host_GiB')} | [{r['point']}]({r['file']}) |")
    return "\n".join(lines + [END])


def readme_with_headline(readme: str, table: list[dict]) -> str:
    """README's text with its results table replaced by the one the rows make."""
    start, end = readme.index(BEGIN), readme.index(END) + len(END)
    return readme[:start] + headline(table) + readme[end:]


DECIMAL = re.compile(r"(?<![\w.])\d+\.\d+(?:\.\d+)*")


def prose(markdown_text: str) -> str:
    """Markdown without its code (fenced blocks, code spans), link targets and comments."""
    for pattern in (r"```.*?```", r"`[^`\n]*`", r"\]\([^)]*\)", r"<!--.*?-->"):
        markdown_text = re.sub(pattern, " ", markdown_text, flags=re.S)
    return markdown_text


def unsourced(readme: str, summary: str) -> list[str]:
    """The decimal numbers of README's prose that are no figure of the summary: typed by hand."""
    figures = set(DECIMAL.findall(summary))
    return sorted({n for n in DECIMAL.findall(prose(readme)) if n not in figures})


def outputs(root: Path = ROOT) -> dict[Path, str]:
    """Each generated file and the text it should hold."""
    table = rows(root)
    readme = root / "README.md"
    return {root / "results" / "summary.md": markdown(table, root),
            root / "results" / "summary.csv": csv_text(table),
            readme: readme_with_headline(readme.read_text(encoding="utf-8"), table)}


def problems(root: Path = ROOT, write: bool = False) -> list[str]:
    """What is not as the committed points make it: each generated file that differs (written anew
    where `write`), and each number of README's prose that the summary does not hold."""
    found = []
    made = outputs(root)
    for path, text in made.items():
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            if write:
                path.write_text(text, encoding="utf-8")
            else:
                found.append(f"{path.relative_to(root).as_posix()} is not current (python -m workflows.scripts.summary)")
    numbers = unsourced(made[root / "README.md"], made[root / "results" / "summary.md"])
    if numbers:
        found.append(f"README.md quotes numbers that results/summary.md does not hold: {', '.join(numbers)}")
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m workflows.scripts.summary", description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 naming what is not current")
    args = ap.parse_args(argv)
    found = problems(write=not args.check)
    print("\n".join(found), file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())

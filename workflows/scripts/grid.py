"""A benchmark grid (workflows/grids/*.yaml): its points, resolved against the defaults.

The schema (workflows/schemas/grid.schema.yaml) checks the shape; this module checks what a schema
cannot (ids unique within an experiment) and turns a point into the harness's command line. The
grid's `not_runnable` entries (points the paper has that no RunSpec can express) are data only:
nothing here turns them into jobs.

    python -m workflows.scripts.grid GRID                 # the grid's points, one experiment/id a line
    python -m workflows.scripts.grid GRID EXPERIMENT/ID   # that point's `python -m suite run` arguments
"""
from __future__ import annotations

import argparse
import copy
import functools
import json
import shlex
from pathlib import Path
from typing import Any

import yaml

SCHEMA = Path(__file__).resolve().parent.parent / "schemas" / "grid.schema.yaml"
PAPER = Path(__file__).resolve().parent.parent / "paper"  # the paper's numbers, one file per artefact


def load(path: str | Path, _including: tuple[str, ...] = ()) -> dict:
    """A grid file, with the experiments of the grids it names under `include` merged in."""
    path = Path(path)
    if path.stem in _including:
        raise ValueError(f"grid {path.stem!r} includes itself: {' -> '.join((*_including, path.stem))}")
    if not path.is_file():
        known = sorted(p.stem for p in path.parent.glob("*.yaml")) if path.parent.is_dir() else []
        raise ValueError(f"grid {path}: no such file" + (f" (beside it: {', '.join(known)})" if known else ""))
    try:
        grid = copy.deepcopy(_parse(path.read_text(encoding="utf-8")))
    except yaml.YAMLError as e:
        raise ValueError(f"grid {path} is not valid YAML: {e}") from None
    for name in grid.get("include", []):
        _merge(grid, load(path.parent / f"{name}.yaml", (*_including, path.stem)))
    return grid


# A grid's text parsed once per process (the checks load the same grids many times; PyYAML reads
# a large grid in a fraction of a second); each load gets its own copy to change.
@functools.cache
def _parse(text: str) -> dict:
    from megatrain.config import load_yaml
    return load_yaml(text)


def _merge(grid: dict, other: dict) -> None:
    """Add `other`'s experiments to `grid`: each point resolved against `other`'s defaults, its
    `expect` sized again for this grid's host; the paper artefact and not-runnable entries kept."""
    for name, exp in other["experiments"].items():
        mine = grid["experiments"].setdefault(name, {"points": []})
        if "paper" in exp:
            mine.setdefault("paper", exp["paper"])
        for p in exp["points"]:
            point = {**other["defaults"], **{k: v for k, v in p.items() if k != "expect"}}
            if point["system"] == "megatrain" and "host_gib" in grid and host_need_gib(point) > grid["host_gib"]:
                point["expect"] = "oom_host"
            mine["points"].append(point)
    grid.setdefault("not_runnable", []).extend(other.get("not_runnable", []))
    if not grid["not_runnable"]:
        del grid["not_runnable"]


def check(grid: dict) -> dict:
    """Raise ValueError on a point id used twice in one experiment (a `not_runnable` entry counts as
    a point of its experiment), a preset, paper artefact, system (suite.system.SYSTEMS), system
    option or model override that does not exist (found before any point runs, not when that point or table comes), or a `same_as` that
    names no point of the grid, a point that is itself a `same_as`, or a point of another identity
    or other steps; return the grid."""
    from megatrain.presets import PRESETS
    from megatrain.shapes import check_overrides
    from suite.system import check_spec_options
    artefacts = sorted(f.stem for f in PAPER.glob("*.yaml"))
    for name, exp in grid["experiments"].items():
        paper = exp.get("paper", [])
        for unknown in [a for a in ([paper] if isinstance(paper, str) else paper) if a not in artefacts]:
            raise ValueError(f"grid experiment {name!r}: paper {unknown!r} is none of workflows/paper/'s {artefacts}")
        seen: set[str] = set()
        ids = [p["id"] for p in exp["points"]] + [n["id"] for n in grid.get("not_runnable", []) if n["experiment"] == name]
        for i in ids:
            if i in seen:
                raise ValueError(f"grid experiment {name!r}: point id {i!r} is used twice")
            seen.add(i)
    for n in grid.get("not_runnable", []):
        if n["experiment"] not in grid["experiments"]:
            raise ValueError(f"not_runnable {n['id']!r}: unknown experiment {n['experiment']!r}")
    pts = points(grid)
    for (name, point_id), p in pts.items():
        if p["preset"] not in PRESETS:
            raise ValueError(f"grid point {name}/{point_id}: preset {p['preset']!r} is none of {sorted(PRESETS)}")
        try:
            check_spec_options(p["system"], {k.split(".")[0]: v for k, v in p["options"].items()})
            check_overrides(p["overrides"], PRESETS[p["preset"]]["model_type"], PRESETS[p["preset"]])
        except ValueError as e:
            raise ValueError(f"grid point {name}/{point_id}: {e}") from None
    for (name, point_id), p in pts.items():
        if "same_as" not in p:
            continue
        source = pts.get(tuple(p["same_as"].split("/", 1)))
        where = f"grid point {name}/{point_id}: same_as {p['same_as']!r}"
        if source is None:
            raise ValueError(f"{where} is not a point of this grid")
        if "same_as" in source:
            raise ValueError(f"{where} is itself a same_as: name the point that runs")
        if identity(source) != identity(p) or (source["steps"], source["warmup"]) != (p["steps"], p["warmup"]):
            raise ValueError(f"{where} runs something else (suite run --same-as would refuse it):\n"
                             f"  {identity(source)}, steps {source['steps']} after {source['warmup']}\n"
                             f"  {identity(p)}, steps {p['steps']} after {p['warmup']}")
    return grid


def points(grid: dict) -> dict[tuple[str, str], dict[str, Any]]:
    """(experiment, id) -> the point with every run key filled in from `defaults`."""
    out = {}
    for name, exp in grid["experiments"].items():
        for p in exp["points"]:
            full = {"accum": 1, **grid["defaults"], **p}
            full.setdefault("options", {})
            full.setdefault("overrides", {})
            out[(name, p["id"])] = full
    return out


def _value(v: Any) -> str:
    # The harness parses option values as YAML scalars: booleans must be lower case.
    return str(v).lower() if isinstance(v, bool) else str(v)


# Host bytes per parameter MegaTrain keeps without clipping: 12 with the float32 master split into
# its bf16 shadow and low halves (engine.split_masters, which auto takes wherever the compiled host
# update runs, else where whole masters would not fit: docs/host-store.md), 14 with whole masters;
# two float32 Adam moments either way. A model that fits at 12 runs: the sizing rule of the grids'
# `host_gib` and `expect: oom_host`.
HOST_BYTES_PER_PARAM = 12


def _layers(point: dict[str, Any]) -> int | None:
    """The point's decoder layers where they differ from its preset's (None: the preset's own)."""
    layers = point.get("layers")
    if layers:
        from megatrain.presets import PRESETS
        if layers == (PRESETS.get(point["preset"]) or {}).get("num_hidden_layers"):
            return None
    return layers


def model(point: dict[str, Any]) -> dict[str, Any]:
    """The RunSpec `model` of a point: its preset with `layers` and `overrides` laid on top."""
    overrides = {**point.get("overrides", {}), **({"num_hidden_layers": point["layers"]} if point.get("layers") else {})}
    return {"preset": point["preset"], **({"overrides": overrides} if overrides else {})}


def params(point: dict[str, Any]) -> int:
    """Parameters of the point's model."""
    return _params(json.dumps(model(point), sort_keys=True))


# Counted once per model and process: a grid's load sizes each of its megatrain points, and the
# checks load the same grids again and again, while a ModelShape builds every layer on the meta
# device (seconds for a deep model).
@functools.cache
def _params(model_json: str) -> int:
    from megatrain.shapes import ModelShape, load_hf_config
    from megatrain.config import ModelConfig
    return ModelShape(load_hf_config(ModelConfig(**json.loads(model_json)))).total_params()


def host_need_gib(point: dict[str, Any]) -> float:
    """MegaTrain's host memory for the point's model at HOST_BYTES_PER_PARAM (no activations)."""
    from megatrain.units import GiB
    return params(point) * HOST_BYTES_PER_PARAM / GiB


# Options that add a measurement beside the steps (the single-layer ceiling, the last step's
# timeline) without changing what the steps run.
DIAGNOSTIC_OPTIONS = frozenset({"ceiling", "trace"})


def _run(point: dict[str, Any]) -> dict[str, Any]:
    """The fields of what a point runs (`identity`'s)."""
    return {"system": point["system"], "model": model({**point, "layers": _layers(point)}), "seq": point["seq"],
            "batch": point["batch"], "accum": point["accum"],
            "options": {k: v for k, v in point.get("options", {}).items() if k not in DIAGNOSTIC_OPTIONS},
            "gpus": point.get("gpus", 1)}


def identity(point: dict[str, Any]) -> str:
    """What a point runs: system, model, shape and options but the diagnostic ones. Two points of
    one identity are one point defined twice (unless one is the other's `same_as`); steps, warm-up
    and timeout do not count, as in suite.compare's pairing of results, and the preset's own layer
    count stated as `layers` is the preset."""
    run = _run(point)
    ranks = [run["gpus"]] if run["gpus"] > 1 else []  # one GPU: as the points before the field
    return json.dumps([run["system"], run["model"], run["seq"], run["batch"], run["accum"], run["options"], *ranks],
                      sort_keys=True)


def dotted(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Options nested as a result holds them, or dotted, as a grid writes them: {"engine": {"k": 1}}
    -> {"engine.k": 1}."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        out.update(dotted(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def ran(result: dict[str, Any]) -> dict[str, Any]:
    """What a harness result ran, as a grid point's fields (its spec's; steps and timeout left out)."""
    spec = result["spec"]
    overrides = dict(spec["model"].get("overrides") or {})
    layers = overrides.pop("num_hidden_layers", None)
    return {"system": result["system"], "preset": spec["model"].get("preset") or spec["model"].get("config"),
            "layers": layers, "overrides": overrides, "seq": spec["seq_len"], "batch": spec["batch_size"],
            "accum": spec["grad_accum"], "options": dotted(spec.get("options") or {}), "gpus": spec.get("gpus") or 1}


def stale(point: dict[str, Any], result: dict[str, Any]) -> str | None:
    """How `result` differs from what `point` runs now (None: it is that point's run, perhaps over other
    steps): a result made before its grid point changed, which stands for the point no more. A refusal
    for host memory stands where only options its system's host admission does not read changed."""
    now, then = _run(point), _run(ran(result))
    changed = [k for k in now if now[k] != then[k]]
    if changed == ["options"] and result.get("status") == "oom_host":
        from suite.system import load
        keys = {k for k in {*now["options"], *then["options"]} if now["options"].get(k) != then["options"].get(k)}
        if keys <= load(point["system"]).host_blind_options:
            return None
    return "ran with " + ", ".join(f"{k} {json.dumps(then[k], sort_keys=True)} (now {json.dumps(now[k], sort_keys=True)})"
                                   for k in changed) if changed else None


def stale_results(grid: dict[str, Any]) -> list[tuple[str, str]]:
    """(path, how it differs) of each result under results/<hardware>/points made before its grid point
    changed. The workflow never deletes one: it names them, and their tables mark them `stale`."""
    out = []
    for (experiment, point_id), point in points(grid).items():
        path = Path("results", grid["hardware"], "points", experiment, f"{point_id}.json")
        if path.exists():
            why = stale(point, json.loads(path.read_text(encoding="utf-8")))
            if why:
                out.append((str(path), why))
    return out


def not_run(point: dict[str, Any]) -> dict[str, Any]:
    """A point without a result yet, shaped like a harness result with status `not_run`, so that a
    table made before the whole grid has run (`--config partial=true`) keeps its row."""
    return {"system": point["system"], "status": "not_run", "reason": "no result yet", "params": params(point),
            "spec": {"model": model(point), "seq_len": point["seq"], "batch_size": point["batch"],
                     "grad_accum": point["accum"], "gpus": point.get("gpus", 1),
                     "options": point.get("options", {})}}


def argv(point: dict[str, Any]) -> list[str]:
    """The `python -m suite run` arguments of a point (without --out)."""
    args = ["--system", point["system"], "--preset", point["preset"]]
    if point.get("layers"):
        args += ["--layers", str(point["layers"])]
    args += [f"--override={k}={_value(v)}" for k, v in sorted(point.get("overrides", {}).items())]
    args += ["--seq", str(point["seq"]), "--batch", str(point["batch"]), "--accum", str(point["accum"]),
             "--steps", str(point["steps"]), "--warmup", str(point["warmup"]),
             "--timeout", str(point["timeout"])]
    if point.get("gpus", 1) > 1:
        args += ["--gpus", str(point["gpus"])]
    args += [f"{k}={_value(v)}" for k, v in sorted(point["options"].items())]
    return args


def main(cli: list[str] | None = None) -> int:
    """List a grid's points or its stale results, or print one point's harness arguments: the route to
    run a grid point outside the workflow, e.g. from an older tree (experiments/README.md)."""
    ap = argparse.ArgumentParser(prog="python -m workflows.scripts.grid", description=main.__doc__)
    ap.add_argument("grid", help="a workflows/grids/*.yaml")
    ap.add_argument("point", nargs="?", help="EXPERIMENT/ID: print its `python -m suite run` arguments (no --out)")
    ap.add_argument("--stale", action="store_true",
                    help="list the results made before their grid point changed, to run again")
    args = ap.parse_args(cli)
    grid = check(load(args.grid))
    if args.stale:
        print("\n".join(path for path, _ in stale_results(grid)))
        return 0
    pts = points(grid)
    if args.point is None:
        print("\n".join(f"{e}/{i}" for e, i in pts))
        return 0
    key = tuple(args.point.split("/", 1))
    if key not in pts:
        ap.error(f"no point {args.point!r} in {args.grid} (list them: python -m workflows.scripts.grid {args.grid})")
    print(shlex.join(argv(pts[key])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""A benchmark grid (workflows/grids/*.yaml): its points, resolved against the defaults.

The schema (workflows/schemas/grid.schema.yaml) checks the shape; this module checks what a schema
cannot (ids unique within an experiment) and turns a point into the harness's command line.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

SCHEMA = Path(__file__).resolve().parent.parent / "schemas" / "grid.schema.yaml"


def load(path: str | Path) -> dict:
    with open(path, encoding="utf-8") as f:
        return yaml.safe_load(f)


def check(grid: dict) -> dict:
    """Raise ValueError on a point id used twice in one experiment; return the grid."""
    for name, exp in grid["experiments"].items():
        seen: set[str] = set()
        for p in exp["points"]:
            if p["id"] in seen:
                raise ValueError(f"grid experiment {name!r}: point id {p['id']!r} is used twice")
            seen.add(p["id"])
    return grid


def points(grid: dict) -> dict[tuple[str, str], dict[str, Any]]:
    """(experiment, id) -> the point with every run key filled in from `defaults`."""
    out = {}
    for name, exp in grid["experiments"].items():
        for p in exp["points"]:
            full = {"accum": 1, **grid["defaults"], **p}
            full.setdefault("options", {})
            out[(name, p["id"])] = full
    return out


def _value(v: Any) -> str:
    # The harness parses option values as YAML scalars: booleans must be lower case.
    return str(v).lower() if isinstance(v, bool) else str(v)


def argv(point: dict[str, Any]) -> list[str]:
    """The `python -m suite run` arguments of a point (without --out)."""
    args = ["--system", point["system"], "--preset", point["preset"]]
    if point.get("layers"):
        args += ["--layers", str(point["layers"])]
    args += ["--seq", str(point["seq"]), "--batch", str(point["batch"]), "--accum", str(point["accum"]),
             "--steps", str(point["steps"]), "--warmup", str(point["warmup"]),
             "--timeout", str(point["timeout"])]
    args += [f"{k}={_value(v)}" for k, v in sorted(point["options"].items())]
    return args

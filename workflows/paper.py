"""The paper's published numbers (workflows/paper/*.yaml): load, validate, and tabulate them.

Every row that comes out of `rows()` carries source="paper", so a table or figure that puts the
paper beside our measurements can never mix the two up. pandas is imported only by `rows()`:
validation needs nothing beyond pyyaml.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

PAPER_DIR = Path(__file__).resolve().parent / "paper"

REQUIRED = {"artefact": str, "title": str, "section": str, "source_note": str, "hardware": str,
            "columns": list, "rows": list}
OPTIONAL = {"notes": list, "conditions": dict, "related": str}
COLUMN_KEYS = {"name", "unit", "printed", "description"}
# Added by rows(); a data file may not declare them.
RESERVED = {"source", "artefact"}


def files() -> list[Path]:
    """Every artefact file, in name order."""
    return sorted(PAPER_DIR.glob("*.yaml"))


def _path(artefact_file: str | Path) -> Path:
    """A path, or a file stem such as "table4_ablations" (looked up in PAPER_DIR)."""
    p = Path(artefact_file)
    if p.suffix in (".yaml", ".yml") or p.exists():
        return p
    return PAPER_DIR / f"{artefact_file}.yaml"


def validate(data: Any, where: str) -> dict:
    """Raise ValueError naming `where` and the problem; return `data` if it is well formed."""
    if not isinstance(data, dict):
        raise ValueError(f"{where}: the file must hold a mapping, not {type(data).__name__}")
    missing = [k for k in REQUIRED if k not in data]
    if missing:
        raise ValueError(f"{where}: missing required keys {missing}")
    unknown = sorted(set(data) - set(REQUIRED) - set(OPTIONAL))
    if unknown:
        raise ValueError(f"{where}: unknown top-level keys {unknown} "
                         f"(allowed: {sorted(REQUIRED)} and {sorted(OPTIONAL)})")
    for key, typ in {**REQUIRED, **OPTIONAL}.items():
        if key in data and not isinstance(data[key], typ):
            raise ValueError(f"{where}: {key!r} must be a {typ.__name__}, "
                             f"not {type(data[key]).__name__}")
    if not data["columns"]:
        raise ValueError(f"{where}: 'columns' is empty")

    names: list[str] = []
    for i, col in enumerate(data["columns"]):
        if not isinstance(col, dict) or not isinstance(col.get("name"), str):
            raise ValueError(f"{where}: column {i} must be a mapping with a string 'name'")
        if "unit" not in col:
            raise ValueError(f"{where}: column {col['name']!r} has no 'unit' (use null for none)")
        extra = sorted(set(col) - COLUMN_KEYS)
        if extra:
            raise ValueError(f"{where}: column {col['name']!r} has unknown keys {extra}")
        if col["name"] in RESERVED:
            raise ValueError(f"{where}: column name {col['name']!r} is reserved (added by rows())")
        if col["name"] in names:
            raise ValueError(f"{where}: column {col['name']!r} is declared twice")
        names.append(col["name"])

    declared = set(names)
    for i, row in enumerate(data["rows"]):
        if not isinstance(row, dict):
            raise ValueError(f"{where}: row {i} must be a mapping, not {type(row).__name__}")
        undeclared = sorted(set(row) - declared)
        if undeclared:
            raise ValueError(f"{where}: row {i} has undeclared columns {undeclared}")
        for key, value in row.items():
            # Cells are what was printed: a number, a string ("OOM", "-"), or null for a blank.
            if isinstance(value, bool) or not isinstance(value, (int, float, str, type(None))):
                raise ValueError(f"{where}: row {i}, column {key!r}: a cell must be a number, a "
                                 f"string or null, not {type(value).__name__}")
    return data


def load(artefact_file: str | Path) -> dict:
    """One artefact's data, validated."""
    path = _path(artefact_file)
    with open(path, encoding="utf-8") as f:
        return validate(yaml.safe_load(f), str(path))


def rows(name: str | Path):
    """The artefact's rows as a DataFrame, columns in declared order, plus artefact and source="paper"."""
    import pandas as pd

    data = load(name)
    columns = [c["name"] for c in data["columns"]]
    df = pd.DataFrame(data["rows"], columns=columns)
    df["artefact"] = data["artefact"]
    df["source"] = "paper"
    return df

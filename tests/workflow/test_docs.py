"""The generated documents are what the committed points and the code make: results/summary.md and
.csv, README.md's results table and every decimal number of its prose, docs/config.md. A hand edit
of any of them fails, shown on a copy of the files the check reads."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from megatrain.config import settings_fields, settings_help
from workflows.scripts import config_reference, summary

ROOT = Path(__file__).resolve().parents[2]


def test_the_summary_and_readme_are_what_the_committed_points_make():
    assert summary.problems(ROOT) == []


def test_readme_is_a_door_under_200_lines():
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) < 200


@pytest.fixture(scope="module")
def copy(tmp_path_factory) -> Path:
    """The files the summary's check reads, copied: README.md, the summary, the grids, the points."""
    root = tmp_path_factory.mktemp("repo")
    shutil.copy(ROOT / "README.md", root / "README.md")
    shutil.copytree(ROOT / "workflows" / "grids", root / "workflows" / "grids")
    for name in ("summary.md", "summary.csv"):
        (root / "results").mkdir(exist_ok=True)
        shutil.copy(ROOT / "results" / name, root / "results" / name)
    for hw in summary.machines(ROOT):
        shutil.copytree(ROOT / "results" / hw / "points", root / "results" / hw / "points")
    assert summary.problems(root) == []
    return root


def _edited(path: Path, old: str, new: str):
    text = path.read_text(encoding="utf-8")
    assert old in text
    path.write_text(text.replace(old, new, 1), encoding="utf-8")
    return text


def test_a_readme_number_typed_by_hand_fails(copy):
    readme = copy / "README.md"
    # In the prose: a number the summary does not hold.
    original = _edited(readme, "## Results\n", "## Results\n\nMegaTrain runs 1.97x faster on two GPUs.\n")
    try:
        assert summary.problems(copy) == ["README.md quotes numbers that results/summary.md does not hold: 1.97"]
    finally:
        readme.write_text(original, encoding="utf-8")
    # In the generated table: the table is no longer the summary's rows.
    _edited(readme, "| 1.950x |", "| 1.97x |")
    try:
        assert summary.problems(copy) == ["README.md is not current (python -m workflows.scripts.summary)"]
    finally:
        readme.write_text(original, encoding="utf-8")


def test_a_summary_edited_by_hand_or_left_stale_fails(copy):
    md = copy / "results" / "summary.md"
    original = _edited(md, "| 918.0 |", "| 981.0 |")
    try:
        assert summary.problems(copy) == ["results/summary.md is not current (python -m workflows.scripts.summary)"]
    finally:
        md.write_text(original, encoding="utf-8")
    point = copy / "results" / "h200" / "points" / "gpus" / "7b_g2.json"
    result = json.loads(point.read_text(encoding="utf-8"))
    kept = point.read_text(encoding="utf-8")
    result["median"]["model_tflops"] = 981.0  # a new result promoted without regenerating the summary
    point.write_text(json.dumps(result), encoding="utf-8")
    try:
        found = summary.problems(copy)
        assert "results/summary.md is not current (python -m workflows.scripts.summary)" in found
        assert "README.md is not current (python -m workflows.scripts.summary)" in found  # its headline row
    finally:
        point.write_text(kept, encoding="utf-8")


def test_the_summary_says_what_the_points_say():
    rows = {(r["machine"], r["point"]): r for r in summary.rows(ROOT)}
    two = rows[("h200", "gpus/7b_g2")]
    one = json.loads((ROOT / "results/h200/points/gpus/7b_g1.json").read_text())
    assert two["vs_1_gpu"] == pytest.approx(two["tokens_per_s"] / one["median"]["tokens_per_s"])
    assert summary.FORMATS["vs_1_gpu"].format(two["vs_1_gpu"]) == "1.950x"
    # 512K tokens: the model's count takes causal attention as the whole square, the kernels run half.
    long = rows[("h200", "long_context/ctx512k_L28")]
    assert long["executed_tflops"] < 0.75 * long["model_tflops"]
    assert "accumulate" in rows[("h200x4", "gpus/7b_g4_fsdp2")]["stale"]
    assert "cpu" not in summary.machines(ROOT)  # the smoke grid's numbers measure nothing


def test_the_settings_reference_is_generated_from_the_config():
    assert (ROOT / "docs" / "config.md").read_text(encoding="utf-8") == config_reference.markdown(), \
        "docs/config.md is not current: python -m workflows.scripts.config_reference"
    doc, help_text = config_reference.markdown(), settings_help()
    for _, key, _, _, meaning in settings_fields():
        assert meaning, f"{key} has no comment in megatrain/config.py"
        assert f"| `{key}` |" in doc and f"  {key}: " in help_text
    master = next(m for _, k, _, _, m in settings_fields() if k == "engine.master_dtype")
    assert "12 B/param" in master and "10 B/param" in master  # docs/architecture.md's bytes per parameter


def test_the_architecture_names_every_engine_module():
    """docs/architecture.md's module table names each of the engine's modules (a module added
    without its line there fails)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    modules = sorted(p.name for p in (ROOT / "megatrain").glob("*.py") if p.name != "__init__.py")
    assert [m for m in modules if f"`{m}`" not in text] == []

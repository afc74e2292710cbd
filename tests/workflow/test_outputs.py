"""Every committed table and figure is what the committed points make (workflows/scripts/outputs.py):
each table under results/*/tables made again and byte-identical, each figure under plots/ with a
current record of its inputs, no figure of an experiment with nothing measured; and the check fails
on a table or figure edited by hand or left stale (in a temporary copy of one experiment's files)."""
import contextlib
import json
import shutil
from pathlib import Path

from workflows.scripts import outputs

ROOT = Path(__file__).resolve().parents[2]


def test_every_committed_table_is_what_the_committed_points_make():
    with contextlib.chdir(ROOT):
        assert outputs.check_tables() == []


def test_every_committed_figure_records_its_current_inputs_and_draws_something_measured():
    with contextlib.chdir(ROOT):
        assert outputs.check_figures() == []


def _copy(tmp: Path, hardware: str, experiment: str) -> None:
    """The experiment's points, table and figure, the grids and the code that makes them, under tmp."""
    for part in (f"results/{hardware}/points/{experiment}", "workflows"):
        shutil.copytree(ROOT / part, tmp / part, ignore=shutil.ignore_patterns("__pycache__"))
    for folder, names in ((f"results/{hardware}/tables", ("csv", "md")), (f"plots/{hardware}", ("png", "pdf", "inputs.json"))):
        (tmp / folder).mkdir(parents=True, exist_ok=True)
        for ext in names:
            shutil.copy2(ROOT / folder / f"{experiment}.{ext}", tmp / folder / f"{experiment}.{ext}")


def test_a_table_or_figure_edited_by_hand_or_left_stale_fails(tmp_path, monkeypatch):
    hardware, experiment = "h100", "shared"
    only = {f"{hardware}/{experiment}"}
    _copy(tmp_path, hardware, experiment)
    monkeypatch.chdir(tmp_path)
    table, png = Path(f"results/{hardware}/tables/{experiment}.md"), Path(f"plots/{hardware}/{experiment}.png")
    assert outputs.check_tables(only) == [] and outputs.check_figures(only) == []

    committed = table.read_text()
    table.write_text(committed.replace("303.8", "313.8") if "303.8" in committed else committed + "\n")
    assert [p for p in outputs.check_tables(only) if str(table) in p]  # a number edited by hand
    table.write_text(committed)

    drawn = png.read_bytes()
    png.write_bytes(drawn + b"\0")
    assert [p for p in outputs.check_figures(only) if "edited by hand" in p]
    png.write_bytes(drawn)

    # a point changed and its table not made again: the table is stale; made again, the figure is
    point = sorted(Path(f"results/{hardware}/points/{experiment}").glob("*.json"))[0]
    result = json.loads(point.read_text())
    result["median"]["model_tflops"] *= 1.5
    point.write_text(json.dumps(result))
    assert [p for p in outputs.check_tables(only) if "not what the committed points make" in p]
    outputs.remake_table(hardware, experiment, table.parent)
    assert outputs.check_tables(only) == []
    assert [p for p in outputs.check_figures(only) if "changed since the figure was drawn" in p]

    # a figure whose record is gone, and one of an experiment with no point that ran
    record = outputs.record_path(png)
    record.unlink()
    assert [p for p in outputs.check_figures(only) if "no record" in p]
    for f in point.parent.glob("*.json"):
        f.write_text(json.dumps({**json.loads(f.read_text()), "status": "oom_device"}))
    outputs.record([png, png.with_suffix(".pdf")], [table.with_suffix(".csv")], [])
    assert [p for p in outputs.check_figures(only) if "a figure of nothing measured" in p]

"""A grid point with `same_as` (the same run as another point of its grid) is run once (CPU)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatrain.presets import PRESETS
from workflows.scripts import grid as gridlib

pytestmark = pytest.mark.slow  # minutes on the 2-core machine: `pytest -m "not slow"` leaves them out

ROOT = Path(__file__).resolve().parents[2]
TINY_LAYERS = PRESETS["tiny-llama"]["num_hidden_layers"]


def _grid(points: str) -> dict:
    text = ("hardware: t\ndefaults: {seq: 8, batch: 1, accum: 1, steps: 1, warmup: 0, timeout: 60}\n"
            f"experiments:\n  scale:\n    points:\n      - {{id: a, system: native, preset: tiny-llama}}\n"
            f"  depth:\n    points:\n{points}")
    import yaml
    return yaml.safe_load(text)


def test_a_preset_stated_layer_count_is_the_preset():
    base = {"system": "native", "preset": "tiny-llama", "seq": 8, "batch": 1, "accum": 1, "options": {}}
    assert gridlib.identity(base) == gridlib.identity({**base, "layers": TINY_LAYERS})
    assert gridlib.identity(base) != gridlib.identity({**base, "layers": TINY_LAYERS + 1})


@pytest.mark.parametrize("point, message", [
    ("{id: b, system: native, preset: tiny-llama, same_as: scale/nope}", "not a point of this grid"),
    (f"{{id: b, system: native, preset: tiny-llama, layers: {TINY_LAYERS + 1}, same_as: scale/a}}", "runs something else"),
    ("{id: b, system: zero3, preset: tiny-llama, same_as: scale/a}", "runs something else"),
    ("{id: b, system: native, preset: tiny-llama, steps: 2, same_as: scale/a}", "runs something else"),
])
def test_a_same_as_must_name_a_point_of_the_same_run(point, message):
    with pytest.raises(ValueError, match=message):
        gridlib.check(_grid(f"      - {point}\n"))


def test_a_same_as_must_name_the_point_that_runs():
    with pytest.raises(ValueError, match="itself a same_as"):
        gridlib.check(_grid("      - {id: b, system: native, preset: tiny-llama, same_as: scale/a}\n"
                            "      - {id: c, system: native, preset: tiny-llama, same_as: depth/b}\n"))


def test_suite_run_refuses_a_same_as_of_another_run(tmp_path, capsys, monkeypatch):
    """In this process (the refusal comes before any worker): `suite run`'s exit status and message."""
    from suite.__main__ import main
    source = tmp_path / "a.json"
    source.write_text(json.dumps({"status": "ok", "spec": {"system": "native", "model": {"preset": "tiny-llama"},
                                                           "seq_len": 8, "batch_size": 1}}))
    monkeypatch.delenv("PYTORCH_NVML_BASED_CUDA_CHECK", raising=False)  # `suite run` sets it; gone afterwards
    assert main(["run", "--system", "native", "--preset", "tiny-llama", "--seq", "16", "--batch", "1",
                 "--same-as", str(source), "--out", str(tmp_path / "b.json")]) == 2
    assert "runs something else" in capsys.readouterr().err
    assert not (tmp_path / "b.json").exists()


def test_a_same_as_point_takes_its_sources_one_run():
    """Asked for alone, the `same_as` point has its source made first, then writes that result as
    its own: its spec (the depth table's layer count), the source named, the measurement the same."""
    pytest.importorskip("snakemake")
    hw = f"sameas{os.getpid()}"
    grid = ROOT / f".pytest-{hw}.yaml"
    grid.write_text(f"hardware: {hw}\ndefaults: {{seq: 8, batch: 1, accum: 1, steps: 1, warmup: 0, timeout: 120}}\n"
                    "experiments:\n  scale:\n    points:\n      - {id: a, system: native, preset: tiny-llama}\n"
                    "  depth:\n    points:\n"
                    f"      - {{id: b, system: native, preset: tiny-llama, layers: {TINY_LAYERS}, same_as: scale/a}}\n")
    try:
        done = subprocess.run([sys.executable, "-m", "snakemake", "--profile", "profiles/cpu", "-c1",
                               f"results/{hw}/points/depth/b.json", "--config", f"grid={grid}"],
                              cwd=ROOT, capture_output=True, text=True, timeout=300,
                              env={**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"})
        assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
        a = json.loads((ROOT / f"results/{hw}/points/scale/a.json").read_text())
        b = json.loads((ROOT / f"results/{hw}/points/depth/b.json").read_text())
        assert a["status"] == "ok" and b["same_as"] == f"results/{hw}/points/scale/a.json"
        assert b["median"] == a["median"] and b["env"] == a["env"]
        assert b["spec"]["model"] == {"preset": "tiny-llama", "overrides": {"num_hidden_layers": TINY_LAYERS}}
        assert not (ROOT / f"results/{hw}/points/depth/b.log").exists()  # no worker ran for it
    finally:
        grid.unlink(missing_ok=True)
        for kind in ("results", "logs", "plots"):
            subprocess.run(["rm", "-rf", str(ROOT / kind / hw)])

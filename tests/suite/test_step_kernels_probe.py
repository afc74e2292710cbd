"""experiments/probes/step_kernels.py on the CPU, in this process (a check of the probe, not a
measurement): each depth's JSON holds the ceiling, a step's layer-pass spans and its kernels by kind;
--compare gives the per-layer table of two depths and refuses one depth twice."""
from __future__ import annotations

import json
import sys

import pytest

from experiments.probes import step_kernels

def probe(monkeypatch, capsys, *args: str) -> str:
    """The probe's command line, run in this process (its main() reads sys.argv): what it printed.
    A fresh Python for each of the four calls cost torch's import each time and tested nothing more."""
    monkeypatch.setattr(sys, "argv", ["step_kernels.py", *args])
    capsys.readouterr()
    step_kernels.main()
    return capsys.readouterr().out


def test_step_kernels_per_layer(tmp_path, monkeypatch, capsys):
    out = {}
    for layers in (1, 2):
        out[layers] = tmp_path / f"s{layers}.json"
        probe(monkeypatch, capsys, "--preset", "tiny-qwen2", "--seq", "32", "--batch", "2", "--accum", "2",
              "--device", "cpu", "--layers", str(layers), "--out", str(out[layers]))
        r = json.loads(out[layers].read_text())
        assert r["layers"] == layers and r["accum"] == 2 and r["ceiling"]["seconds"] > 0
        assert set(r["step"]["layer_pass_spans_s"]) == {"forward", "recompute", "backward"}
        assert min(r["step"]["layer_pass_spans_s"].values()) > 0 and r["step"]["seconds_by_kind"]["matmul"] > 0
    table = probe(monkeypatch, capsys, "--compare", str(out[2]), str(out[1]))
    assert "2 x 32 x 2, layers 1 -> 2, ms a layer-step" in table and "spans" in table
    with pytest.raises(SystemExit) as refused:  # the command's exit: status 1, the message on stderr
        probe(monkeypatch, capsys, "--compare", str(out[1]), str(out[1]))
    assert "two depths" in str(refused.value.code)

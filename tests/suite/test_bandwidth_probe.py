"""experiments/probes/bandwidth.py: one JSON of every memory tier, absent tiers named, the disk file
always removed, bad input refused before anything is written. Run in-process in --quick mode."""
from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import torch

PROBE = Path(__file__).resolve().parents[2] / "experiments" / "probes" / "bandwidth.py"
_spec = importlib.util.spec_from_file_location("bandwidth_probe", PROBE)
bandwidth = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = bandwidth  # dataclasses looks its module up there
_spec.loader.exec_module(bandwidth)

CUDA_DIRECTIONS = {("hbm", "device-to-device"), ("pcie", "h2d-pinned"), ("pcie", "d2h-pinned"),
                   ("pcie", "h2d+d2h-pinned"), ("pcie", "h2d-pageable")}


def run_probe(tmp_path, *extra: str) -> tuple[dict, Path]:
    disk = tmp_path / "disk"
    disk.mkdir(exist_ok=True)
    out = tmp_path / "probes" / "bandwidth.json"
    assert bandwidth.main(["--out", str(out), "--quick", "--disk-dir", str(disk), *extra]) == 0
    return json.loads(out.read_text()), disk


def by_key(result: dict) -> dict[tuple[str, str], dict]:
    return {(r["tier"], r["direction"]): r for r in result["tiers"]}


def test_quick_run_writes_every_tier(tmp_path, capsys):
    result, disk = run_probe(tmp_path)
    rows = by_key(result)
    assert set(rows) == {("host", "copy"), ("disk", "write"), ("disk", "read")} | CUDA_DIRECTIONS
    assert len(rows) == len(result["tiers"])  # no tier twice
    for row in result["tiers"]:
        assert {"tier", "direction", "status", "gbps", "bytes", "repeats", "method"} <= set(row)
    host = rows["host", "copy"]
    assert host["status"] == "ok" and host["gbps"] > 0
    assert host["counts"] == "read+write" and host["bytes"] == 2 * host["buffer_bytes"]
    assert len(host["samples_s"]) == host["repeats"] >= 3 and host["warmup_s"]
    for direction in ("write", "read"):
        row = rows["disk", direction]
        assert row["status"] == "ok" and row["gbps"] > 0 and row["bytes"] == result["config"]["disk_bytes"]
    assert rows["disk", "read"]["cache_bypass"] in ("o_direct", "fadvise_dontneed")
    for key in CUDA_DIRECTIONS:
        if torch.cuda.is_available():
            assert rows[key]["status"] == "ok" and rows[key]["gbps"] > 0
        else:
            assert rows[key]["status"] == "absent" and rows[key]["gbps"] is None and "CUDA" in rows[key]["reason"]
    assert result["env"]["torch"] == torch.__version__ and "git_commit" in result["env"]
    assert os.listdir(disk) == []  # the test file is gone
    printed = capsys.readouterr().out
    assert "host" in printed and "disk" in printed and "wrote" in printed


def test_read_falls_back_to_fadvise_without_o_direct(tmp_path, monkeypatch):
    monkeypatch.delattr(os, "O_DIRECT", raising=False)
    result, disk = run_probe(tmp_path, "--size-gib", "0.001", "--disk-gib", "0.001")
    read = by_key(result)["disk", "read"]
    assert read["status"] == "ok" and read["cache_bypass"] == "fadvise_dontneed"
    assert "posix_fadvise" in read["method"]
    assert os.listdir(disk) == []


def test_disk_failure_is_a_row_and_the_file_is_removed(tmp_path, monkeypatch):
    def no_space(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", no_space)
    result, disk = run_probe(tmp_path, "--size-gib", "0.001", "--disk-gib", "0.001")
    rows = by_key(result)
    for direction in ("write", "read"):
        assert rows["disk", direction]["status"] == "error"
        assert "No space left" in rows["disk", direction]["reason"]
    assert rows["host", "copy"]["status"] == "ok"
    assert os.listdir(disk) == []


@pytest.mark.parametrize("args, message", [
    (["--size-gib", "0"], "--size-gib must be positive"),
    (["--size-gib", "-1"], "--size-gib must be positive"),
    (["--size-gib", "nan"], "--size-gib must be positive"),
    (["--size-gib", "0.0001"], "--size-gib must be at least 1 MiB"),
    (["--disk-gib", "0"], "--disk-gib must be positive"),
    (["--disk-gib", "1e9"], "GiB free"),
    (["--disk-dir", "{tmp}/missing"], "does not exist"),
    (["--size-gib", "1e9"], "of host memory"),
    (["--out", "{tmp}"], "is a directory"),
])
def test_bad_input_is_refused_before_writing(tmp_path, capsys, args, message):
    out = tmp_path / "out" / "bandwidth.json"
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    with pytest.raises(SystemExit) as exc:
        bandwidth.main(["--out", str(out), "--quick", *args])  # a later --out wins
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
    assert not out.parent.exists()
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".megatrain-bandwidth-")]

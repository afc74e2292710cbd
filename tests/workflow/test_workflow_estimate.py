"""A grid's points without a result, estimated from the results made on its hardware (CPU)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from workflows.scripts import estimate

GiB = 1 << 30


def _grid(points: list[dict]) -> dict:
    return {"hardware": "est", "defaults": {"seq": 32, "batch": 2, "accum": 2, "steps": 3, "warmup": 1, "timeout": 60},
            "experiments": {"e": {"points": points}}}


def _result(root: Path, point_id: str, system: str, grid: dict, wall: float, steps: list[float], **extra) -> None:
    point = {**grid["defaults"], **next(p for p in grid["experiments"]["e"]["points"] if p["id"] == point_id)}
    path = root / "results" / "est" / "points" / "e" / f"{point_id}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"system": system, "status": "ok", "params": estimate.grids.params(point),
                                "model_flops_per_step": estimate._spec(point).model_flops_per_step(), "wall_s": wall,
                                "steps": [{"step_time_s": s} for s in steps],
                                "env": {"gpu_memory_bytes": 140 * GiB}, "spec": estimate._spec(point).to_dict(),
                                **extra}))


def test_a_point_is_estimated_from_its_systems_nearest_result(tmp_path):
    """The nearest result's wall less its steps, scaled by parameters, and its mean step, scaled by
    the model FLOPs, for the point's steps; a point with a result is not listed; a refusal the grid
    expects is short; a system (or GPU count) with no result on the hardware is unknown."""
    grid = _grid([{"id": "ran", "system": "native", "preset": "tiny-llama"},
                  {"id": "longer", "system": "native", "preset": "tiny-llama", "seq": 64, "steps": 5},
                  {"id": "refused", "system": "native", "preset": "tiny-llama", "expect": "oom_host"},
                  {"id": "other", "system": "zero3", "preset": "tiny-llama"},
                  {"id": "two", "system": "native", "preset": "tiny-llama", "gpus": 2}])
    _result(tmp_path, "ran", "native", grid, wall=100.0, steps=[20.0, 10.0, 10.0, 10.0])
    left = estimate.missing(grid, tmp_path)
    assert list(left) == ["e/longer", "e/refused", "e/other", "e/two"]
    points = {p["id"]: {**grid["defaults"], **p} for p in grid["experiments"]["e"]["points"]}
    flops = {i: estimate._spec(points[i]).model_flops_per_step() for i in ("longer", "ran")}
    ratio = flops["longer"] / flops["ran"]
    assert ratio > 2  # twice the tokens, and attention's square
    assert left["e/longer"] == pytest.approx(50.0 + 12.5 * ratio * 6 + estimate.JOB_OVERHEAD_S)
    assert left["e/refused"] == estimate.REFUSAL_S + estimate.JOB_OVERHEAD_S
    assert left["e/other"] is None and left["e/two"] is None  # no result of its system, or on its GPU count


def test_an_fsdp2_point_is_estimated_from_one_that_summed_where_it_will(tmp_path, monkeypatch):
    """FSDP2's `auto` sums on the GPU or on the host (steps fourfold apart): a point is estimated from
    a result that summed where its own `auto` will on the hardware's GPU, else unknown; summed on the
    host, its step goes with the parameters, not the FLOPs."""
    from baselines import fsdp2
    grid = _grid([{"id": "ran", "system": "fsdp2", "preset": "tiny-llama"},
                  {"id": "new", "system": "fsdp2", "preset": "tiny-llama", "seq": 64}])
    _result(tmp_path, "ran", "fsdp2", grid, wall=100.0, steps=[10.0] * 4, info={"accumulate": "host"})
    assert estimate.missing(grid, tmp_path) == {"e/new": None}  # a tiny model sums on a 140 GiB GPU
    monkeypatch.setattr(fsdp2, "AUTO_SLACK", 200 * GiB)  # as if it did not fit
    assert estimate.missing(grid, tmp_path)["e/new"] == pytest.approx(60.0 + 10.0 * 4 + estimate.JOB_OVERHEAD_S)


def test_a_point_its_systems_host_admission_refuses_is_short(tmp_path):
    """A ZeRO-3 Offload point over the host its results were stated with (its 29 B a parameter,
    counted as its admission counts them) is a refusal; under it, or with admission off, it is
    estimated as if it ran; a system without a host rate (native) is never refused so."""
    from baselines import hf
    grid = _grid([{"id": "ran", "system": "zero3", "preset": "tiny-llama"},
                  {"id": "big", "system": "zero3", "preset": "tiny-llama", "seq": 64},
                  {"id": "tried", "system": "zero3", "preset": "tiny-llama", "seq": 64,
                   "options": {"admission": False}},
                  {"id": "native", "system": "native", "preset": "tiny-llama", "seq": 64}])
    points = {p["id"]: {**grid["defaults"], **p} for p in grid["experiments"]["e"]["points"]}
    need = hf.host_need(estimate._spec(points["big"]), 29)[0]
    for stated, refused in [(need * 0.99 / GiB, True), (need * 1.01 / GiB, False)]:
        _result(tmp_path, "ran", "zero3", grid, wall=100.0, steps=[10.0] * 4)
        path = tmp_path / "results" / "est" / "points" / "e" / "ran.json"
        result = json.loads(path.read_text())
        result["env"]["host_memory_stated_gb"] = stated
        path.write_text(json.dumps(result))
        left = estimate.missing(grid, tmp_path)
        assert (left["e/big"] == estimate.REFUSAL_S + estimate.JOB_OVERHEAD_S) == refused
        assert left["e/tried"] > estimate.REFUSAL_S + estimate.JOB_OVERHEAD_S
        assert left["e/native"] is None


def test_a_point_its_systems_device_admission_refuses_is_short(tmp_path, monkeypatch):
    """Native counts its device need from the spec alone: a point over the results' GPU (less the
    CUDA context) is a refusal, one under it or with admission off is estimated as if it ran; a
    system whose admission counts at run time (FSDP2) is not foreseen so."""
    from baselines import native
    grid = _grid([{"id": "ran", "system": "native", "preset": "tiny-llama"},
                  {"id": "big", "system": "native", "preset": "tiny-llama", "seq": 64},
                  {"id": "tried", "system": "native", "preset": "tiny-llama", "seq": 64,
                   "options": {"admission": False}}])
    _result(tmp_path, "ran", "native", grid, wall=100.0, steps=[10.0] * 4)  # on a 140 GiB GPU
    refusal = estimate.REFUSAL_S + estimate.JOB_OVERHEAD_S
    for need, refused in [(140 * GiB, True), (139 * GiB, False)]:
        monkeypatch.setattr(native, "device_need", lambda spec, need=need: (need, "counted"))
        left = estimate.missing(grid, tmp_path)
        assert (left["e/big"] == refusal) == refused
        assert left["e/tried"] > refusal
    from baselines.fsdp2 import FSDP2
    assert FSDP2.device_need(estimate._spec({**grid["defaults"], "system": "fsdp2", "preset": "tiny-llama"})) is None


def test_each_result_is_checked_against_its_estimate_from_the_others(tmp_path):
    """--check: a trained point's wall beside its estimate from the other results of the hardware
    (less the job's overhead), never from itself; a point alone for its system has none."""
    grid = _grid([{"id": "a", "system": "native", "preset": "tiny-llama"},
                  {"id": "b", "system": "native", "preset": "tiny-llama", "seq": 64},
                  {"id": "c", "system": "zero3", "preset": "tiny-llama"}])
    _result(tmp_path, "a", "native", grid, wall=100.0, steps=[10.0] * 4)
    _result(tmp_path, "b", "native", grid, wall=300.0, steps=[50.0] * 4)
    _result(tmp_path, "c", "zero3", grid, wall=50.0, steps=[5.0] * 4)
    checked = estimate.held_out(grid, tmp_path)
    results = estimate.measured("est", tmp_path)
    assert checked["e/a"] == (100.0, estimate.estimate({**grid["defaults"], **grid["experiments"]["e"]["points"][0]},
                                                      [results[1]]) - estimate.JOB_OVERHEAD_S)
    assert checked["e/a"][1] != 100.0 and checked["e/b"][1] != 300.0
    assert checked["e/c"] == (50.0, None)

"""How long the points of a grid without a result will take on its hardware, from the results made
there: to plan a session on a machine held for a fixed time, and to start no point that would be
cut off at its end (experiments/workflow_gpu.sh's DEADLINE).

    python -m workflows.scripts.estimate GRID           # experiment/id and seconds (- unknown) a line
    python -m workflows.scripts.estimate GRID --check   # each result's wall beside its estimate

(the total and the check's summary on stderr)

A point's estimate comes from the measured point of its system and GPU count nearest in parameters
and in model FLOPs a step: its wall less its steps (start, set-up, close) scaled by the parameters,
and its mean step (the warm-up's included) scaled by the FLOPs, for as many steps as this point
runs, plus JOB_OVERHEAD_S. Where the system says where it sums a step's micro-batches
(`System.summing`; FSDP2's `accumulate`: on the GPU or on the host, whose steps differ fourfold),
only a point that summed them where this one will; summed on the host, its step
is scaled by the parameters: it is mostly every micro-batch's gradients copied to the host and added
there (on the four-GPU host, 14B to width's w4.0: 1.31x the parameters, 1.10x the FLOPs, 1.46x the
step). A point the grid expects refused (`expect`), or that its system's host admission refuses at
the host size its results were stated (`refused_for_host`), or that its device admission refuses on
the results' GPU where it counts from the spec alone (`refused_for_device`: native's), takes
REFUSAL_S; another refusal (the disk's) is not foreseen: it is estimated as if it ran. Unknown
where no point of its system (and summing) has run on the hardware.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from megatrain.units import GiB
from workflows.scripts import grid as grids

# What a point takes beyond its harness wall (the result's wall_s): Snakemake's start and its job's
# round, the point process's start: on the four-GPU host a refusal of 19 s took a 39 s job.
JOB_OVERHEAD_S = 30.0
# The GPU memory a point's process finds in use before it allocates (its CUDA context), which FSDP2's
# `auto` does not see free: 0.6 GiB by NVML on the H200s
CONTEXT_BYTES = GiB * 6 // 10
# a refusal's harness wall: 13-21 s on the four-GPU host
REFUSAL_S = 20.0


def _spec(point: dict[str, Any]):
    from suite.spec import RunSpec
    return RunSpec.from_dict({"system": point["system"], **grids.not_run(point)["spec"]})


def summing(point: dict[str, Any], gpu_bytes: int | None) -> str | None:
    """Where the point will sum its micro-batches on a GPU of `gpu_bytes` (System.summing; None: its
    system does not say, or the GPU is unknown)."""
    from suite.system import load
    try:
        spec = _spec(point)
    except ValueError:  # a spec the harness refuses (its message says why when it runs)
        return None
    return load(point["system"]).summing(spec, None if gpu_bytes is None else gpu_bytes - CONTEXT_BYTES)


def measured(hardware: str, root: Path = Path(".")) -> list[dict[str, Any]]:
    """The results that trained under results/<hardware>/points."""
    out = []
    for path in sorted((root / "results" / hardware / "points").glob("*/*.json")):
        r = json.loads(path.read_text(encoding="utf-8"))
        if r.get("status") == "ok" and r.get("wall_s") and r.get("params"):
            out.append(r)
    return out


def refused_for_host(point: dict[str, Any], stated_gb: float | None) -> bool:
    """Whether the point's system refuses it for a host of `stated_gb` (None: unknown, no): its own
    bytes a parameter (HOST_BYTES_PER_PARAM, where its admission reads one) through the count its
    admission makes (hf.host_need)."""
    from baselines import hf
    from megatrain.resolve import host_available_bytes
    from suite.system import load
    system = load(point["system"])
    rate = getattr(system, "HOST_BYTES_PER_PARAM", None)
    if stated_gb is None or rate is None or not point.get("options", {}).get("admission", True):
        return False
    need, _ = hf.host_need(_spec(point), rate, getattr(system, "RANK_BYTES_PER_PARAM", 0.0))
    return need > host_available_bytes(stated_gb)


def refused_for_device(point: dict[str, Any], gpu_bytes: int | None) -> bool:
    """Whether the point's system refuses it for a GPU of `gpu_bytes` (None: unknown, no), where
    its admission counts the need from the spec alone (System.device_need)."""
    from suite.system import load
    if gpu_bytes is None or not point.get("options", {}).get("admission", True):
        return False
    try:
        need = load(point["system"]).device_need(_spec(point))
    except ValueError:  # a spec the harness refuses (its message says why when it runs)
        return False
    return need is not None and need[0] > gpu_bytes - CONTEXT_BYTES


def estimate(point: dict[str, Any], results: list[dict[str, Any]]) -> float | None:
    """Seconds the point is expected to take (module docstring); None: unknown."""
    env = next((r["env"] for r in results if r.get("env")), {})
    gpu = env.get("gpu_memory_bytes")
    if (point.get("expect") or refused_for_host(point, env.get("host_memory_stated_gb"))
            or refused_for_device(point, gpu)):
        return REFUSAL_S + JOB_OVERHEAD_S
    where = summing(point, gpu)
    same = [r for r in results if r["system"] == point["system"] and r.get("steps") and r.get("model_flops_per_step")
            and ((r.get("spec") or {}).get("gpus") or 1) == point.get("gpus", 1)
            and (where is None or (r.get("info") or {}).get("accumulate") == where)]
    if not same:
        return None
    n, flops = grids.params(point), _spec(point).model_flops_per_step()
    ref = min(same, key=lambda r: abs(math.log(r["params"] / n)) + abs(math.log(r["model_flops_per_step"] / flops)))
    steps = [s["step_time_s"] for s in ref["steps"]]
    rest = ref["wall_s"] - sum(steps)
    scale = n / ref["params"] if where == "host" else flops / ref["model_flops_per_step"]
    step = sum(steps) / len(steps) * scale
    return rest * n / ref["params"] + step * (point["steps"] + point["warmup"]) + JOB_OVERHEAD_S


def missing(grid: dict[str, Any], root: Path = Path(".")) -> dict[str, float | None]:
    """experiment/id -> estimate of each point of the grid without a result, in the grid's order."""
    results = measured(grid["hardware"], root)
    return {f"{e}/{i}": estimate(p, results) for (e, i), p in grids.points(grid).items()
            if not (root / "results" / grid["hardware"] / "points" / e / f"{i}.json").exists()}


def held_out(grid: dict[str, Any], root: Path = Path(".")) -> dict[str, tuple[float, float | None]]:
    """experiment/id -> (its harness wall, its estimate from the hardware's other results, less
    JOB_OVERHEAD_S) for each point of the grid that trained: the estimate's measured error."""
    trained = measured(grid["hardware"], root)
    out = {}
    for (e, i), point in grids.points(grid).items():
        path = root / "results" / grid["hardware"] / "points" / e / f"{i}.json"
        r = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
        if r.get("status") != "ok" or not r.get("wall_s"):
            continue
        same = grids.identity(grids.ran(r))  # a same_as copy is the same run
        others = [o for o in trained if grids.identity(grids.ran(o)) != same]
        guess = estimate(point, others)
        out[f"{e}/{i}"] = (r["wall_s"], None if guess is None else guess - JOB_OVERHEAD_S)
    return out


def main(cli: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m workflows.scripts.estimate", description=__doc__.split("\n\n")[0])
    ap.add_argument("grid", help="a workflows/grids/*.yaml")
    ap.add_argument("--check", action="store_true", help="each result's wall beside its estimate from the others")
    args = ap.parse_args(cli)
    grid = grids.check(grids.load(args.grid))
    if args.check:
        errors = []
        for point, (wall, guess) in held_out(grid).items():
            if guess is not None:
                errors.append(guess / wall - 1)
            print(f"{point} {wall:.0f} {'-' if guess is None else f'{guess:.0f} {guess / wall - 1:+.0%}'}")
        if errors:
            errors.sort()
            print(f"{len(errors)} estimated: median error {errors[len(errors) // 2]:+.0%}, from {errors[0]:+.0%} "
                  f"to {errors[-1]:+.0%}", file=sys.stderr)
        return 0
    left = missing(grid)
    for point, seconds in left.items():
        print(f"{point} {'-' if seconds is None else round(seconds)}")
    known = [s for s in left.values() if s is not None]
    print(f"{round(sum(known))} s for {len(known)} points, {len(left) - len(known)} unknown", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Two folders of results, point by point: `python -m suite compare BASE NEW [--threshold 0.05]`.

BASE and NEW are folders of harness results (searched recursively): two commits on one machine, or
two machines. Points pair up by what was run (system, model with its overrides, sequence length,
batch, accumulation, options), never by file name, so differently named files of the same point
still meet; one run filed under two names (a grid's `same_as`) pairs once. Each metric has a
direction (TFLOP/s: higher is better; memory: lower is better), and a point that ran (`ok`) in BASE
and not in NEW is a regression.

A change is judged against the noise of the two medians compared, not a fixed step: each side's
median step time has a distribution-free interval (suite/timing.py), and a rate or a time is worse
only where it moved beyond the two intervals' half-widths together (root of the sum of squares) and
beyond the stated floor (`--threshold`, which alone judges memory). A rerun of one commit on one
machine so stays quiet, and a point of 3 noisy steps needs a large change to be called worse.
Smoke points (the CPU grid's) are never judged on speed or memory, and a peak that moved by less
than MEMORY_FLOOR_GIB is the same.

Each pair's environments (the result's `env`) are compared too: the machine (GPU, CPU, cores, host
memory, PCIe), the software under the code (driver, CUDA, torch, ...) and the commit, each
difference printed once at the top. A pair run on different machines is judged by what does not
depend on the machine: its ratio to its own single-layer ceiling measured in the same run (MegaTrain),
else the fraction of its bound it reached: its model FLOPs at the machine's matmul rate, or its bytes
each way at the link's rates where that takes longer (`env.matmul_tflops`, measured by the same
worker, and `env.h2d_gbps`, `env.d2h_gbps` where a result holds them; the matmul's alone where one
side lacks them). Where
those fall beyond the noise, the code got slower; the raw verdicts are worded as the machines'
difference ("faster on new machine") and are never a regression of the code. Settings a run resolved
itself (MegaTrain's `auto` choices and kernels, `info.engine`) that differ between the two are named
on the pair's row.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from megatrain.units import GiB
from suite.timing import relative_noise


@dataclass(frozen=True)
class Metric:
    section: str  # "median" or "peak" of the result JSON
    field: str
    higher_is_better: bool
    unit: str
    scale: float = 1.0  # stored value / scale = shown value


METRICS = {
    "model_tflops": Metric("median", "model_tflops", True, "TFLOP/s"),
    "tokens_per_s": Metric("median", "tokens_per_s", True, "tok/s"),
    "step_time_s": Metric("median", "step_time_s", False, "s"),
    "peak_host": Metric("peak", "host_rss_bytes", False, "GiB", GiB),
    "peak_device": Metric("peak", "device_allocated_bytes", False, "GiB", GiB),
    "peak_device_nvml": Metric("peak", "device_nvml_bytes", False, "GiB", GiB),
}
DEFAULT_METRICS = ("model_tflops", "peak_host", "peak_device")
# the metrics a step's time drives, whose noise is the step time's
TIMED = ("model_tflops", "tokens_per_s", "step_time_s")
# a peak that moved by less is the same: one process's RSS, sampled every 0.2 s, moves by tens of MB
# between runs of one point (0.282 and 0.303 GiB for a tiny CPU point)
MEMORY_FLOOR_GIB = 0.25
KEY_FIELDS = ("system", "model", "seq_len", "batch_size", "grad_accum", "options")

# The fields of a result's `env` that tell where and with what a point ran, by what a difference means:
# another machine, other software under the same code, or other code.
MACHINE_FIELDS = ("gpu", "gpu_count", "gpu_memory_bytes", "cpu", "cpu_cores", "host_memory_bytes",
                  "pcie_generation", "pcie_width")
SOFTWARE_FIELDS = ("driver", "cuda", "torch", "transformers", "python")
CODE_FIELDS = ("git_commit", "git_dirty")
ENV_FIELDS = MACHINE_FIELDS + SOFTWARE_FIELDS + CODE_FIELDS
# The OS's reading of host memory moves by a few percent between boots of one machine (and grows on
# some lent machines as it is used): within this it is the same memory.
HOST_MEMORY_TOLERANCE = 0.05
SHORT = {"gpu_memory_bytes": "gpu memory", "host_memory_bytes": "host memory", "cpu_cores": "cores",
         "git_commit": "commit", "git_dirty": "dirty", "pcie_generation": "pcie gen", "pcie_width": "pcie width"}


def is_result(r) -> bool:
    """A harness result (suite.runner's JSON); the older tool's JSONs have another spec and peak."""
    spec = r.get("spec") if isinstance(r, dict) else None
    return (isinstance(spec, dict) and all(k in spec for k in KEY_FIELDS[:-1])
            and isinstance(r.get("status"), str) and isinstance(r.get("peak"), dict)
            and "host_rss_bytes" in r["peak"])


def point_key(spec: dict) -> str:
    """What identifies a point across folders; steps, seed and timeout do not."""
    key = {k: spec.get(k) or ({} if k == "options" else None) for k in KEY_FIELDS}
    if (spec.get("gpus") or 1) > 1:  # data-parallel points; results from before the field ran on one GPU
        key["gpus"] = spec["gpus"]
    return json.dumps(key, sort_keys=True)


def _dotted(tree: dict, prefix: str = "") -> list[str]:
    out = []
    for k, v in sorted(tree.items()):
        out += _dotted(v, f"{prefix}{k}.") if isinstance(v, dict) else [f"{prefix}{k}={json.dumps(v)}"]
    return out


def point_label(spec: dict) -> str:
    """A readable name of the point, e.g. `megatrain qwen2.5-7b L14 s4096 b4x4 engine.checkpoint_every=1`."""
    model = spec.get("model") or {}
    overrides = dict(model.get("overrides") or {})
    parts = [spec["system"], str(model.get("preset") or Path(str(model.get("config") or model.get("pretrained"))).name)]
    if "num_hidden_layers" in overrides:
        parts.append(f"L{overrides.pop('num_hidden_layers')}")
    parts += _dotted(overrides)
    parts.append(f"s{spec['seq_len']} b{spec['batch_size']}x{spec['grad_accum']}")
    if (spec.get("gpus") or 1) > 1:
        parts.append(f"{spec['gpus']} GPUs")
    return " ".join(parts + _dotted(spec.get("options") or {}))


def load(folder: str | Path) -> tuple[dict[str, tuple[Path, dict]], list[str]]:
    """The harness results under `folder` by point key, and notes on the files left out."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"{folder}: not a folder of results")
    found: dict[str, tuple[Path, dict]] = {}
    notes = []
    for path in sorted(folder.rglob("*.json")):
        try:
            r = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            notes.append(f"{path}: skipped, unreadable ({e})")
            continue
        if not is_result(r):
            notes.append(f"{path}: skipped, not a harness result")
            continue
        key = point_key(r["spec"])
        if key in found:
            notes.append(f"{path}: skipped, same point as {found[key][0]}")
            continue
        found[key] = (path, r)
    return found, notes


def run_identity(r: dict) -> str | None:
    """What makes two result files one run: the commit and every step's time (a `same_as` copy
    carries its source's steps, under a spec that may name the model otherwise); None without steps."""
    times = [s.get("step_time_s") for s in r.get("steps") or []]
    return json.dumps([(r.get("env") or {}).get("git_commit"), times]) if times else None


def resolved_differences(base: dict, new: dict) -> list[str]:
    """The settings each run resolved itself (info.engine) that differ, as `name base->new`."""
    b, n = (base.get("info") or {}).get("engine") or {}, (new.get("info") or {}).get("engine") or {}
    if not b or not n:
        return []
    return [f"{k} {b.get(k)}->{n.get(k)}" for k in sorted(set(b) | set(n)) if k != "device" and b.get(k) != n.get(k)]


def _number(x) -> bool:
    return isinstance(x, (int, float)) and x > 0


def normalised(r: dict, link: bool = True) -> tuple[str, float] | None:
    """The point's speed in units of its own machine: (yardstick, value), or None. Its ratio to its
    own single-layer ceiling where it has one; else the fraction of its bound it reached: the
    longer of its model FLOPs at the machine's matmul rate and (`link`, where the result holds the
    link's rates and the point counts its bytes) its bytes each way at the link's rate, over its step."""
    if isinstance(r.get("ratio_to_ceiling"), (int, float)):
        return "ratio to its layer ceiling", float(r["ratio_to_ceiling"])
    med, env = r.get("median") or {}, r.get("env") or {}
    rate, matmul = med.get("model_tflops"), env.get("matmul_tflops")
    if not (_number(rate) and _number(matmul)):
        return None
    step = med.get("step_time_s")
    ways = [(med.get(f"bytes_{w}"), env.get(f"{w}_gbps")) for w in ("h2d", "d2h")]
    if link and _number(step) and all(isinstance(b, (int, float)) and _number(g) for b, g in ways):
        return "fraction of its matmul or link bound", max(rate / matmul, *(b / g / 1e9 / step for b, g in ways))
    return "fraction of the matmul rate", rate / matmul


def noise(base: dict, new: dict) -> float | None:
    """The relative noise of the difference of the two medians (None where neither has one)."""
    parts = [x for x in (relative_noise(base), relative_noise(new)) if x is not None]
    return math.sqrt(sum(x * x for x in parts)) if parts else None


def _same(field: str, a, b) -> bool:
    if field == "host_memory_bytes" and isinstance(a, (int, float)) and isinstance(b, (int, float)) and a and b:
        return abs(a - b) <= HOST_MEMORY_TOLERANCE * max(a, b)
    return a == b


def env_differences(base_env: dict | None, new_env: dict | None) -> dict[str, tuple]:
    """{field: (base value, new value)} for each ENV_FIELDS field the two environments differ in
    (a field one side lacks counts as a difference only where the other has it)."""
    b, n = base_env or {}, new_env or {}
    return {f: (b.get(f), n.get(f)) for f in ENV_FIELDS
            if (f in b or f in n) and not _same(f, b.get(f), n.get(f))}


def _shown_env(field: str, v) -> str:
    if v is None:
        return "?"
    if field.endswith("_bytes") and isinstance(v, (int, float)):
        return f"{v / GiB:.1f} GiB"
    if field == "git_commit":
        return str(v)[:7]
    return str(v)


def commit(env: dict | None) -> str:
    e = env or {}
    return _shown_env("git_commit", e.get("git_commit")) + ("+dirty" if e.get("git_dirty") else "")


def describe(env: dict | None) -> str:
    """One line: the machine and software a result ran on, e.g. `NVIDIA H200 x1, 32 cores, 251.8 GiB
    host, driver 580.159.04, CUDA 13.0, torch 2.11.0+cu130` (the commit apart: commit())."""
    e = env or {}
    parts = [f"{e.get('gpu', 'no GPU')} x{e.get('gpu_count', '?')}" if e.get("gpu") else "no GPU",
             f"{e.get('cpu_cores', '?')} cores", f"{_shown_env('host_memory_bytes', e.get('host_memory_bytes'))} host",
             f"driver {e.get('driver', '?')}", f"CUDA {e.get('cuda', '?')}", f"torch {e.get('torch', '?')}"]
    return ", ".join(parts)


def _machine_verdict(verdict: str, m: Metric) -> str:
    """`better`/`worse` of a pair run on different machines, worded as the machines' difference: a
    rate or a time is faster or slower there, memory more or less."""
    if verdict not in ("better", "worse"):
        return verdict
    if m.higher_is_better or m.unit == "s":
        return ("faster" if verdict == "better" else "slower") + " on new machine"
    return ("less" if verdict == "better" else "more") + " on new machine"


def _across_machines(base: dict, new: dict, raw: str, m: Metric, limit: float) -> tuple[str, bool]:
    """The verdict of a timed metric between two machines: the code's, from the speed in each
    machine's own units where both results have one, else the machines' (never a regression)."""
    b, n = normalised(base), normalised(new)
    if b is not None and n is not None and b[0] != n[0]:  # one side without the link's rate: the matmul's alone
        b, n = normalised(base, link=False), normalised(new, link=False)
    if b is None or n is None or b[0] != n[0]:
        return _machine_verdict(raw, m), False
    change, verdict = _verdict(b[1], n[1], METRICS["model_tflops"], limit)
    if verdict == "same":
        return f"{_machine_verdict(raw, m)}; code same per {b[0]}", False
    return f"code {'slower' if verdict == 'worse' else 'faster'} per {b[0]} ({100 * change:+.1f}%)", verdict == "worse"


def _value(r: dict, m: Metric) -> float | None:
    v = (r.get(m.section) or {}).get(m.field)
    return float(v) if isinstance(v, (int, float)) else None


def _verdict(base: float, new: float, m: Metric, threshold: float) -> tuple[float | None, str]:
    """(relative change, verdict); a zero base has no relative change, only a direction."""
    sign = 1 if m.higher_is_better else -1
    if base == 0:
        return None, "same" if new == 0 else ("better" if (new - base) * sign > 0 else "worse")
    change = (new - base) / abs(base)
    if change * sign < -threshold:
        return change, "worse"
    return change, "better" if change * sign > threshold else "same"


def compare(base: str | Path, new: str | Path, threshold: float = 0.05,
            metrics: tuple[str, ...] = DEFAULT_METRICS) -> dict:
    """The comparison as plain data: one row per point and metric (or per point whose status moved),
    the largest changes first."""
    if threshold < 0:
        raise ValueError(f"threshold: must be >= 0, got {threshold}")
    unknown = [m for m in metrics if m not in METRICS]
    if unknown:
        raise ValueError(f"metrics: unknown {unknown}; known: {list(METRICS)}")
    b, b_notes = load(base)
    n, n_notes = load(new)
    rows, seen = [], set()
    for key in sorted(set(b) & set(n), key=lambda k: point_label(b[k][1]["spec"])):
        (bp, br), (np_, nr) = b[key], n[key]
        pair = (run_identity(br), run_identity(nr))
        if None not in pair and pair in seen:
            b_notes.append(f"{bp} and {np_}: the same runs as a pair already compared")
            continue
        seen.add(pair)
        diff = env_differences(br.get("env"), nr.get("env"))
        machine = any(f in MACHINE_FIELDS for f in diff)
        smoke = bool(br["spec"].get("smoke") or nr["spec"].get("smoke"))
        common = dict(point=point_label(br["spec"]), base_file=str(bp), new_file=str(np_),
                      env=sorted(diff, key=ENV_FIELDS.index), machine_differs=machine, smoke=smoke,
                      resolved=resolved_differences(br, nr))
        if br["status"] != nr["status"] or br["status"] != "ok":
            moved = br["status"] != nr["status"]
            verdict = ("status differs on new machine" if machine else "status changed") if moved else "same"
            rows.append(dict(common, metric="status", unit=None, base=br["status"], new=nr["status"], change=None,
                             threshold=None, verdict=verdict, regression=moved and br["status"] == "ok" and not machine))
            continue  # a point that did not run has no medians to compare
        pair_noise = noise(br, nr)
        for name in metrics:
            m = METRICS[name]
            bv, nv = _value(br, m), _value(nr, m)
            if bv is None and nv is None:
                continue
            limit = max(threshold, pair_noise or 0.0) if name in TIMED else threshold
            change, verdict = _verdict(bv, nv, m, limit) if None not in (bv, nv) else (None, "missing")
            if name not in TIMED and verdict in ("worse", "better") and abs(nv - bv) / m.scale < MEMORY_FLOOR_GIB:
                verdict = "same"  # a few tens of MB: the sampler's and the allocator's noise, not the code's
            regression = verdict == "worse" and not machine
            if smoke:
                verdict, regression = "smoke: not judged", False
            elif machine and name in TIMED and verdict != "missing":
                verdict, regression = _across_machines(br, nr, verdict, m, limit)
            elif machine:
                verdict = _machine_verdict(verdict, m)
            rows.append(dict(common, metric=name, unit=m.unit, base=bv, new=nv, change=change, threshold=limit,
                             verdict=verdict, regression=regression))
    rows.sort(key=lambda r: (not r["regression"], -abs(r["change"] or 0)))
    env_diffs: dict[str, list[list]] = {}
    for key in sorted(set(b) & set(n), key=lambda k: point_label(b[k][1]["spec"])):
        for field, pair in env_differences(b[key][1].get("env"), n[key][1].get("env")).items():
            if list(pair) not in env_diffs.setdefault(field, []):
                env_diffs[field].append(list(pair))
    return {
        "base": str(base), "new": str(new), "threshold": threshold, "metrics": list(metrics),
        # each side's environments (describe()), and over the matched pairs, field -> [[base, new], ...]
        "base_env": sorted({describe(r.get("env")) for _, r in b.values()}),
        "new_env": sorted({describe(r.get("env")) for _, r in n.values()}),
        "base_commits": sorted({commit(r.get("env")) for _, r in b.values()}),
        "new_commits": sorted({commit(r.get("env")) for _, r in n.values()}),
        "env_differences": {f: env_diffs[f] for f in ENV_FIELDS if f in env_diffs},
        "machine_pairs": sum(any(f in MACHINE_FIELDS for f in env_differences(b[k][1].get("env"), n[k][1].get("env")))
                             for k in set(b) & set(n)),
        "rows": rows,
        "only_base": sorted(point_label(b[k][1]["spec"]) for k in set(b) - set(n)),
        "only_new": sorted(point_label(n[k][1]["spec"]) for k in set(n) - set(b)),
        "skipped": list(dict.fromkeys(b_notes + n_notes)),  # once, when a folder meets itself
        "matched": len(set(b) & set(n)),
        "regressed": any(r["regression"] for r in rows),
    }


def _shown(v, metric: str) -> str:
    if v is None:
        return "-"
    if isinstance(v, str):
        return v
    v /= METRICS[metric].scale
    return f"{v:.2f}" if abs(v) >= 1 else f"{v:.3g}"  # tiny CPU points keep their digits


def _env_block(report: dict) -> list[str]:
    """Where each side ran and, over the matched pairs, what differs: said before the rows."""
    lines = []
    for side in ("base", "new"):
        commits = report[f"{side}_commits"]
        lines.append(f"{side:<4} ran on: {'; '.join(report[f'{side}_env']) or '-'} "
                     f"(commit{'s' * (len(commits) != 1)} {', '.join(commits) or '-'})")
    if set(report["base_env"]) != set(report["new_env"]):
        lines.append("the two folders ran on different machines or software" + (
            "" if report["matched"] else "; no point ran on both with one spec (the grids' `shared` experiment does)"))
    diffs = report["env_differences"]
    if not diffs:
        return lines + [f"environments of the matched pairs: {'the same' if report['matched'] else 'no pair matched'}", ""]
    lines.append("environments of the matched pairs differ (base -> new):")
    for field, pairs in diffs.items():
        kind = "machine" if field in MACHINE_FIELDS else "software" if field in SOFTWARE_FIELDS else "code"
        shown = "; ".join(f"{_shown_env(field, a)} -> {_shown_env(field, b)}" for a, b in pairs)
        lines.append(f"  {SHORT.get(field, field)} ({kind}): {shown}")
    if report["machine_pairs"]:
        lines.append(f"DIFFERENT MACHINES: {report['machine_pairs']} of {report['matched']} pairs ran on different "
                     "machines; their verdicts compare the machines, not the code, and none is a regression.")
    return lines + [""]


def render(report: dict) -> str:
    rows = report["rows"]
    width = max([len(r["point"]) for r in rows] + [5])
    lines = _env_block(report)
    lines.append(f"{'point':{width}}  {'metric':<20} {'base':>12} {'new':>12} {'change %':>9} {'noise %':>8}  "
                 f"{'verdict':<22} env differs")
    for r in rows:
        metric = r["metric"] + (f" ({r['unit']})" if r["unit"] else "")
        change = f"{100 * r['change']:+.1f}" if r["change"] is not None else "-"
        limit = f"{100 * r['threshold']:.1f}" if r.get("threshold") is not None else "-"
        env = ",".join(SHORT.get(f, f) for f in r.get("env", [])) or "-"
        lines.append(f"{r['point']:{width}}  {metric:<20} {_shown(r['base'], r['metric']):>12} "
                     f"{_shown(r['new'], r['metric']):>12} {change:>9} {limit:>8}  {r['verdict']:<22} {env}")
        if r.get("resolved") and r["metric"] in ("status", report["metrics"][0]):
            lines.append(f"{'':{width}}  resolved differently: {', '.join(r['resolved'])}")
    counts = {v: sum(r["verdict"] == v for r in rows) for v in ("worse", "better", "status changed")}
    counts |= {"code slower across machines": sum(r["verdict"].startswith("code slower") for r in rows),
               "differing by machine": sum(r.get("machine_differs", False) and r["verdict"] != "same" for r in rows),
               "smoke (not judged)": sum(r["verdict"].startswith("smoke") for r in rows)}
    lines.append("")
    lines.append(f"{report['matched']} points matched (a change counts beyond the pair's noise, at least "
                 f"{100 * report['threshold']:.1f}%): " + ", ".join(f"{c} {v}" for v, c in counts.items() if c))
    for side, name in (("only_base", report["base"]), ("only_new", report["new"])):
        if report[side]:
            lines.append(f"only in {name} ({len(report[side])}):")
            lines += [f"  {p}" for p in report[side]]
    if report["skipped"]:
        lines.append(f"not compared ({len(report['skipped'])}):")
        lines += [f"  {s}" for s in report["skipped"]]
    if report["regressed"]:
        lines.append("REGRESSION")
    elif report["machine_pairs"] and report["machine_pairs"] == report["matched"] and not any(
            r["verdict"].startswith("code ") for r in rows):
        lines.append("no regression can be concluded: every pair ran on different machines, none with a "
                     "yardstick of its own machine on both sides")
    else:
        lines.append("no regression")
    return "\n".join(lines)


def main(base: str, new: str, threshold: float, metrics: tuple[str, ...], out: str | None = None) -> int:
    report = compare(base, new, threshold, metrics)
    print(render(report))
    if out:
        from megatrain.io import write_json
        write_json(out, report)
    return 1 if report["regressed"] else 0

"""Two folders of results, point by point: `python -m suite compare BASE NEW [--threshold 0.05]`.

BASE and NEW are folders of harness results (searched recursively): two commits on one machine, or
two machines. Points pair up by what was run (system, model with its overrides, sequence length,
batch, accumulation, options), never by file name, so differently named files of the same point
still meet. Each metric has a direction (TFLOP/s: higher is better; memory: lower is better) and
a change beyond the threshold in the bad direction is a regression, as is a point that ran (`ok`)
in BASE and not in NEW. Exit status 1 on any regression, else 0 (TorchBench's regression detector,
reduced to medians and one relative threshold).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from megatrain.units import GiB


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
KEY_FIELDS = ("system", "model", "seq_len", "batch_size", "grad_accum", "options")


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
    """The comparison as plain data: one row per point and metric (or per point whose status moved)."""
    if threshold < 0:
        raise ValueError(f"threshold: must be >= 0, got {threshold}")
    unknown = [m for m in metrics if m not in METRICS]
    if unknown:
        raise ValueError(f"metrics: unknown {unknown}; known: {list(METRICS)}")
    b, b_notes = load(base)
    n, n_notes = load(new)
    rows = []
    for key in sorted(set(b) & set(n), key=lambda k: point_label(b[k][1]["spec"])):
        (bp, br), (np_, nr) = b[key], n[key]
        common = dict(point=point_label(br["spec"]), base_file=str(bp), new_file=str(np_))
        if br["status"] != nr["status"] or br["status"] != "ok":
            moved = br["status"] != nr["status"]
            rows.append(dict(common, metric="status", unit=None, base=br["status"], new=nr["status"], change=None,
                             verdict="status changed" if moved else "same",
                             regression=moved and br["status"] == "ok"))
            continue  # a point that did not run has no medians to compare
        for name in metrics:
            m = METRICS[name]
            bv, nv = _value(br, m), _value(nr, m)
            if bv is None and nv is None:
                continue
            change, verdict = _verdict(bv, nv, m, threshold) if None not in (bv, nv) else (None, "missing")
            rows.append(dict(common, metric=name, unit=m.unit, base=bv, new=nv, change=change, verdict=verdict,
                             regression=verdict == "worse"))
    return {
        "base": str(base), "new": str(new), "threshold": threshold, "metrics": list(metrics),
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


def render(report: dict) -> str:
    rows = report["rows"]
    width = max([len(r["point"]) for r in rows] + [5])
    lines = [f"{'point':{width}}  {'metric':<20} {'base':>12} {'new':>12} {'change %':>9}  verdict"]
    for r in rows:
        metric = r["metric"] + (f" ({r['unit']})" if r["unit"] else "")
        change = f"{100 * r['change']:+.1f}" if r["change"] is not None else "-"
        lines.append(f"{r['point']:{width}}  {metric:<20} {_shown(r['base'], r['metric']):>12} "
                     f"{_shown(r['new'], r['metric']):>12} {change:>9}  {r['verdict']}")
    counts = {v: sum(r["verdict"] == v for r in rows) for v in ("worse", "better", "status changed")}
    lines.append("")
    lines.append(f"{report['matched']} points matched (threshold {100 * report['threshold']:.1f}%): "
                 + ", ".join(f"{c} {v}" for v, c in counts.items()))
    for side, name in (("only_base", report["base"]), ("only_new", report["new"])):
        if report[side]:
            lines.append(f"only in {name} ({len(report[side])}):")
            lines += [f"  {p}" for p in report[side]]
    if report["skipped"]:
        lines.append(f"not compared ({len(report['skipped'])}):")
        lines += [f"  {s}" for s in report["skipped"]]
    lines.append("REGRESSION" if report["regressed"] else "no regression")
    return "\n".join(lines)


def main(base: str, new: str, threshold: float, metrics: tuple[str, ...], out: str | None = None) -> int:
    report = compare(base, new, threshold, metrics)
    print(render(report))
    if out:
        from megatrain.io import write_json
        write_json(out, report)
    return 1 if report["regressed"] else 0

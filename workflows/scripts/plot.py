"""One experiment's table (workflows.scripts.aggregate's CSV) -> a PNG and a PDF figure.

    python -m workflows.scripts.plot --csv T.csv --experiment E --hardware H --png F.png --pdf F.pdf [--smoke-test]

How an experiment is drawn comes from aggregate.EXPERIMENTS (x axis, its label, line or bars, the
panels and the paper's matching columns); an unknown experiment gets bars of TFLOP/s per point id.
- Measured points are filled markers with solid lines, labelled "measured (<hardware>): <system>";
  the paper's are open black markers with dashed lines, labelled "paper (<its hardware>)[: <system>]".
  No two legend entries share a marker and colour.
- A line joins only points run with the same settings (options, MegaTrain's layer kernels as
  resolved, batch, accumulation, sequence length, but what the experiment varies by design); where
  they differ, the next points are a line of their own with open markers, not joined, and the note
  under the figure says what changed.
- Under every figure, a setup line: layers, tokens a step, MegaTrain's kernels, GPUs and the host,
  a value per system where they differ.
- The paper's lower bounds ("above 250") are carets with an upward arrow, apart from its line; its
  marked or qualified values carry their mark; a bar's paper value is printed as the paper prints it.
- A point without a value sits in a grey "no value" band under the axis' zero, never at zero: a
  marker per kind of what happened (refused by the harness's estimate, by host memory, device
  memory or disk space; out of memory observed while running; timed out; unsupported; not
  attempted; stale), each point in its system's colour, grey where nothing ran. Under them, the
  paper's points printed as a word ("OOM"): a row per paper series, its open marker with the word
  beside it; on bars the word at zero.
- Where our quantity and the paper's differ (our device memory is the allocator's peak, the
  paper's Tables 5 and 6 print an allocation), the legend and the axis label say which is which.
- Bars: one per point, in its system's colour (as on the line figures), its value beside it; a
  bar of a grid point (the experiment's x is the id) names its parameters, layers and tokens.
  Ablation bars (aggregate.Experiment.reference): each bar relative to its own side's full
  configuration, ours to ours and the paper's to the paper's.
- A GPU-count experiment (kind "scaling"): one line per model and system over the GPU count, its
  ideal linear scaling from its 1-GPU point dashed in its colour, each point's speed-up over that
  point beside it; its points without a value are listed by id under the axes (several lines share
  an x, so a marker in the band would not say whose it is), a line per kind.
- The title speaks of the paper's points only where some are drawn.
- --smoke-test (the CPU grid): the figure says it is a smoke test, without the paper's points.
The paper's memory (printed in GB, 10^9 bytes) is drawn in GiB like ours.
"""
from __future__ import annotations

import argparse
import re
import textwrap

import matplotlib
import matplotlib.ticker
import matplotlib.transforms

matplotlib.use("Agg")  # files only; no display on the workflow's machines
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.lines import Line2D

from megatrain.io import save_figure
from megatrain.units import GB_PER_GiB
from suite.system import SYSTEMS
from workflows.scripts import aggregate, outputs
from workflows.scripts.aggregate import Experiment, _size_b, experiment

# Marker shapes: measured series (filled, coloured), the paper's (open, black) and its bounds, and the
# points without a value; the sets are disjoint, so a shape names one kind of entry.
MEASURED_MARKERS = ("o", "D", "p", "h", "8", "H")
PAPER_MARKERS = ("s", "<", ">", "P", "d", "*")
BOUND_MARKERS = {"lower": "^", "upper": "v"}
# A point without a value, by what happened (`no_value_kind`) -> (marker, legend colour, legend
# label). The point's own marker takes its system's colour, but for the grey kinds (nothing ran).
NO_VALUE = {
    "refused_host": ("x", "black", "refused by its estimate, before running: host memory"),
    "refused_device": ("+", "black", "refused by its estimate, before running: device memory"),
    "refused_disk": ("1", "black", "refused by its estimate, before running: disk space"),
    "oom_host": ("X", "black", "ran out of host memory (observed)"),
    "oom_device": ("3", "black", "ran out of device memory (observed)"),
    "timeout": ("4", "black", "timed out (timeout)"),
    "unsupported": ("$\\emptyset$", "black", "unsupported"),
    "not_run": ("$?$", "grey", "not attempted (no result file)"),
    "stale": ("2", "grey", "stale (run before its grid point changed)"),
}
GREY_KINDS = ("not_run", "stale")
OTHER_NO_VALUE = ("$!$", "black", "failed ({})")
# a point's no-value kind as a bar figure writes it beside its bar
SHORT = {"refused_host": "refused (estimate): host memory", "refused_device": "refused (estimate): device memory",
         "refused_disk": "refused (estimate): disk space", "oom_host": "out of host memory (observed)",
         "oom_device": "out of device memory (observed)", "not_run": "not run"}
SETTINGS_CHANGE = "settings-change"  # gid of a line whose settings differ from its series' earlier points
IDEAL = "ideal-scaling"  # gid of the dashed ideal linear scaling from a line's 1-GPU point
# one colour per system in every figure; a second series of a system (fewer layers) takes the next
# marker and a colour of its own
SYSTEM_COLORS = {name: r.color for name, r in SYSTEMS.items()}
# (neither a system's colour, nor grey, "not attempted", nor the paper's black)
SPARE_COLORS = ("C9", "navy", "saddlebrown", "darkgreen", "goldenrod", "slateblue")
MEASURED = dict(linestyle="-")
PAPER = dict(linestyle="--", markerfacecolor="none", color="black")
LEGEND_COLUMNS = 3
BAND = 0.14  # the "no value" band under zero, as a fraction of the axis' top
YLABELS = {"model_tflops": "throughput (model TFLOP/s)", "tokens_per_s": "throughput (tokens/s)",
           "executed_tflops": "executed TFLOP/s (recompute in, causal halved)", "step_time_s": "step time (s)",
           "params_B": "parameters (billions)",
           "peak_host_GiB": "peak host memory (GiB)", "peak_device_GiB": "peak device memory, allocated (GiB)"}
TITLES = {"model_tflops": "Throughput", "tokens_per_s": "Throughput", "executed_tflops": "Executed FLOPs",
          "step_time_s": "Step time", "params_B": "Model size", "peak_host_GiB": "Host memory", "peak_device_GiB": "Device memory"}
SMOKE_TITLE = "CPU smoke test: not a performance result"
LOWER = ("above", "over", "more than", "at least", ">")
UPPER = ("below", "under", "less than", "at most", "<")
DASHES = ("", "-", "–", "—")  # a printed cell that gives no value and no word


def _tick(value: float, _) -> str:
    """Tick labels: sequence lengths as 1K..512K (powers of two), other values to three digits."""
    if value >= 1024 and value % 1024 == 0:
        return f"{value / 1024:g}K"
    return f"{value:.3g}"


def _split(df: pd.DataFrame):
    return df[df["source"] == "measured"], df[df["source"] == "paper"]


def no_value_kind(row) -> str:
    """What happened to a point without a value: a refusal by the harness's estimate (by memory),
    else its status (an out-of-memory status then says it was observed)."""
    refused = row.get("refused") if hasattr(row, "get") else None
    return f"refused_{refused}" if isinstance(refused, str) and refused else str(row["status"])


def no_value_style(kind: str) -> tuple[str, str, str]:
    """(marker, legend colour, legend label) of a point of no-value `kind`."""
    if kind in NO_VALUE:
        return NO_VALUE[kind]
    marker, color, label = OTHER_NO_VALUE
    return marker, color, label.format(kind)


def point_color(system: str, kind: str) -> str:
    """A no-value point's colour: its system's, grey where nothing ran."""
    return "grey" if kind in GREY_KINDS else SYSTEM_COLORS.get(system, "C7")


def _bound(qualifier, printed) -> str | None:
    """"lower"/"upper" where the paper's qualifier ("above") or printed value (">250") gives a bound."""
    for text in (qualifier, printed):
        if isinstance(text, str):
            t = text.strip().lower()
            if t.startswith(LOWER):
                return "lower"
            if t.startswith(UPPER):
                return "upper"
    return None


def _number(v) -> float:
    """A printed cell as a number: 284 -> 284.0, ">250" -> 250.0, "OOM" or "–" -> NaN."""
    if isinstance(v, str):
        m = re.fullmatch(r"\s*[<>≥≤~]?\s*([\d.]+)\s*", v)
        return float(m.group(1)) if m else np.nan
    return float(v) if v is not None and not pd.isna(v) else np.nan


def paper_points(paper: pd.DataFrame, spec: Experiment, y: str) -> pd.DataFrame | None:
    """The paper's rows of measured column `y` with `y` (GB converted to GiB), `bound` (lower/upper
    or None) and `mark` (a footnote mark or a qualifier that is no bound); None if it prints none."""
    col = spec.paper_y.get(y)
    if col is None or col not in paper or "x" not in paper:
        return None
    v = pd.Series([_number(c) for c in paper[col]], index=paper.index, dtype=float)  # "OOM", "–": NaN
    qualifier = paper["qualifier"] if "qualifier" in paper else pd.Series(None, index=paper.index, dtype=object)
    bound = [_bound(q, p) for q, p in zip(qualifier, paper[col])]
    marks = paper["mark"] if "mark" in paper else pd.Series(None, index=paper.index, dtype=object)
    mark = [m if isinstance(m, str) and m else (q if isinstance(q, str) and b is None else None)
            for m, q, b in zip(marks, qualifier, bound)]
    out = paper.assign(y=v / GB_PER_GiB if y.endswith("_GiB") else v, bound=bound, mark=mark)
    return out.dropna(subset=["x", "y"])


def paper_words(paper: pd.DataFrame, spec: Experiment, y: str) -> pd.DataFrame | None:
    """The paper's rows whose `y` cell is printed as a word rather than a number ("OOM"), with that
    `word`; a dash or a blank says nothing and is left out. None if the paper prints no such column."""
    col = spec.paper_y.get(y)
    if col is None or col not in paper or "x" not in paper:
        return None
    words = [c.strip() if isinstance(c, str) and np.isnan(_number(c)) and c.strip() not in DASHES else None
             for c in paper[col]]
    return paper.assign(word=pd.Series(words, index=paper.index, dtype=object)).dropna(subset=["x", "word"])


def _series(rows: pd.DataFrame, spec: Experiment) -> pd.Series:
    """One line per system; where points of one experiment run at different depths (Table 7's
    longest contexts on fewer layers) and depth is not the x axis, one line per system and depth;
    and one per value of the options the experiment splits by (`series_by`: Ratel's offload)."""
    names = rows["system"].astype(str)
    for key in spec.series_by:
        value = rows["options"].map(lambda v: dict(w.split("=", 1) for w in v.split()).get(key)
                                    if isinstance(v, str) else None) if "options" in rows else None
        if value is not None and value.notna().any():
            names = names + value.map(lambda v: f" {key}={v}" if isinstance(v, str) else "")
    layers = rows["layers"].dropna() if "layers" in rows else pd.Series(dtype=object)
    if spec.x == "layers" or layers.nunique() + rows["layers"].isna().any() <= 1:
        return names
    depth = rows["layers"].map(lambda n: "all layers" if pd.isna(n) else f"{int(n)} layer{'s' * (n != 1)}")
    return names + " (" + depth + ")"


SETTING_COLUMNS = ("seq", "batch", "accum", "options", "kernels")


def settings(row: pd.Series, spec: Experiment) -> dict[str, str]:
    """What a point was run with, but the x axis and what the experiment varies by design."""
    out = {}
    for col in SETTING_COLUMNS:
        if col == spec.x or col in spec.varies or col not in row:
            continue
        v = row[col]
        if col == "options":
            out.update(w.split("=", 1) for w in (v.split() if isinstance(v, str) else ()))
        elif not pd.isna(v):
            out[col] = str(int(v)) if isinstance(v, (int, float, np.integer)) else str(v)
    return out


def setting_changes(a: dict[str, str], b: dict[str, str]) -> str:
    """The settings that differ from `a` to `b`, e.g. "engine.device_tiles 20->3, batch 4->8"."""
    keys = sorted(set(a) | set(b), key=lambda k: (k not in SETTING_COLUMNS, k))
    return ", ".join(f"{k} {a.get(k, 'default')}->{b.get(k, 'default')}" for k in keys if a.get(k) != b.get(k))


def runs(g: pd.DataFrame, spec: Experiment) -> list[pd.DataFrame]:
    """A series' points (sorted by x) cut where the settings change: each piece is one solid line."""
    pieces, start = [], 0
    s = [settings(r, spec) for _, r in g.iterrows()]
    for i in range(1, len(g) + 1):
        if i == len(g) or s[i] != s[i - 1]:
            pieces.append(g.iloc[start:i])
            start = i
    return pieces


SHAPE_COLUMNS = ("seq", "batch", "accum")


def shape_notes(ok: pd.DataFrame, spec: Experiment, series: pd.Series) -> list[str]:
    """Where a series ran a shape (sequence, batch, micro-batches) other than the one most of the
    figure's points ran, e.g. "native: batch 4, accum 1 (the others batch 8, accum 4)"; the x axis
    and what the experiment varies by design are no shape here."""
    cols = [c for c in SHAPE_COLUMNS if c in ok and c != spec.x and c not in spec.varies]
    if not cols or not len(ok):
        return []
    shape = ok[cols].apply(lambda r: tuple(str(int(v)) if pd.notna(v) else "-" for v in r), axis=1)
    common = shape.mode().iloc[0]
    out = []
    for name, own in shape.groupby(series, sort=False):
        for other in dict.fromkeys(own):
            differ = [i for i, (a, b) in enumerate(zip(other, common)) if a != b]
            if differ:
                out.append(f"{name}: " + ", ".join(f"{cols[i]} {other[i]}" for i in differ)
                           + " (the others " + ", ".join(f"{cols[i]} {common[i]}" for i in differ) + ")")
    return out


def series_styles(names: list[str]) -> dict[str, tuple[str, str]]:
    """Series name ("megatrain", "megatrain (7 layers)", "ratel offload=disk") -> (marker, colour),
    no two alike; a system's first series takes the system's colour."""
    style, used, spare = {}, {}, iter(SPARE_COLORS * 4)
    for name in names:
        system = name.split(" ")[0]
        k = used.get(system, 0)
        used[system] = k + 1
        color = SYSTEM_COLORS.get(system) if k == 0 else None
        style[name] = (MEASURED_MARKERS[k % len(MEASURED_MARKERS)], color or next(spare))
    return style


def _series_color(name: str, system: str, style: dict[str, tuple[str, str]]) -> str:
    """The colour of the drawn series a point belongs to (by name, else by name without its depth,
    "ratel offload=disk (all layers)" -> "ratel offload=disk"); its system's where none is drawn."""
    if name in style:
        return style[name][1]
    base = name.split(" (")[0]
    same = [color for drawn, (_, color) in style.items() if drawn.split(" (")[0] == base]
    return same[0] if same else SYSTEM_COLORS.get(system, "C7")


def _fmt(x) -> str:
    return f"{x:.3g}" if isinstance(x, (float, np.floating)) else str(x)


def _failed_note(rows: pd.DataFrame, spec: Experiment) -> str:
    """One line per series (system) and kind of the points without a value, with their x values."""
    bad = rows[rows["status"] != "ok"]
    if bad.empty:
        return ""
    kinds = bad.apply(no_value_kind, axis=1).rename("kind")
    parts = []
    for (system, kind), g in bad.groupby([_series(bad, spec).rename("series"), kinds], sort=True):
        parts.append(f"{system} {SHORT.get(kind, kind)} at {', '.join(_fmt(x) for x in sorted(g['x'].dropna()))}")
    return f"no value (x: {spec.label}): " + "; ".join(parts)


def _axis_top(values) -> float:
    """The y axis' top over these values (a zero floor, so a 0.4 MB difference stays small)."""
    vals = [v for v in values if v is not None and np.isfinite(v)]
    top = max(vals) if vals else 0.0
    return top * 1.12 if top > 0 else 1.0


def _no_value(ax, rows: pd.DataFrame, top: float, words: list[tuple] = (), colors: dict | None = None) -> None:
    """The points without a value in the grey band under zero: a row per kind (refused by estimate,
    by memory; observed out of memory; timed out; ...), each point in its series' colour (`colors`,
    by row; else its system's), grey where nothing ran, side by side where series share an x, the
    kind's own legend entry; under them the paper's points printed as a word (`words`: x, word, its
    series' label and marker), a row per paper series, its open marker with the word beside it."""
    bad = rows[(rows["status"] != "ok") & rows["x"].notna()]
    bad = bad.assign(kind=bad.apply(no_value_kind, axis=1) if len(bad) else [],
                     color=[point_color(s, k) if k in GREY_KINDS else (colors or {}).get(i, point_color(s, k))
                            for i, s, k in zip(bad.index, bad["system"], bad.apply(no_value_kind, axis=1))]
                     if len(bad) else [])
    kinds = sorted(bad["kind"].unique(), key=lambda k: (k in GREY_KINDS, k))
    series = list(dict.fromkeys(label for _, _, label, _ in words))
    levels = len(kinds) + len(series)
    for k, kind in enumerate(kinds):
        marker, color, label = no_value_style(kind)
        y = -BAND * top * (k + 1) / (levels + 1)
        these = bad[bad["kind"] == kind]
        shades = list(dict.fromkeys(these["color"]))
        for j, shade in enumerate(shades):  # side by side, 0.09 inch apart, so that none hides another
            shift = matplotlib.transforms.ScaledTranslation(0.09 * (j - (len(shades) - 1) / 2), 0,
                                                           ax.figure.dpi_scale_trans)
            xs = these[these["color"] == shade]["x"]
            ax.plot(xs, [y] * len(xs), linestyle="none", marker=marker, color=shade,
                    markersize=7, label="_nolegend_", zorder=3, clip_on=False, transform=ax.transData + shift)
            ax.update_datalim([(x, y) for x in xs])  # a shifted line is no data to the autoscale: its points are
            ax.autoscale_view()
        ax.plot([], [], linestyle="none", marker=marker, color=color, markersize=7, label=label)
    for x, word, label, marker in words:
        y = -BAND * top * (len(kinds) + series.index(label) + 1) / (levels + 1)
        ax.plot([x], [y], linestyle="none", marker=marker, markerfacecolor="none", color="black", markersize=5,
                label=label, zorder=3, clip_on=False)
        ax.annotate(word, (x, y), xytext=(4, 0), textcoords="offset points", va="center", fontsize=6)


def _systems_without_value(ax, ours: pd.DataFrame, drawn: set[str], hardware: str) -> None:
    """A legend entry (its colour) for each system whose points here all lack a value, so that the
    colour of its markers in the band is named."""
    for system in dict.fromkeys(ours[ours["status"] != "ok"]["system"]):
        if system not in drawn:
            ax.bar([], [], color=SYSTEM_COLORS.get(system, "C7"), label=f"measured ({hardware}): {system}, no value")


def _floor(ax, top: float, band: bool) -> None:
    ax.set_ylim(-BAND * top if band else 0, top)
    if band:
        ax.axhspan(-BAND * top, 0, color="0.92", zorder=0, lw=0)
        # named as a tick of its own, so that the layout makes room for it and it covers no marker
        ticks = [t for t in ax.get_yticks() if 0 <= t <= top]
        ax.set_yticks([*ticks, -BAND * top / 2], [f"{t:g}" for t in ticks] + ["no value"])
        ax.get_yticklabels()[-1].set(fontsize=6, color="0.4")


def _draw_paper(ax, ref: pd.DataFrame, label: str, marker: str) -> None:
    exact = ref[ref["bound"].isna()].sort_values("x")
    if len(exact):
        ax.plot(exact["x"], exact["y"], label=label, marker=marker, **PAPER)
    for kind in ("lower", "upper"):
        b = ref[ref["bound"] == kind]
        if b.empty:
            continue
        words = "lower bound (\"above\")" if kind == "lower" else "upper bound (\"below\")"
        ax.plot(b["x"], b["y"], linestyle="none", marker=BOUND_MARKERS[kind], markerfacecolor="none",
                color="black", markersize=8, label=f"{label}, {words}")
        for x, y in zip(b["x"], b["y"]):
            ax.annotate("", xy=(x, y), xytext=(0, 16 if kind == "lower" else -16), textcoords="offset points",
                        arrowprops=dict(arrowstyle="<-", color="black", lw=1))
    for x, y, mark in ref.dropna(subset=["mark"])[["x", "y", "mark"]].itertuples(index=False):
        ax.annotate(str(mark), (x, y), xytext=(4, 4), textcoords="offset points", fontsize=6)


def _paper_series(rows: pd.DataFrame, spec: Experiment, y: str, markers: dict[str, str]):
    """The paper's rows by system, each with its legend label and its marker (`markers` keeps one
    marker per label across the panels)."""
    systems = rows["system"].fillna("") if "system" in rows else pd.Series("", index=rows.index)
    quantity = spec.paper_quantity.get(y)
    for system, g in rows.groupby(systems, sort=False):
        label = f"paper ({spec.paper_hardware})" + (f": {system}" if system else "") + (f", {quantity}" if quantity else "")
        yield g, label, markers.setdefault(label, PAPER_MARKERS[len(markers) % len(PAPER_MARKERS)])


def _log_ticks(ax, ours: pd.DataFrame, paper: pd.DataFrame, spec: Experiment) -> None:
    """Ticks at the measured x values and at the paper's away from ours, thinned so that no two
    labels overprint; a model size axis names the model under its parameter count (and its layers
    where the point cut it to fewer)."""
    xs = sorted(set(ours["x"].dropna()) | (set(paper["x"].dropna()) if "x" in paper else set()))
    ticks: list[float] = []
    for x in xs:
        if x > 0 and all(abs(np.log(x / t)) > 0.25 for t in ticks):
            ticks.append(x)
    ax.set_xticks(ticks if len(ticks) <= 10 else ticks[:: -(-len(ticks) // 10)])
    names = {}
    if spec.x == "params_B":
        for frame, col in ((ours, "preset"), (paper, "model")):
            if col in frame:
                layers = frame["layers"] if "layers" in frame else pd.Series(np.nan, index=frame.index)
                for x, m, n in zip(frame["x"], frame[col], layers):
                    if pd.notna(x) and _size_b(m) is not None:  # a model cut to fewer layers says so
                        names.setdefault(x, f"\n({_size_b(m):g}B" + (f",\n{n:g} layers)" if pd.notna(n) else ")"))
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, p: _tick(v, p) + names.get(v, "")))
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())


def _interval(ax, rows: pd.DataFrame, y: str, color: str, horizontal: bool = False, at=None) -> None:
    """The median step's interval as an error bar on a model TFLOP/s value (aggregate.rate_interval),
    where the point has one."""
    if y != "model_tflops" or "model_tflops_low" not in rows:
        return
    have = rows["model_tflops_low"].notna() & rows["model_tflops_high"].notna() & rows[y].notna()
    if not have.any():
        return
    r = rows[have]
    err = [(r[y] - r["model_tflops_low"]).clip(lower=0), (r["model_tflops_high"] - r[y]).clip(lower=0)]
    if horizontal:
        ax.errorbar(r[y], np.asarray(at)[have.to_numpy()], xerr=err, fmt="none", ecolor="black", elinewidth=0.8,
                    capsize=2, label="_nolegend_", gid="interval")
    else:
        ax.errorbar(r["x"], r[y], yerr=err, fmt="none", ecolor=color, elinewidth=0.8, capsize=2,
                    label="_nolegend_", gid="interval")


def _draw_runs(ax, g: pd.DataFrame, spec: Experiment, y: str, name: str, label: str, marker: str, color: str,
               notes: list[str]) -> None:
    """A series' points: one line through the points of one setting; where the settings change, the
    next points are a line of their own, not joined to the last, with open markers (the change
    added to `notes`)."""
    pieces = runs(g, spec)
    for k, piece in enumerate(pieces):
        other = dict(markerfacecolor="white", gid=SETTINGS_CHANGE) if k else {}
        ax.plot(piece["x"], piece[y], marker=marker, color=color, label=label if k == 0 else "_nolegend_",
                **MEASURED, **other)
        _interval(ax, piece, y, color)
        if k:
            a, b = pieces[k - 1].iloc[-1], piece.iloc[0]
            note = f"{name} {_fmt(a['x'])}->{_fmt(b['x'])}: {setting_changes(settings(a, spec), settings(b, spec))}"
            if note not in notes:
                notes.append(note)


def lines(df: pd.DataFrame, spec: Experiment, hardware: str):
    """One panel per quantity; one line per system over the experiment's x. Returns the figure, the
    axes and the note's lines (settings that changed along a line)."""
    ours, paper = _split(df)
    ours = ours.assign(x=pd.to_numeric(ours["x"], errors="coerce"))
    paper = paper.assign(x=pd.to_numeric(paper["x"], errors="coerce")) if "x" in paper else paper
    fig, axes = plt.subplots(1, len(spec.panels), figsize=(4.7 * len(spec.panels), 4.4), squeeze=False)
    axes = list(axes[0])
    ok_all = ours[(ours["status"] == "ok") & ours["x"].notna()]
    # a system's full-depth series first, so that it takes the system's own colour
    names = sorted(set(_series(ok_all, spec)), key=lambda n: (n.split(" (")[0], "(all layers)" not in n, n)) \
        if len(ok_all) else []
    style = series_styles(names)
    # each point's colour: its series' (a system's second series, Ratel's disk route, has its own)
    colors = {i: _series_color(n, system, style) for i, n, system in zip(ours.index, _series(ours, spec), ours["system"])}
    paper_markers: dict[str, str] = {}
    notes: list[str] = []
    for ax, y in zip(axes, spec.panels):
        ok = ok_all[ok_all[y].notna()].sort_values("x")
        for system, g in ok.groupby(_series(ok, spec), sort=False):
            _draw_runs(ax, g, spec, y, system, f"measured ({hardware}): {system}", *style[system], notes)
        ref = paper_points(paper, spec, y)
        values = list(ok[y])
        if ref is not None and len(ref):
            for g, label, marker in _paper_series(ref, spec, y, paper_markers):
                _draw_paper(ax, g, label, marker)
            values += list(ref["y"])
        printed = paper_words(paper, spec, y) if len(paper) else None
        words = [(x, word, label, marker) for g, label, marker in
                 (_paper_series(printed, spec, y, paper_markers) if printed is not None else ())
                 for x, word in zip(g["x"], g["word"])]
        top = _axis_top(values)
        bad = ours[(ours["status"] != "ok") & ours["x"].notna()]
        if not values:  # the CPU has no device memory: say so rather than draw an empty 0-1 frame
            ax.text(0.5, 0.55, "no value measured", transform=ax.transAxes, ha="center", color="0.4")
            if ours["x"].notna().any():  # the other panels' x range
                lo, hi = ours["x"].min(), ours["x"].max()
                ax.set_xlim(*((lo / 1.5, hi * 1.5) if spec.log_x else (lo - 0.05 * (hi - lo) - 0.5, hi + 0.05 * (hi - lo) + 0.5)))
        _floor(ax, top, band=len(bad) > 0 or bool(words))
        _no_value(ax, ours, top, words, colors)
        _systems_without_value(ax, ours, set(ok_all["system"]), hardware)
        ylabel = YLABELS[y]
        if spec.paper_quantity.get(y) and ref is not None and len(ref):  # two quantities: say which is which
            ylabel = f"{TITLES[y].lower()} (GiB)\nours: peak allocated; paper: {spec.paper_quantity[y].split(' (')[0]}"
        ax.set(xlabel=spec.label, ylabel=ylabel, title=f"{TITLES[y]} by {spec.label.split(' (')[0]}")
        if "\n" in ylabel:
            ax.yaxis.label.set_size(9)
        if spec.log_x and ax.has_data() and (ours["x"].dropna() > 0).all():
            ax.set_xscale("log")
            _log_ticks(ax, ours, paper, spec)
            xs = set(ours["x"].dropna()) | (set(paper["x"].dropna()) if "x" in paper and len(paper) else set())
            if len(xs) == 1:  # one x (the CPU's one tiny model): centred, not at the frame
                ax.set_xlim(min(xs) / 3, min(xs) * 3)
            elif xs:  # room at both ends for the band's markers set side by side
                ax.set_xlim(min(xs) / 1.15, max(xs) * 1.15)
    shapes = shape_notes(ok_all, spec, _series(ok_all, spec)) if len(ok_all) else []
    return fig, axes, [*((f"settings differ (open markers): {n}", "0.25") for n in notes),
                       *((f"shape differs: {n}", "0.25") for n in shapes)]


def _model_series(rows: pd.DataFrame) -> pd.Series:
    """One line per system and model: "megatrain (qwen2.5-7b)"."""
    return rows["system"] + " (" + rows["preset"].astype(str) + ")"


def _not_drawn(rows: pd.DataFrame) -> list[tuple[str, str]]:
    """The points without a value by id, a line per kind (refused by estimate apart from observed out
    of memory, apart from not attempted), grey where nothing ran."""
    bad = rows[rows["status"] != "ok"]
    if bad.empty:
        return []
    kinds = bad.apply(no_value_kind, axis=1)
    out = []
    for kind in sorted(kinds.unique(), key=lambda k: (k in GREY_KINDS, k)):
        _, _, label = no_value_style(kind)
        out.append((f"not drawn, {label}: {', '.join(sorted(bad[kinds == kind]['id']))}",
                    "grey" if kind in GREY_KINDS else "0.15"))
    return out


def scaling(df: pd.DataFrame, spec: Experiment, hardware: str):
    """One line per system and model over the GPU count. In the first panel each line's ideal linear
    scaling from its 1-GPU point (dashed, its colour) and each further point's speed-up over that
    point; the other panels (host memory) the same lines alone. The points without a value are the
    note's, by id: never drawn."""
    ours = _split(df)[0]
    ours = ours.assign(x=pd.to_numeric(ours["x"], errors="coerce"))
    ok = ours[(ours["status"] == "ok") & ours["x"].notna()]
    fig, axes = plt.subplots(1, len(spec.panels), figsize=(5.4 * len(spec.panels), 4.4), squeeze=False)
    axes = list(axes[0])
    names = sorted(set(_model_series(ok)), key=lambda n: (n.split(" (")[0], _size_b(n) or 0, n)) if len(ok) else []
    style = series_styles(names)
    counts = sorted((ok if len(ok) else ours)["x"].dropna().unique())
    notes: list[str] = []
    for ax, y in zip(axes, spec.panels):
        pts = ok[ok[y].notna()].sort_values("x")
        values, speedups = list(pts[y]), []
        for name, g in pts.groupby(_model_series(pts), sort=False):
            marker, color = style[name]
            _draw_runs(ax, g, spec, y, name, f"measured ({hardware}): {name}", marker, color, notes)
            one = g[g["x"] == 1][y]
            if y != spec.panels[0] or one.empty or len(g) < 2:
                continue
            ax.plot(g["x"], one.iloc[0] * g["x"], linestyle="--", color=color, alpha=0.6, gid=IDEAL,
                    label="_nolegend_")
            values.append(one.iloc[0] * g["x"].max())
            speedups += [(x, v, f"{v / one.iloc[0]:.2f}x", color) for x, v in zip(g["x"], g[y]) if x != 1]
        top = _axis_top(values)
        _floor(ax, top, band=False)
        # beside its point, moved up where two labels at one count would overprint, on white where
        # they cross a line
        for x in sorted({x for x, *_ in speedups}):
            last = -np.inf
            for _, v, text, color in sorted(s for s in speedups if s[0] == x):
                last = max(v, last + 0.05 * top)
                ax.annotate(text, (x, v), xytext=(6, last), textcoords=("offset points", "data"), fontsize=7,
                            color=color, va="center", bbox=dict(boxstyle="square,pad=0.1", fc="white", ec="none",
                                                                alpha=0.8))
        if not values:
            ax.text(0.5, 0.55, "no value measured", transform=ax.transAxes, ha="center", color="0.4")
        if counts:
            lo, hi = counts[0], counts[-1]
            ax.set_xticks(counts, [_fmt(c) for c in counts])
            ax.set_xlim(lo - 0.25 * max(hi - lo, 1), hi + 0.35 * max(hi - lo, 1))
        ax.set(xlabel=spec.label, ylabel=YLABELS[y], title=f"{TITLES[y]} by {spec.label.split(' (')[0]}")
    return fig, axes, [*_not_drawn(ours), *((f"settings differ (open markers): {n}", "0.25") for n in notes)]


def _reference(rows: pd.DataFrame, column: str, match) -> pd.Series | None:
    """The row of `rows` that is its side's full configuration, or None."""
    for i, v in zip(rows.index, rows[column].astype(str)):
        if match(v):
            return rows.loc[i]
    return None


def bars(df: pd.DataFrame, spec: Experiment, hardware: str):
    """One horizontal bar per measured point (labelled by the experiment's x, coloured by its
    system, its value beside it), then the paper's rows as open hatched bars below; a point that did
    not run is a note of what happened at zero, in its system's colour (grey where nothing ran), a
    paper row printed as a word ("OOM") that word, in black.
    With the experiment's `reference`, each bar is its change against its own side's full
    configuration."""
    ours, paper = _split(df)
    if spec.reference:  # our full configuration first, as the paper's table puts its own
        ours = ours.assign(_first=~ours["id"].isin(spec.reference)).sort_values(["_first", "id"], kind="stable")
    n = len(ours)
    kept = [f(paper, spec, y) for y in spec.panels for f in (paper_points, paper_words)] if len(paper) else []
    keep = set().union(*(r.index for r in kept if r is not None))
    paper = paper.loc[paper.index.isin(keep)] if len(paper) else paper
    ref_ours = _reference(ours[ours["status"] == "ok"], "id", lambda v: v in spec.reference) if spec.reference else None
    ref_paper = (_reference(paper, "x", lambda v: spec.paper_reference in v)
                 if spec.paper_reference and len(paper) else None)
    relative = ref_ours is not None
    labels = [f"measured: {i}" if str(x) == str(i) else f"measured: {x} ({i})" for x, i in zip(ours["x"], ours["id"])]
    labels = [lab + (f" = paper's \"{spec.paper_rows[i]}\"" if i in spec.paper_rows and len(paper) else "")
              for lab, i in zip(labels, ours["id"])]
    if spec.x == "id":  # a grid point's id names no setup: its model, depth and tokens under it
        labels = [f"{label}\n{_bar_setup(row)}" for label, (_, row) in zip(labels, ours.iterrows())]
    labels += [f"paper: {v}" for v in paper["x"].astype(str)] if len(paper) else []
    if relative:
        labels = [lab + ("  [full: 0%]" if i == ref_ours.name else "") for i, lab in zip(ours.index, labels[:n])] + \
                 [lab + ("  [full: 0%]" if ref_paper is not None and i == ref_paper.name else "")
                  for i, lab in zip(paper.index, labels[n:])]
    per_bar = 0.5 if spec.x == "id" else 0.35  # two-line labels
    fig, axes = plt.subplots(1, len(spec.panels), figsize=((5.8 if len(spec.panels) < 4 else 4.4) * len(spec.panels),
                                                            per_bar * len(labels) + 1.9), squeeze=False, sharey=True)
    axes = list(axes[0])
    unit = {"model_tflops": "TFLOP/s", "executed_tflops": "TFLOP/s", "peak_host_GiB": "GiB", "peak_device_GiB": "GiB",
            "step_time_s": "s", "tokens_per_s": "tokens/s", "params_B": "B"}
    for ax, y in zip(axes, spec.panels):
        vals = pd.to_numeric(ours[y], errors="coerce").where(ours["status"] == "ok")
        pts = paper_points(paper, spec, y) if len(paper) else None
        pvals = pts["y"].reindex(paper.index) if pts is not None else pd.Series(np.nan, index=paper.index)
        if relative:
            base = ref_ours[y]
            pbase = pvals.get(ref_paper.name) if ref_paper is not None else np.nan
            shown = 100 * (vals / base - 1)
            pshown = 100 * (pvals / pbase - 1) if pd.notna(pbase) else pvals * np.nan
        else:
            shown, pshown = vals, pvals
        for system in dict.fromkeys(ours["system"]):  # a colour and a legend entry per system
            at = np.flatnonzero((ours["system"] == system).to_numpy())
            ax.barh(at, shown.iloc[at].fillna(0), color=SYSTEM_COLORS.get(system, "C7"),
                    label=f"measured ({hardware}): {system}")
            if not relative:
                _interval(ax, ours.iloc[at], y, "black", horizontal=True, at=at)
        for i, ((_, row), v, raw) in enumerate(zip(ours.iterrows(), shown, vals)):
            if row["status"] != "ok":  # what happened, in its system's colour (grey where nothing ran)
                kind = no_value_kind(row)
                ax.annotate(SHORT.get(kind, kind), (0, i), xytext=(3, 0), textcoords="offset points",
                            va="center", fontsize=7, color=point_color(row["system"], kind))
            elif relative and pd.notna(v):
                ax.annotate(f"{v:+.0f}% ({raw:.3g} {unit[y]})", (v, i), xytext=(3 if v >= 0 else -3, 0),
                            textcoords="offset points", va="center", ha="left" if v >= 0 else "right", fontsize=6)
            elif pd.notna(v):  # beyond its interval's bar
                end = max(v, row.get("model_tflops_high", np.nan)) if y == "model_tflops" and pd.notna(
                    row.get("model_tflops_high")) else v
                ax.annotate(_fmt(v), (end, i), xytext=(3, 0), textcoords="offset points", va="center", fontsize=6)
        if len(paper) and pshown.notna().any():
            ax.barh(range(n, n + len(paper)), pshown.fillna(0), fill=False, hatch="//", edgecolor="black",
                    label=f"paper ({spec.paper_hardware})")
            # the paper's value as it prints it (in its unit: GB, not our GiB)
            cells = paper[spec.paper_y[y]] if spec.paper_y.get(y) in paper else pd.Series(None, index=paper.index)
            punit = "GB" if y.endswith("_GiB") else unit.get(y, "")
            for i, (v, cell) in enumerate(zip(pshown, cells)):
                if pd.notna(v):
                    text = f"{_printed(cell)} {punit}".strip()
                    ax.annotate(f"{v:+.0f}% ({text})" if relative else text, (v, n + i),
                                xytext=(3 if v >= 0 else -3, 0), textcoords="offset points", va="center",
                                ha="left" if v >= 0 else "right", fontsize=6)
        printed = paper_words(paper, spec, y) if len(paper) else None
        for i, word in enumerate(printed["word"].reindex(paper.index) if printed is not None else ()):
            if isinstance(word, str):  # the paper's word where it printed no number ("OOM")
                ax.annotate(word, (0, n + i), xytext=(3, 0), textcoords="offset points", va="center", fontsize=7)
        if shown.isna().all() and pshown.isna().all():
            ax.text(0.5, 0.5, "no value measured", transform=ax.transAxes, ha="center", color="0.4")
            ax.set_xticks([])
        if relative:
            ax.axvline(0, color="black", lw=0.8)
            lo, hi = min([0, *shown.dropna(), *pshown.dropna()]), max([0, *shown.dropna(), *pshown.dropna()])
            pad = max(hi - lo, 10) * 0.75  # room for the value labels
            ax.set_xlim(lo - pad, hi + pad)
            what = TITLES[y].lower()
            ax.set(xlabel=f"{what}: change vs its own full configuration (%)", title=f"{TITLES[y]}, relative")
        else:
            top = max([*shown.dropna(), *pshown.dropna()], default=0)
            if top > 0:
                ax.set_xlim(0, 1.15 * top)  # room for the value labels
            quantity = spec.paper_quantity.get(y) if len(paper) and pshown.notna().any() else None
            ax.set(xlabel=YLABELS[y] + (f"\nthe paper's: {quantity}" if quantity else ""), title=TITLES[y])
    axes[0].set_yticks(range(len(labels)), labels, fontsize=7)
    axes[0].invert_yaxis()
    axes[0].set_ylabel(spec.label)
    note = []
    if relative:
        theirs = f", the paper's against \"{ref_paper['x']}\"" if ref_paper is not None else ""
        note.append((f"each bar against its own side's full configuration: ours against {ref_ours['id']}{theirs}",
                     "0.25"))
    return fig, axes, note


def _tokens(row) -> str:
    return f"{int(row['batch'])} x {int(row['accum'])} x {int(row['seq'])}"


def _bar_setup(row) -> str:
    """A point's model, depth and tokens a step: "32.8 B params, all layers, 8 x 2 x 4096 tokens"."""
    parts = [f"{row['params_B']:.3g} B params"] if pd.notna(row.get("params_B")) else []
    parts.append("all layers" if pd.isna(row.get("layers")) else f"{int(row['layers'])} layers")
    if all(pd.notna(row.get(c)) for c in ("batch", "accum", "seq")):
        parts.append(f"{_tokens(row)} tokens")
    return ", ".join(parts)


def _printed(cell) -> str:
    """A paper cell as the paper prints it: 88.97, not 89."""
    return f"{cell:.15g}" if isinstance(cell, (float, np.floating)) else str(cell)


def setup_line(ours: pd.DataFrame, spec: Experiment) -> str:
    """What the measured points ran with that no axis shows: decoder layers, tokens a step (batch x
    micro-batches x sequence), MegaTrain's kernels, GPUs and the host, each value with the systems
    that ran it where they differ; the x axis and what the experiment varies by design left out."""
    rows = ours[ours["status"] == "ok"]
    rows = rows if len(rows) else ours
    if rows.empty:
        return ""
    fields = []
    if spec.x != "layers":
        fields.append(("layers", rows["layers"].map(lambda n: "all" if pd.isna(n) else f"{int(n)}")))
    if spec.x != "seq" and not {"batch", "accum"} & set(spec.varies) and rows[["batch", "accum", "seq"]].notna().all().all():
        fields.append(("tokens a step", rows.apply(_tokens, axis=1)))
    if "kernels" in rows and rows["kernels"].notna().any():
        fields.append(("MegaTrain's kernels", rows["kernels"]))
    if spec.x != "gpus" and "gpus" in rows and (rows["gpus"].fillna(1) != 1).any():
        fields.append(("GPUs", rows["gpus"].fillna(1).map(lambda n: f"{int(n)}")))
    if "host_GiB" in rows and rows["host_GiB"].notna().any():
        fields.append(("host", rows["host_GiB"].map(lambda v: f"{v:.0f} GiB" if pd.notna(v) else None)))
    parts = []
    for name, values in fields:
        values = values.where(values.notna(), None)
        kept = values.dropna()
        if kept.empty:
            continue
        if kept.nunique() == 1:
            parts.append(f"{name}: {kept.iloc[0]}")
            continue
        by = {v: ", ".join(dict.fromkeys(rows.loc[kept.index[kept == v], "system"])) for v in dict.fromkeys(kept)}
        parts.append(f"{name}: " + ", ".join(f"{v} ({who})" for v, who in by.items()))
    return "setup: " + "; ".join(parts) if parts else ""


def figure(df: pd.DataFrame, name: str, hardware: str, smoke: bool = False):
    spec = experiment(name)
    if "x" not in df:  # a table from before aggregate wrote `x`
        df = df.assign(x=df[spec.x] if spec.x in df else df["id"])
    if smoke:  # the paper's GPU numbers beside a CPU smoke test would only set the scale
        df = df[df["source"] == "measured"]
    fig, axes, notes = {"bars": bars, "scaling": scaling}.get(spec.kind, lines)(df, spec, hardware)
    if spec.note and not smoke:  # what no axis says (the table prints it too)
        notes = [*notes, (spec.note, "0.25")]
    entries: dict = {}  # one legend for the figure, below the panels (inside one, it covered data)
    gids = set()
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            entries.setdefault(label, handle)
        gids |= {ln.get_gid() for ln in ax.get_lines()}
        ax.grid(alpha=0.3)
    if SETTINGS_CHANGE in gids:
        entries["open markers, a line apart: other settings than the series' earlier points (note)"] = Line2D(
            [], [], marker="o", markerfacecolor="white", color="grey")
    if IDEAL in gids:
        entries["ideal: linear scaling from the line's 1-GPU point (its colour)"] = Line2D([], [], linestyle="--",
                                                                                          color="black")
    paper_drawn = any(label.startswith("paper") for label in entries)
    width, height = fig.get_figwidth(), fig.get_figheight()  # inches
    # the texts wrapped to the width (about 13 characters an inch at size 10, 19 at size 7)
    if smoke:
        title = SMOKE_TITLE + "\n" + textwrap.fill(f"{name}: tiny models on {hardware}, checking the workflow end "
                                                    "to end; no paper overlay", int(13 * width))
    else:
        title = textwrap.fill(f"{name}: measured on {hardware}" + ("; the paper's points are the paper's, not "
                              "measured here" if paper_drawn else ""), int(13 * width))
    fig.suptitle(title, fontsize=10)
    if spec.kind == "line":
        notes = [(_failed_note(df[df["source"] == "measured"], spec), "0.15"), *notes]
    notes = [(setup_line(df[df["source"] == "measured"], spec), "black"), *notes]
    note_lines = [(w, color) for n, color in notes if n for w in textwrap.wrap(n, int(19 * width))]
    note_in = 0.13 * len(note_lines) + (0.05 if note_lines else 0)
    columns = _legend_columns(list(entries), width)
    legend_in = 0.17 * -(-len(entries) // columns) + 0.1
    title_in = 0.2 if smoke else 0
    fig.set_figheight(height + note_in + legend_in + title_in)
    total = fig.get_figheight()
    if entries:
        fig.legend(list(entries.values()), list(entries), loc="lower center", bbox_to_anchor=(0.5, note_in / total),
                   ncol=columns, fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, (note_in + legend_in) / total, 1, 1))
    line_in = 0.13 / total  # one note line, as a fraction of the figure's height
    for k, (text, color) in enumerate(reversed(note_lines)):
        fig.text(0.01, 0.01 + k * line_in, text, fontsize=7, color=color, va="bottom")
    return fig


def _legend_columns(labels: list[str], width_in: float) -> int:
    """As many legend columns (at most LEGEND_COLUMNS) as the figure's width holds: an entry is its
    marker and its text at about 19 characters an inch (size 7)."""
    widest = max((len(label) for label in labels), default=0) / 19 + 0.5
    return max(1, min(LEGEND_COLUMNS, int(width_in // widest)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m workflows.scripts.plot", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--csv", required=True)
    p.add_argument("--experiment", required=True)
    p.add_argument("--hardware", required=True)
    p.add_argument("--png", required=True)
    p.add_argument("--pdf", required=True)
    p.add_argument("--smoke-test", action="store_true",
                   help="a smoke test's numbers (the CPU grid): say so, without the paper's points")
    a = p.parse_args(argv)
    fig = figure(pd.read_csv(a.csv), a.experiment, a.hardware, smoke=a.smoke_test)
    save_figure(fig, a.png, a.pdf)
    plt.close(fig)
    outputs.record([a.png, a.pdf], [a.csv], [__file__, aggregate.__file__])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

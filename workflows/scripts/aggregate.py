"""One experiment's result JSONs -> a tidy table (CSV and Markdown), the paper's rows appended apart.

    python -m workflows.scripts.aggregate --experiment E --hardware H [--paper ARTEFACT] [--grid GRID] \
        --csv OUT.csv --md OUT.md RESULT.json ...

Measured rows carry source="measured"; the paper's rows (workflows.paper.rows) keep their own
columns and source="paper", so the two never share a number column by accident. The one column
they share is `x`, the experiment's x-axis coordinate (EXPERIMENTS), so that a figure can put them
on one axis. Without --paper, the experiment's default artefacts (EXPERIMENTS) are appended.
"""
from __future__ import annotations

import argparse
import functools
import json
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from megatrain.io import atomic_file, write_text
from megatrain.kernels import EXPERTS, LOSS, MLP, NORM
from megatrain.units import GiB
from suite.system import SYSTEMS
from suite.timing import median_interval

MEASURED_COLUMNS = ["source", "experiment", "id", "system", "preset", "layers", "batch", "accum", "seq", "gpus",
                    "options", "kernels", "status", "refused", "reason", "model_tflops", "model_tflops_low",
                    "model_tflops_high", "steps_measured", "steady", "ceiling_ratio", "executed_tflops", "step_time_s",
                    "tokens_per_s", "params", "peak_host_GiB", "peak_device_GiB", "host_bytes_per_param", "host_GiB",
                    "hidden_size", "width", "params_B"]

INTEGER_COLUMNS = ["layers", "batch", "accum", "seq", "gpus", "params", "hidden_size"]


def _size_b(model) -> float | None:
    """ "7B", "Qwen2.5-14B" or "qwen2.5-32b" -> 7.0, 14.0, 32.0 (the nominal billions of parameters)."""
    m = re.search(r"([\d.]+)\s*B\b", str(model), re.IGNORECASE)
    return float(m.group(1)) if m else None


@functools.cache
def _shape(model: str, seq_len: int):
    from megatrain.shapes import ModelShape
    from suite.spec import RunSpec
    return ModelShape(RunSpec(system="megatrain", model=json.loads(model), seq_len=seq_len).hf_config(cuda=True))


def executed_tflops(result: dict) -> float | None:
    """The rate of the FLOPs the kernels ran: the step's `hardware_flops` (the model's, the recompute's,
    less what the engine leaves out) with causal attention as the half square its kernels compute
    (suite.projection's count), over the step; None where the result records no executed FLOPs."""
    from megatrain.schedule import layers_keeping_attention
    from suite.projection import _causal
    med, spec = result.get("median") or {}, result["spec"]
    if result["status"] != "ok" or not med.get("hardware_flops"):
        return None
    shape = _shape(json.dumps(spec["model"], sort_keys=True), spec["seq_len"])
    engine = result["info"]["engine"]
    layers, kept = shape.num_layers, engine["no_recompute_layers"]
    # the layers whose attention the recompute ran again: not those that kept it (synthetic rows, no mask)
    keep = layers_keeping_attention(shape, spec["seq_len"], kept, engine.get("keep_attention_layers", 0))
    again = [i for i in range(layers - kept) if i not in keep]
    lens = [spec["seq_len"]] * spec["batch_size"] * spec["grad_accum"]
    return _causal(med["hardware_flops"], shape, layers, again, lens) / med["step_time_s"] / 1e12


_PARAMS_B: dict[str, float | None] = {}


def model_params_b(model) -> float | None:
    """The parameters (billions) of the paper's model as we count them: "7B" (a Qwen2.5 model, Table 2)
    -> the qwen2.5-7b preset's 7.62, so that the paper's point sits at the x of our run of the same
    model; the nominal size where there is no preset or no engine to count with."""
    size = _size_b(model)
    if size is None:
        return None
    key = f"qwen2.5-{size:g}b"
    if key not in _PARAMS_B:
        try:
            from megatrain.presets import PRESETS
            from workflows.scripts.grid import params
            _PARAMS_B[key] = params({"preset": key}) / 1e9 if key in PRESETS else None
        except ImportError:  # the workflow scripts also run without the engine installed
            _PARAMS_B[key] = None
    return _PARAMS_B[key] or size


def options_text(options: dict | None, info: dict | None = None) -> str:
    """A run's options as sorted `key=value` words (nested or dotted keys alike; the diagnostic ones,
    which only add a measurement, left out): what a figure compares to tell runs of different
    settings apart. An `auto` the run resolved, as its info records under the same key, says what
    it chose: `accumulate=auto(device)`, `engine.device_tiles=auto(19)`."""
    from workflows.scripts.grid import DIAGNOSTIC_OPTIONS, dotted
    chose = dotted(info or {})

    def word(k, v):
        if isinstance(v, bool):
            return f"{k}={str(v).lower()}"
        if v == "auto" and k in chose and chose[k] != "auto":  # one word: a figure splits the text at spaces
            return f"{k}=auto({str(chose[k]).replace(' ', '')})"
        return f"{k}={v}"
    return " ".join(sorted(word(k, v) for k, v in dotted(options or {}).items() if k not in DIAGNOSTIC_OPTIONS))


def kernels(result: dict) -> str | None:
    """MegaTrain's layer kernels as the run resolved them (engine.norm_kernel, engine.mlp_kernel;
    eager before the settings existed): "eager", "compiled", or the one compiled; ", loss compiled"
    after it where engine.loss_kernel was, ", experts lean" where engine.experts_kernel was. Their default
    changes with the machine (`auto`), so the asked options alone would not tell a figure that two
    points ran different kernels. None for other systems and for runs that did not start."""
    engine = (result.get("info") or {}).get("engine")
    if result.get("system") != "megatrain" or not isinstance(engine, dict):
        return None
    layer = [k for k in (NORM, MLP) if k.runs(engine)]
    label = "compiled" if len(layer) == 2 else f"{layer[0].label} {layer[0].own}" if layer else "eager"
    return label + "".join(f", {k.label} {k.own}" for k in (LOSS, EXPERTS) if k.runs(engine))


# what a result's reason says when the memory ran out while the point ran (the worker's own error, or
# the runner's reading of how it died: suite/worker.py, suite/runner.py), not an admission's estimate
OBSERVED_OOM = re.compile(r"out of memory|OutOfMemoryError|MemoryError|killed by SIGKILL")


def refused(result: dict) -> str | None:
    """The memory ("host", "device", "disk") for which the harness refused the point by its estimate
    before anything ran (a system's admission: `megatrain.memory.DoesNotFit`, whose disk refusals the
    result records as oom_host); None for a point that ran out of memory while it ran, or did not
    fail for memory."""
    status, reason = result.get("status"), result.get("reason") or ""
    if status not in ("oom_host", "oom_device") or result.get("steps") or OBSERVED_OOM.search(reason):
        return None
    if "disk space" in reason or re.search(r"swaps? .* free there", reason):  # the older ZeRO-Infinity words
        return "disk"
    return "device" if status == "oom_device" else "host"


def _label(df: pd.DataFrame, cols: list[str]) -> pd.Series:
    present = [c for c in cols if c in df]
    return df[present].astype(str).agg(" / ".join, axis=1) if present else pd.Series("", index=df.index)


@dataclass(frozen=True)
class Experiment:
    """How one experiment is tabulated and drawn. `x` is a measured column (the x axis, or the bar
    labels when kind="bars"); `paper_x` turns the paper artefact's rows into the same coordinate;
    `paper_y` maps a measured column to the paper's column of the same quantity (GB for memory)."""
    paper: tuple[str, ...]
    x: str
    label: str
    # "line": one line per system over x; "bars": one bar per point; "scaling": one line per model and
    # system over the GPU count, beside its ideal linear scaling
    kind: str = "line"
    log_x: bool = False
    panels: tuple[str, ...] = ("model_tflops", "peak_host_GiB", "peak_device_GiB")
    paper_x: object = None  # Callable[[DataFrame], Series] over the paper's rows
    paper_y: dict = field(default_factory=dict)
    paper_hardware: str = "GH200"
    # what the paper's column of a panel measures, where it is not what we measure (our device memory
    # is the allocator's peak; Tables 5 and 6 print a device allocation)
    paper_quantity: dict = field(default_factory=dict)
    # columns that change along a line by design (Table 7's batch per context): a change of any other
    # setting between two points of a line is marked on the figure
    varies: tuple[str, ...] = ()
    # system options whose value gives a system's points a line of their own, named by it (Ratel's
    # offload: its host-memory and disk routes are two systems in effect)
    series_by: tuple[str, ...] = ()
    # bars: the ids of our full configuration and a text of the paper's; each bar is then drawn
    # relative to its own side's full configuration
    reference: tuple[str, ...] = ()
    paper_reference: str | None = None
    # bars: our point ids -> the paper's row of the same configuration, named beside the bar
    paper_rows: dict = field(default_factory=dict)
    # the step model's predictions for the paper's rows on the paper's machines, in a section of
    # their own, with the model against this table's measured points (suite/projection.py)
    predicted: bool = False
    # what a reader of the measured rows must know that no column says, printed under them
    note: str = ""


EXPERIMENTS: dict[str, Experiment] = {
    "scale": Experiment(("figure1_scale",), "params_B", "model size (billion parameters)", log_x=True,
                        paper_x=lambda r: r["model"].map(model_params_b), paper_y={"model_tflops": "tflops"},
                        predicted=True),
    # Tables 5 and 6 print MegaTrain's device memory; Figures 5 and 6 each system's throughput and host
    # memory where the text states them
    "depth": Experiment(("table5_depth", "figure5_depth"), "layers", "decoder layers",
                        paper_x=lambda r: r["layers"],
                        paper_y={"model_tflops": "tflops", "peak_host_GiB": "host_memory_GB",
                                 "peak_device_GiB": "device_alloc_GB"},
                        paper_quantity={"peak_device_GiB": "device allocation (Table 5)"}),
    "width": Experiment(("table6_width", "figure6_width"), "width", "width multiplier (x the preset's hidden size)",
                        paper_x=lambda r: r["width_scale"],
                        paper_y={"model_tflops": "tflops", "peak_host_GiB": "host_memory_GB",
                                 "peak_device_GiB": "device_alloc_GB"},
                        paper_quantity={"peak_device_GiB": "device allocation (Table 6)"}),
    "context": Experiment(("table7_context",), "seq", "sequence length (tokens)", log_x=True,
                          paper_x=lambda r: pd.to_numeric(r["context_K"], errors="coerce") * 1024,
                          paper_y={"model_tflops": "tflops", "peak_device_GiB": "mem_GB"},
                          paper_quantity={"peak_device_GiB": "\"Mem\" (Table 7; device, inferred)"},
                          varies=("batch", "accum"),
                          note="Table 7's 512K on all 28 layers ran on one GPU of the two-H200 host as "
                               "long_context/ctx512k_L28, its checkpoints (one every 2 layers) offloaded to the "
                               "host (results/h200/tables/long_context.md)."),
    "ablations": Experiment(("table4_ablations",), "id", "configuration", kind="bars",
                            panels=("model_tflops", "peak_device_GiB"),
                            paper_x=lambda r: r["configuration"],
                            paper_y={"model_tflops": "tflops", "peak_device_GiB": "device_mem_GB"},
                            paper_quantity={"peak_device_GiB": "\"Device Mem\" (Table 4)"},
                            paper_hardware="GH200 (not stated; inferred)",
                            reference=("full", "base", "base_K1"), paper_reference="(full)",
                            paper_rows={"full": "MegaTrain (full)", "one_buffer": "w/o Double Buffering",
                                        "sync_grads": "w/o Gradient Slab Pool", "K1": "w/ Checkpoint Interval=1"}),
    # Appendix B: Ratel's throughput per model size (the paper's on GH200; ours where a checkout runs)
    "ratel": Experiment(("appendix_b_ratel",), "params_B", "model size (billion parameters)", log_x=True,
                        panels=("model_tflops",), paper_x=lambda r: r["model"].map(model_params_b),
                        paper_y={"model_tflops": "tflops"}, series_by=("offload", "args.is_mp"),
                        note="Ratel's disk route (`offload=disk`) with run.sh's optimizer process (`--is_mp 1`) "
                             "times the route's work, but after its first step the gradients do not reach that "
                             "process: they land in a pinned copy of a buffer the queue moved into shared "
                             "memory, and the optimizer steps on the first step's (baselines/ratel.md). Its "
                             "host peak counts that process's shared buffers twice, once in each process."),
    # Table 8 is the three PCIe systems' specifications: tabulated beside, never drawn as throughput.
    "devices": Experiment(("table9_consumer_gpus", "figure7_devices", "table8_pcie_systems"), "system", "system",
                          kind="bars", paper_x=lambda r: _label(r, ["artefact", "gpu", "model", "method", "system"]),
                          paper_y={"model_tflops": "tflops", "peak_host_GiB": "cpu_mem_GB",
                                   "peak_device_GiB": "gpu_mem_GB"},
                          paper_quantity={"peak_host_GiB": "\"CPU Mem\" (Table 9)",
                                          "peak_device_GiB": "\"GPU Mem\" (Table 9; device, not said how measured)"},
                          paper_hardware="RTX A6000 / RTX 3090 (Table 9), A100 PCIe (Figure 7)",
                          note="The paper's rows ran on its PCIe machines (Table 8, tabulated beside: an A100 PCIe "
                               "for Figure 7, an RTX A6000 and an RTX 3090 for Table 9), none of which is here: the "
                               "measured rows run Table 9's shapes (8192 tokens a sequence, MegaTrain at the A6000's "
                               "batches, the baselines at 1) with Figure 7's systems on this machine's GPU, so they "
                               "compare the systems, not the machines. Figure 7 states no batch or sequence."),
    # data-parallel ranks on one host (docs/data-parallel.md): the same batch per GPU, so the batch
    # grows with the count by design; no paper artefact (the paper trains on one GPU)
    "gpus": Experiment((), "gpus", "GPU count (data-parallel ranks on one host)", kind="scaling",
                       panels=("tokens_per_s", "peak_host_GiB"), varies=("batch",)),
    # mixtures of experts at reduced depth beside the baselines on a shape they fit (docs/moe.md): no
    # paper artefact (the paper prints no MoE measurement)
    "moe": Experiment((), "id", "grid point", kind="bars",
                      panels=("model_tflops", "step_time_s", "peak_host_GiB", "peak_device_GiB")),
    # the largest model a host holds: its size and the host memory it takes are the point
    "largest": Experiment((), "id", "grid point", kind="bars", panels=("model_tflops", "params_B", "peak_host_GiB")),
    # beyond the paper's 512K: a step's model FLOPs count attention's whole score square, which at a
    # million tokens is most of them, so the FLOPs the step ran stand beside
    "long_context": Experiment((), "id", "grid point", kind="bars",
                               panels=("model_tflops", "executed_tflops", "step_time_s", "peak_device_GiB"),
                               note="Model TFLOP/s: the model's FLOPs a token, 6 x its matmul parameters + 12 x "
                                    "layers x width x the keys it attends (the whole causal square, though a causal "
                                    "kernel computes about half), over the step's time; executed TFLOP/s: the FLOPs the "
                                    "kernels ran, the recomputed forward in and causal attention as the half square "
                                    "(megatrain/metrics.py, suite/projection.py)."),
}
GENERIC = Experiment((), "id", "grid point", kind="bars", panels=("model_tflops",))


def experiment(name: str) -> Experiment:
    """The experiment's mapping; an unknown one gets GENERIC (a table and TFLOP/s bars per point id)."""
    return EXPERIMENTS.get(name, GENERIC)


def _hidden_size(model: dict) -> int | None:
    hidden = (model.get("overrides") or {}).get("hidden_size")
    if hidden is None and model.get("preset"):
        try:
            from megatrain.presets import PRESETS
        except ImportError:  # the workflow scripts also run without the engine installed
            return None
        hidden = (PRESETS.get(model["preset"]) or {}).get("hidden_size")
    return int(hidden) if hidden else None


def _width(result: dict, model: dict) -> float | None:
    """The point's width multiplier: its own `width` field where the result carries one, else its
    hidden size over its preset's."""
    for where in (result, result["spec"], model):
        if where.get("width") is not None:
            return float(where["width"])
    hidden = (model.get("overrides") or {}).get("hidden_size")
    base = _hidden_size({"preset": model.get("preset")})
    return float(hidden) / base if hidden and base else (1.0 if base else None)


def _trained_params(result: dict) -> int | None:
    """The parameters of the model the system trains where that is not the spec's model: Ratel's
    GPT at the spec's shape (4.88 B at 7B's), as its info counts it where it ran, else (refused before
    it built one, or not run) by Ratel's own count from the spec's shape."""
    counted = (result.get("info") or {}).get("ratel_params")
    if counted or result.get("system") != "ratel":
        return counted
    try:  # only for Ratel's points: its module imports torch
        from baselines.ratel import Ratel
        from megatrain.presets import PRESETS
    except ImportError:  # the workflow scripts also run without the engine installed
        return None
    model = (result.get("spec") or {}).get("model") or {}
    shape = {**(PRESETS.get(model.get("preset")) or {}), **(model.get("overrides") or {})}
    if not {"hidden_size", "num_hidden_layers", "vocab_size"} <= set(shape):
        return None
    return Ratel.ratel_params(shape["hidden_size"], shape["num_hidden_layers"], shape["vocab_size"],
                              result["spec"]["seq_len"])


def rate_interval(result: dict) -> dict:
    """The model TFLOP/s at the ends of the median step's interval (suite/timing.py: from the
    result's `timing`, else from its steps after the warm-up), the steps measured and whether their
    last window steadied (None where the result predates `timing`)."""
    timing, rate = result.get("timing") or {}, (result.get("median") or {}).get("model_tflops")
    spec = result.get("spec") or {}
    times = [s["step_time_s"] for s in (result.get("steps") or [])[spec.get("warmup", 0):]
             if isinstance(s.get("step_time_s"), (int, float))]
    if timing.get("interval_s"):
        (low_s, high_s), median_s = timing["interval_s"], timing["median_s"]
    elif len(times) >= 2:
        low_s, high_s, _ = median_interval(times)
        median_s = statistics.median(times)
    else:
        low_s = high_s = median_s = None
    known = rate is not None and median_s and low_s and high_s
    return {"model_tflops_low": rate * median_s / high_s if known else None,
            "model_tflops_high": rate * median_s / low_s if known else None,
            "steps_measured": timing.get("measured_steps", len(times) or None), "steady": timing.get("steady")}


def flatten(result: dict, point_id: str, experiment: str) -> dict:
    """One harness result (suite.runner's JSON) as one row."""
    spec, med, peak = result["spec"], result.get("median") or {}, result.get("peak") or {}
    model = spec.get("model") or {}
    params = _trained_params(result) or result.get("params")
    host, device = peak.get("host_rss_bytes"), peak.get("device_allocated_bytes")
    host_total = (result.get("env") or {}).get("host_memory_bytes")
    reason = result.get("reason")
    return {
        "source": "measured", "experiment": experiment, "id": point_id, "system": result["system"],
        "preset": model.get("preset") or model.get("config"),
        "layers": (model.get("overrides") or {}).get("num_hidden_layers"),
        "batch": spec["batch_size"], "accum": spec["grad_accum"], "seq": spec["seq_len"],
        "gpus": spec.get("gpus") or 1,  # results from before the field ran on one GPU
        "options": options_text(spec.get("options"), result.get("info")),
        "kernels": kernels(result),
        "status": result["status"], "refused": refused(result),
        "reason": " ".join(reason.split())[:300] if reason else None,
        "model_tflops": med.get("model_tflops"),
        **rate_interval(result),
        # MegaTrain with `ceiling`: model TFLOP/s over one decoder layer's alone on the same batch
        "ceiling_ratio": result.get("ratio_to_ceiling"),
        "executed_tflops": executed_tflops(result), "step_time_s": med.get("step_time_s"),
        "tokens_per_s": med.get("tokens_per_s"), "params": params,
        "peak_host_GiB": host / GiB if host else None,
        "peak_device_GiB": device / GiB if device else None,
        "host_bytes_per_param": host / params if host and params else None,
        "host_GiB": host_total / GiB if host_total else None,  # the host the point ran on (as the OS read it)
        "hidden_size": _hidden_size(model), "width": _width(result, model),
        "params_B": params / 1e9 if params else None,
    }


def _result(path: Path) -> dict:
    """A point's result file, or a ValueError that names it and the way out (the harness writes
    results whole: one that cannot be read was changed outside it)."""
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path} is not a readable result ({e}): delete it, and the workflow runs its point "
                         f"again") from None


def measured(paths: list[str | Path], experiment: str, grid: str | Path | None = None) -> pd.DataFrame:
    """One row per result file; with `grid`, also a `not_run` row for each of the experiment's
    points that has no file among `paths` (a table made before the whole grid has run), and the
    status `stale` for a result that ran something other than its grid point runs now."""
    results = {Path(p): _result(Path(p)) for p in paths}
    if grid is not None:
        from workflows.scripts import grid as gridlib
        points = {point_id: point for (name, point_id), point in gridlib.points(gridlib.load(grid)).items()
                  if name == experiment}
        for path, result in results.items():
            why = gridlib.stale(points[path.stem], result) if path.stem in points else None
            if why:
                results[path] = {**result, "status": "stale", "reason": (
                    f"{why}: not the grid's point ({result['status']} then); run it again with --forcerun {path}")}
    rows = [flatten(result, path.stem, experiment) for path, result in results.items()]
    if grid is not None:
        have = {path.stem for path in results}
        for point_id, point in points.items():
            if point_id not in have:
                rows.append(flatten(gridlib.not_run(point), point_id, experiment))
    df = pd.DataFrame(rows, columns=MEASURED_COLUMNS)
    return df.astype({c: "Int64" for c in INTEGER_COLUMNS})


def _paper_x(spec: Experiment, ref: pd.DataFrame):
    """The paper rows' x coordinate; None where the artefact lacks the columns it is read from
    (a --paper artefact other than the experiment's own)."""
    if spec.paper_x is None or ref.empty:
        return None
    try:
        return spec.paper_x(ref)
    except KeyError:
        return None


def table(paths: list[str | Path], experiment: str, paper: str | list[str] | None = None,
          grid: str | Path | None = None) -> pd.DataFrame:
    """Measured rows (and `not_run` rows for the grid's points without a result), then each paper
    artefact's rows (their own columns; source="paper"); both carry `x`, the experiment's x
    coordinate. paper=None: the experiment's default artefacts."""
    spec = EXPERIMENTS.get(experiment, GENERIC)
    papers = spec.paper if paper is None else ([paper] if isinstance(paper, str) else list(paper))
    df = measured(paths, experiment, grid)
    df["x"] = df[spec.x]
    if papers:
        from workflows.paper import rows
        refs = []
        for name in papers:
            ref = rows(name).assign(experiment=experiment)
            ref["x"] = _paper_x(spec, ref)
            refs.append(ref)
        df = pd.concat([df, *refs], ignore_index=True, sort=False)
        df = df.astype({c: "Int64" for c in INTEGER_COLUMNS})  # concat turns missing ints to float
    return df


def _cell(v, printed: bool = False) -> str:
    """A measured number to three significant figures (whole above 1000); with `printed`, a paper's
    number as the paper prints it (Table 3's 88.97 beside 88.99)."""
    if v is None or (not isinstance(v, str) and pd.isna(v)):
        return ""
    if isinstance(v, float):
        if printed:
            return f"{v:.15g}"
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v).replace("|", "/")


def md_table(df: pd.DataFrame, printed: bool = False) -> str:
    cols = [c for c in df.columns if df[c].notna().any()]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_cell(v, printed) for v in row) + " |" for row in df[cols].itertuples(index=False)]
    return "\n".join(lines)


# the paper's names of the systems it compares, as the suite names them
PAPER_SYSTEMS = {r.paper: name for name, r in SYSTEMS.items() if r.paper}
# a stated ratio's quantity: its panel's where a figure has two (Figures 5 and 6: (a) throughput,
# (b) host memory), else throughput
RATIO_QUANTITY = {"a": "model_tflops", "b": "peak_host_GiB"}
SAME_SPEC = ["batch", "accum", "seq", "gpus"]


def _side(rows: pd.DataFrame) -> str:
    """What a system's rows at a ratio's x say where none ran to the end: their statuses, or that none is there."""
    return ", ".join(sorted(set(rows["status"].astype(str)))) if len(rows) else "no point"


def ratios(df: pd.DataFrame, experiment: str, hardware: str) -> list[str]:
    """Each ratio the paper states (its system's value over `versus`'s at one x) beside the same
    ratio of this machine's points at that x: the two systems' points that ran, with the same batch,
    accumulation, sequence and GPU count; where either has none, what its points there say."""
    paper = df[df["source"] == "paper"]
    if not {"versus", "ratio"} <= set(paper.columns):
        return []
    claims = paper[paper["versus"].notna() & paper["ratio"].notna()]
    if claims.empty:
        return []
    ours = df[df["source"] == "measured"]
    spec = EXPERIMENTS.get(experiment, GENERIC)
    label = "model" if spec.kind == "bars" else spec.label  # bars pair the two systems' points by model size
    out = ["", f"## The paper's ratios beside the same ratios measured on {hardware}", "",
           "A ratio is the first system's value over the second's at the same x, both on the paper's hardware "
           f"(its section above) or both on {hardware}; a measured ratio pairs two points that ran with the "
           "same batch, accumulation, sequence and GPU count.", "",
           f"| {label} | system | versus | quantity | paper | measured | values measured |",
           "|---|---|---|---|---|---|---|"]
    for _, c in claims.iterrows():
        quantity = RATIO_QUANTITY.get(c.get("panel"), "model_tflops")
        x = pd.to_numeric(pd.Series([c["x"]]), errors="coerce").iloc[0]
        if pd.notna(x):
            at = ours[pd.to_numeric(ours["x"], errors="coerce").sub(x).abs() <= 1e-3 * abs(x)]
        elif "model" in c and pd.notna(c["model"]):  # bars, whose x is a label: the same model size
            at = ours[ours["preset"].map(_size_b) == _size_b(c["model"])]
        else:
            at = ours.iloc[:0]
        first, second = (at[at["system"] == PAPER_SYSTEMS.get(name)] for name in (c["system"], c["versus"]))
        pairs = first[first["status"] == "ok"].merge(second[second["status"] == "ok"], on=SAME_SPEC)
        if len(pairs):
            a, b = pairs.iloc[0][f"{quantity}_x"], pairs.iloc[0][f"{quantity}_y"]
            measured, values = f"{a / b:.2f}", f"{_cell(a)} / {_cell(b)}"
        else:
            measured = "none"
            values = "; ".join(f"{PAPER_SYSTEMS.get(n, n)}: {_side(rows)}" for n, rows in
                               ((c["system"], first), (c["versus"], second)) if not (rows["status"] == "ok").any())
            values = values or "no two points with the same spec"
        x = c["model"] if "model" in c and pd.notna(c["model"]) else _cell(c["x"])
        out.append(f"| {x} | {c['system']} | {c['versus']} | {quantity} | {_cell(c['ratio'], True)} ({c['artefact']}) "
                   f"| {measured} | {values} |")
    return out


def markdown(df: pd.DataFrame, experiment: str, hardware: str, results: list[str | Path] = (),
             moe: list[str | Path] = ()) -> str:
    """The measured rows, then each paper artefact's rows, as separate Markdown tables (a paper table
    shows only its artefact's own columns); the mixtures of experts measured on this hardware
    (`moe`: the scale table's MoE rows); where the experiment has them, the step model's
    predictions, checked against the measured `results` and `moe`."""
    out = [f"# {experiment} ({hardware})", "", f"## Measured ({hardware})", "",
           md_table(df[df["source"] == "measured"][MEASURED_COLUMNS].drop(columns=["source", "experiment"]))]
    if EXPERIMENTS.get(experiment, GENERIC).note:
        out += ["", EXPERIMENTS[experiment].note]
    paper = df[df["source"] == "paper"]
    for artefact, ref in (paper.groupby("artefact", sort=False) if len(paper) else ()):
        cols = [c for c in ref.columns if c not in ("source", "experiment", "artefact", "x")]
        out += ["", f"## Paper ({artefact}; its hardware, not {hardware})", "", md_table(ref[cols], printed=True)]
    out += ratios(df, experiment, hardware)
    if moe:
        rows = measured(moe, "moe")
        rows = rows.assign(tokens=rows["batch"] * rows["accum"] * rows["seq"])
        out += ["", f"## Mixtures of experts (measured on {hardware}: the `moe` experiment)", "",
                "A row with `layers` is the model's shape on that many of its layers (the most this host holds, or "
                "fewer), a row without them the whole model, each at `tokens` a step; a full-depth row this host "
                "cannot hold is the step model's, in the predictions below.", "",
                md_table(rows[["id", "system", "preset", "layers", "tokens", "status", "model_tflops", "step_time_s",
                               "peak_host_GiB", "peak_device_GiB", "params_B"]])]
    if EXPERIMENTS.get(experiment, GENERIC).predicted:
        out += predicted([*results, *moe])
    return "\n".join(out) + "\n"


def predicted(results: list[str | Path]) -> list[str]:
    """The step model's predictions for the paper's scale rows on the paper's machines, and the
    same model against the measured MegaTrain points among `results` (those of a probed machine)."""
    from suite.projection import check, predictions
    out = ["", "## Predicted by the step model (suite/projection.py): predictions, not measurements", "",
           "The paper's scale rows (4096 x 8 x 4 micro-batches, the engine's default settings) on the paper's "
           "machines, whose constants the model assumes where they were not probed (see "
           "results/projection/projection.md). A dense layer is timed at the machine's eager layer probe less the "
           "time its probes measured the compiled norms and MLP product to save; an MoE layer at its family's layer "
           "probe on the H200 with the lean experts (the library's experts run at about half a dense layer's rate "
           "and made the `moe` tables' earlier steps). The column `bound` names what binds each row; how far the model is from each measured point, "
           "the table after this one.",
           "", "| machine | model | fits | host GiB | device GiB | step s | model TFLOP/s | bound | paper TFLOP/s |",
           "|---|---|---|---|---|---|---|---|---|"]
    for p in predictions():
        out.append(f"| {p['machine']} | {p['preset']} | {p['fits']} | {p['host_GiB']:.0f} | {p['device_GiB']:.0f} "
                   f"| {p['step_s']:.1f} | {p['model_tflops']:.0f} | {p['bound']} | {p['paper_tflops'] or 'not printed'} |")
    rows = check([Path(r) for r in results])
    if not rows:
        return out + ["", "None of the measured points above ran on a machine the model has probes of, so its error "
                      "is not shown here; against every committed point: results/projection/projection.md."]
    out += ["", "The model against the measured MegaTrain points above (projected / measured, and its error):", "",
            "| point | bound | step s | host GiB |", "|---|---|---|---|"]
    for r in rows:
        cells = [f"{r[k]['projected']:.1f} / {r[k]['measured']:.1f} ({100 * r[k]['error']:+.1f}%)"
                 for k in ("step_s", "host_GiB")]
        out.append(f"| {Path(r['point']).stem} | {r['bound']} | " + " | ".join(cells) + " |")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m workflows.scripts.aggregate", description=__doc__)
    p.add_argument("--experiment", required=True)
    p.add_argument("--hardware", required=True)
    p.add_argument("--paper", action="append",
                   help="workflows/paper artefact (file stem) to append, repeatable (default: the experiment's)")
    p.add_argument("--grid", help="the grid file: its points of this experiment without a result get a not_run row")
    p.add_argument("--moe", action="append", default=[],
                   help="the scale table: a mixture of experts' result at reduced depth, repeatable")
    p.add_argument("--csv", required=True)
    p.add_argument("--md", required=True)
    p.add_argument("results", nargs="*")
    a = p.parse_args(argv)
    df = table(a.results, a.experiment, a.paper, a.grid)
    with atomic_file(a.csv) as tmp:
        df.to_csv(tmp, index=False)
    write_text(a.md, markdown(df, a.experiment, a.hardware, a.results, a.moe))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The machines the step model (suite/projection.py) knows, each described once, as data.

`machines/<name>.yaml` says what a machine is: its GPU, how many the host holds, its cores, the host
and device memory a run may use, the lent kind, its results folder and Snakemake profile, and the
committed bandwidth probe that gives its link each way and its host copy, and where it has one, the
host AdamW probe that gives the host kernel's rate over each master layout. `machines/gpus/<gpu>.yaml`
names the probes of what runs on the GPU alone (one decoder layer's rate and shape, the compiled
kernels' saving, the MoE layers), shared by every machine with that GPU. The constants are read
from those JSON files when this module loads, so no probed number is written in code; a missing file
or field is a ValueError naming the description, the file and the field. A machine of the paper's,
not probed here, states its link and host copy under `assumed`, and its source says so.
"""
from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
FOLDER = ROOT / "machines"

Shape = tuple[str, int, int]  # a layer probe's (preset, batch, seq), checkpoint every layer
# the bandwidth probe's rows (experiments/probes/bandwidth.py) that give the step model's rates
H2D, D2H, HOST_COPY = ("pcie", "h2d-pinned"), ("pcie", "d2h-pinned"), ("host", "copy")


@dataclass(frozen=True)
class MachineModel:
    name: str
    device_gib: float  # free device memory at the start of a run
    host_gib: float  # host memory the run may use
    h2d_gbps: float  # pinned, large chunks
    d2h_gbps: float
    host_copy_gbps: float  # memcpy, bytes read + written
    layer_tflops: float  # the single-layer probe, model FLOP/s
    probe: Shape  # its shape
    source: str  # where the constants come from
    match: tuple[str, int] | None = None  # (GPU name, host cores) of a result's env run on it
    # a mixture of experts' layer, per family and experts' variant (`experts_variant`): its probe's
    # model TFLOP/s and shape, as `probe` (with the library's experts an MoE layer runs at about half
    # a dense layer's rate: docs/moe.md); a family without one is timed at the dense layer's rate
    moe_layers: dict = field(default_factory=dict)
    # seconds the compiled norms and MLP product save in the layer probe's forward, recompute and
    # backward, and its shape; None: a machine without the pair of probes, timed eager
    compiled_saving: tuple[float, Shape] | None = None
    # the host kernel's AdamW, G parameters/s over split masters, whole ones and whole ones with a
    # bf16 shadow, those the probe had, on all the host's cores (experiments/probes/adamw_rate.py,
    # Probe.adamw); None: a machine without the probe, whose update is timed by its host copy
    adamw_gps: dict[str, float] | None = None


class Probe:
    """One committed probe JSON, as a description names it: its fields by key path, each missing
    one a ValueError naming the description, the file and the field."""

    def __init__(self, path: str, named_in: str):
        self.path, self.named_in = path, named_in
        self.data = _json(path, named_in)

    def get(self, *keys: str):
        value = self.data
        for k in keys:
            if not isinstance(value, dict) or value.get(k) is None:
                raise ValueError(f"{self.named_in}: {self.path} has no field {'.'.join(keys)}")
            value = value[k]
        return value

    def tier(self, tier: str, direction: str) -> float:
        """A bandwidth probe's measured GB/s of one tier and direction."""
        rows = [r for r in self.get("tiers") if (r.get("tier"), r.get("direction")) == (tier, direction)]
        if not rows or rows[0].get("status") != "ok" or rows[0].get("gbps") is None:
            raise ValueError(f"{self.named_in}: {self.path} has no measured row tiers[{tier} {direction}].gbps")
        return rows[0]["gbps"]

    def layer(self, variant: str, key: str = "model_tflops") -> float:
        """A layer probe's (experiments/probes/layer_kernels.py) figure of one variant."""
        return self.get("variants", variant, "ceilings", "default", key)

    def adamw(self) -> dict[str, float]:
        """A host AdamW probe's (experiments/probes/adamw_rate.py) median rates of the host kernel:
        split masters', and by the bytes each path recorded, a whole master's alone (28 B a
        parameter: `one_pass_whole`, or `one_pass_master` in files from before whole masters
        streamed as they are) and with its bf16 shadow (30 B: those files' `one_pass_whole`), each
        that the file has."""
        report = self.get("report")
        rates = {"split": self.get("report", "one_pass_split", "median_g_params_per_s")}
        for path in ("one_pass_whole", "one_pass_master"):
            if isinstance(report.get(path), dict):
                layout = {28: "whole", 30: "shadow"}[self.get("report", path, "bytes_per_param")]
                rates[layout] = self.get("report", path, "median_g_params_per_s")
        return rates

    def layer_shape(self) -> Shape:
        return self.get("preset"), self.get("batch"), self.get("seq")


@functools.cache
def _json(path: str, named_in: str) -> dict:
    try:
        return json.loads((ROOT / path).read_text())
    except OSError as e:
        raise ValueError(f"{named_in}: cannot read the probe file {path} ({e.strerror})") from None


def _yaml(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def _need(desc: dict, key: str, named_in: str):
    if desc.get(key) is None:
        raise ValueError(f"{named_in}: no `{key}`")
    return desc[key]


def _layer_rate(ref: dict, named_in: str) -> tuple[float, Shape]:
    """A layer's model TFLOP/s and shape: a layer probe's variant (`probe`, `variant`), or the
    single-layer ceiling a harness point measured (`result`: its info.ceiling at its spec's shape)."""
    if "result" in ref:
        p = Probe(ref["result"], named_in)
        return p.get("info", "ceiling", "model_tflops"), (
            p.get("spec", "model", "preset"), p.get("spec", "batch_size"), p.get("spec", "seq_len"))
    p = Probe(_need(ref, "probe", named_in), named_in)
    return p.layer(_need(ref, "variant", named_in)), p.layer_shape()


def _saving(ref: dict, named_in: str) -> tuple[float, Shape]:
    """Seconds the compiled variant of a layer probe takes off the eager one, and its shape."""
    p = Probe(_need(ref, "probe", named_in), named_in)
    eager, compiled = (p.layer(_need(ref, k, named_in), "seconds") for k in ("eager", "compiled"))
    return eager - compiled, p.layer_shape()


@dataclass(frozen=True)
class Gpu:
    env: str  # its name in a result's env
    layer: tuple[float, Shape]
    compiled_saving: tuple[float, Shape] | None
    moe_layers: dict[str, dict[str, tuple[float, Shape]]]
    layer_file: str  # the layer rate's probe, named in the machines' sources


@functools.cache
def gpu(name: str) -> Gpu:
    path = FOLDER / "gpus" / f"{name}.yaml"
    named_in = str(path.relative_to(ROOT))
    if not path.is_file():
        raise ValueError(f"no GPU description {named_in}")
    desc = _yaml(path)
    layer = _need(desc, "layer", named_in)
    saving = desc.get("compiled_saving")
    moe = {family: {variant: _layer_rate(ref, named_in) for variant, ref in variants.items()}
           for family, variants in (desc.get("moe_layers") or {}).items()}
    return Gpu(_need(desc, "env", named_in), _layer_rate(layer, named_in),
               _saving(saving, named_in) if saving else None, moe, layer.get("result") or layer.get("probe"))


def load(path: Path) -> MachineModel:
    """A machine's description with its constants read from the probe files it names."""
    named_in = os.path.relpath(path, ROOT)
    desc = _yaml(path)
    g = gpu(_need(desc, "gpu", named_in))
    (tflops, shape), host, device = g.layer, _need(desc, "host_gib", named_in), _need(desc, "device_gib", named_in)
    adamw, optimizer = None, ""
    if "assumed" in desc:
        a = desc["assumed"]
        rates = [_need(a, k, named_in) for k in ("h2d_gbps", "d2h_gbps", "host_copy_gbps")]
        source, match = _need(a, "source", named_in), None
    else:
        bandwidth = Probe(_need(desc, "bandwidth", named_in), named_in)
        rates = [bandwidth.tier(*row) for row in (H2D, D2H, HOST_COPY)]
        cores = _need(desc, "cores", named_in)
        saving = f", compiled saving {1e3 * g.compiled_saving[0]:.1f} ms" if g.compiled_saving else ""
        moe = f", MoE layers of {', '.join(g.moe_layers)}" if g.moe_layers else ""
        if desc.get("adamw"):
            adamw = Probe(desc["adamw"], named_in).adamw()
            optimizer = f"; AdamW {' / '.join(f'{v:.2f}' for v in adamw.values())} G params/s {' / '.join(adamw)} ({desc['adamw']})"
        source = (f"{_need(desc, 'lent', named_in)} ({_need(desc, 'gpus', named_in)} x {g.env}, {cores} cores): "
                  f"pinned {rates[0]:.1f}/{rates[1]:.1f} GB/s, host copy {rates[2]:.1f} GB/s ({bandwidth.path})"
                  f"{optimizer}; "
                  f"the layer {tflops:.1f} model TFLOP/s at {shape[0]} {shape[1]} x {shape[2]} ({g.layer_file})"
                  f"{saving}{moe} (machines/gpus/{desc['gpu']}.yaml)")
        match = (g.env, cores)
    return MachineModel(path.stem, device, host, *rates, tflops, shape, source, match, g.moe_layers, g.compiled_saving,
                        adamw)


# the probed machines first, then the assumed ones
MACHINES = {m.name: m for m in sorted(map(load, FOLDER.glob("*.yaml")), key=lambda m: (m.match is None, m.name))}

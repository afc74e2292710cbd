"""A model of a MegaTrain step: host bytes, device bytes and step time from the shape, the batch
and the machine, fitted on no measured step.

Memory is the engine's own admission plan (megatrain.memory.plan) with the `auto` settings
resolved for the machine's device (megatrain.resolve). Time takes four resources:

  GPU        the FLOPs the step executes (Schedule.hardware_flops) at the machine's layer rate: one
             decoder layer's forward, recompute and backward alone on the device (the single-layer
             probe, Engine.layer_ceiling), as hardware FLOP/s, with the eager kernels; with the
             compiled norms and MLP product, less the time they save: elementwise work, so a
             token's and a hidden unit's, measured by a pair of probes (MachineModel.compiled_saving)
  H2D, D2H   the weights each load moves (a whole master as it is, a split one's bf16 shadow) and
             the float32 gradients each host tile returns,
             plus offloaded checkpoints, at the probe's pinned link bandwidth
  CPU        AdamW over the host tiles: by the host kernel, at its rate over the layout on the
             machine's AdamW probe where it has one; else OPTIMIZER_BYTES per parameter at the
             host's memcpy rate (split masters: SPLIT_RATE of it); torch's ops likewise

and the step is the engine's overlap of the GPU's and the CPU's work, simulated tile by tile
(`_pipelined`: a host tile's update starts once its gradient has returned and must end before the
next forward loads it), or the link's time where that is longer. The bound named is the largest of
the four resources' times.

Each machine's constants come from probes (link, memcpy, one layer), never from the steps the
model is checked against: a machine is described once in machines/<name>.yaml, its GPU's layer
probes in machines/gpus/<gpu>.yaml, and suite/machines.py reads the figures from the committed probe
files they name when it loads. Data-parallel ranks of one host are timed as one rank: its rows, its
part of each host tile's gradient across the link, its part of the update on its share of the cores
(one GPU's time); their gradient reduction among the GPUs is left out. `check` compares the model
with every measured point, `python -m suite project` prints both. A machine
of the paper's has assumed link and host-copy rates, named as such in its description.
"""
from __future__ import annotations

import functools
import itertools
import json
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

from megatrain import kept_attention, memory
from megatrain.config import load_config
from megatrain.distributed import Ranks
from megatrain.kernels import EXPERTS, LOSS, MLP, NORM
from megatrain.metrics import model_flops, recompute_flops
from megatrain.resolve import Machine, resolve
from megatrain.schedule import Schedule, layers_keeping_attention
from megatrain.shapes import ModelShape
from megatrain.store import PAGE, Layout, pinned_bytes
from megatrain.units import GiB
from suite.machines import MACHINES, MachineModel
from suite.spec import RunSpec

# AdamW per parameter on the host: read the gradient, master and both moments (4 B each), write the
# master and the moments; before whole masters streamed as they are, a whole master's bf16 shadow too
OPTIMIZER_BYTES = 4 * 4 + 3 * 4
SHADOW_BYTES = 2
# split masters (engine.split_masters): the update's rate over a whole master's, by the host
# kernel that ran it (experiments/probes/adamw_rate.py): the one C++ pass of both layouts, 4.051 over
# 4.143 G params/s on the one-GPU H200 host's 16 threads at a 7B layer's tile
# (results/h200/probes/adamw_split16/tile_7b_merged.json);
# torch's ops, the only path of split tiles before it, 0.41 of the whole masters' (then with their
# shadow) on the 2-core CPU machine (0.55 on that H200 host, 0.26 on the four-GPU host's 64 cores):
# for a machine without a host AdamW probe of its own (`adamw:` in its description), whose rates
# then time the host kernel (_update_s_per_param)
SPLIT_RATE = {"compiled": 0.98, "eager": 0.41}
# the layer kernels of the probes that measured each machine's layer rate (layer_tflops), the loss
# eager and the library's experts, as every point ran before engine.loss_kernel and
# engine.experts_kernel defaulted to compiled and lean on a GPU
EAGER = {**{k.setting: k.library for k in (NORM, MLP, LOSS, EXPERTS)}, "keep_attention_layers": 0}
# points measured while inductor's pool of compile workers ran beside the engine (the compiled layer
# kernels before megatrain/kernel_build.py built them in-process; GPT-OSS's flex attention before
# kernel_build.in_process): the workers, one per core of the H100 and the H200
# hosts, held about 0.4 GiB each of the host peak the harness counts
POOLED = {"layer_kernels/7b_16seq_kernels_compiled.json": 16, "kernel_build/7b_16seq_pool.json": 16,
          **{f"moe_120b/120b_L2_a8{s}.json": 16 for s in ("", "_layers", "_kinds")},
          **{f"moe_depth/gpt-oss-20b_L6_{s}.json": 16 for s in ("lean", "library")},
          **{f"compile_pool/oss20b_{s}_pool.json": 16 for s in ("L6", "L2_cold")}}
COMPILE_WORKER = 0.4 * GiB


def experts_variant(s) -> str:
    """A run's experts as the MoE layer probe names its variants: the library's, the lean ones, the
    lean ones with their gate compiled (engine.experts_kernel, engine.mlp_kernel)."""
    return "lean_gate" if EXPERTS.runs(s) and MLP.runs(s) else "lean" if EXPERTS.runs(s) else "library"

@dataclass(frozen=True)
class Projection:
    host_bytes: int
    device_bytes: int
    step_s: float
    model_tflops: float
    terms: dict[str, float]  # seconds of each resource, and what bounds the step
    bound: str
    rounded_shadows: int  # what the store took more while torch's pinned allocator held its shadows


def _rounded_shadows(shape: ModelShape, s) -> int:
    """Bytes torch's pinned allocator added to the store's host tiles' shadows, each rounded up to
    a power of two, before the store registered them at their exact size (store.Blocks): how the
    points measured until then were allocated (a 14B layer's 550 MB shadow took 1 GiB)."""
    total = 0
    for k, (_, specs) in enumerate(shape.units()):
        if k >= s.device_tiles:
            seg = -(-Layout.of(specs).numel * s.compute.itemsize // PAGE) * PAGE
            total += pinned_bytes(seg, True) - seg
    return total


def _engine_inputs(spec: RunSpec, ran: dict):
    tree = {"model": spec.model, "engine": {"device": "cpu", **spec.options.get("engine", {}), **ran},
            "optim": {"lr": spec.lr, "max_grad_norm": spec.options.get("max_grad_norm")},
            "data": {"source": "synthetic", "seq_len": spec.seq_len, "batch_size": spec.batch_size,
                     "grad_accum": spec.grad_accum},
            "steps": spec.total_steps}
    cfg = load_config(None, [], base=tree)
    return cfg, ModelShape(spec.hf_config(cuda=True))  # the attention a GPU run picks (GPT-OSS: flex, not eager)


@functools.cache
def _layer_hw_rate(tflops: float, probe: tuple[str, int, int]) -> float:
    """A layer probe's rate as hardware FLOP/s: its layer's model FLOPs plus the recompute less the
    unread MLP output (a block's last layer at K = 1), over the same time."""
    preset, batch, seq = probe
    shape = ModelShape(RunSpec(system="megatrain", model={"preset": preset}).hf_config(cuda=True))
    lens, one = [seq] * batch, shape.attention(range(1))
    model = model_flops(shape.layer_matmul_params(), one, lens)
    unread = shape.mlp_matmul_params() // 3 if shape.gated_mlp else 0
    hw = model + recompute_flops(shape.layer_matmul_params(), one, lens) - 2 * seq * batch * unread
    return tflops * 1e12 * _causal(hw, shape, 1, range(1), lens) / model


def _compiled_saving(m: MachineModel, s, shape: ModelShape, sched: Schedule, lens: list[int]) -> float:
    """Seconds the compiled norms and MLP product take off a dense step's layers: the machine's
    probed saving a token and hidden unit (elementwise work; the H200's pair of probes: 0.95x at 0.7
    of the width, the same a token at 8 times the length). The probe runs a forward, a recompute and
    a backward, the backward's elementwise work taken as twice a forward's: a layer's forward saves a
    quarter of it, its backward half, a recomputed layer's second forward another quarter."""
    if m.compiled_saving is None or not (NORM.runs(s) and MLP.runs(s)):
        return 0.0
    passes = (3 * shape.num_layers + sched.recomputed_layers) / 4  # probe layers' worth
    return _saving_per_unit(*m.compiled_saving) * sum(lens) * shape.hidden * passes


@functools.cache
def _saving_per_unit(seconds: float, probe: tuple[str, int, int]) -> float:
    """A pair of layer probes' saving as seconds a token and hidden unit."""
    preset, batch, seq = probe
    shape = ModelShape(RunSpec(system="megatrain", model={"preset": preset}).hf_config(cuda=True))
    return seconds / (batch * seq * shape.hidden)


def _causal(hw: float, shape: ModelShape, layers: int, recomputed: Iterable[int], lens: list[int]) -> float:
    """FLOPs the kernels execute: the shared formula counts a full-attention layer's whole square
    (12 w n^2 per sequence, 4 w n^2 more when its attention is recomputed); causal attention computes
    half of it."""
    def square(indices: Iterable[int]) -> float:
        return sum(w for w, window in shape.attention(indices) if window is None) * sum(n * n for n in lens)
    return hw - 0.5 * (12 * square(range(layers)) + 4 * square(recomputed))


def _transfers(plan: list, buffers: int) -> list:
    """The units a step's loads move over the link, as the streamer issues them (buffers.py): a unit
    used by consecutive ops is loaded once, into slot k mod `buffers`, and not again while that slot
    still holds it (a block's backward right after its recompute)."""
    slots: list = [None] * buffers
    moved = []
    for k, (unit, _) in enumerate(itertools.groupby(plan)):
        if slots[k % buffers] != unit:
            moved.append(unit)
            slots[k % buffers] = unit
    return moved


def _units(L: int, on_device: set, recomputed: int, layer_s: float, head_s: float, params: dict[str, int],
           rate: float, load_s_per_param: float, return_s_per_param: float,
           clipping: bool) -> tuple[list, list, list, list, list, bool]:
    """A step's units in the order the forward reads them (the embedding where it is a host tile, the
    layers, the head): each one's forward and backward seconds on the device (a layer's forward a
    quarter of its time where it is recomputed, a third where not; the head's a third), its host
    update's seconds (None: a device tile, updated on the device), its weights' load and its
    gradient's return (this rank's part)."""
    fwd, bwd, update, load, back = [], [], [], [], []
    if params["embed"]:
        fwd.append(0.0), bwd.append(0.0), load.append(0.0)
        update.append(params["embed"] * rate), back.append(params["embed"] * return_s_per_param)
    for i in range(L):
        share = 1 / 4 if i < recomputed else 1 / 3
        host = i not in on_device
        fwd.append(layer_s * share), bwd.append(layer_s * (1 - share))
        update.append(params["layer"] * rate if host else None)
        load.append(params["layer"] * load_s_per_param if host else 0.0)
        back.append(params["layer"] * return_s_per_param if host else 0.0)
    host = "head" not in on_device
    fwd.append(head_s / 3), bwd.append(head_s * 2 / 3)
    update.append(params["head"] * rate if host else None)
    load.append(params["head"] * load_s_per_param if host else 0.0)
    back.append(params["head"] * return_s_per_param if host else 0.0)
    return fwd, bwd, update, load, back, clipping


def _pipelined(fwd: list[float], bwd: list[float], update: list[float | None], load: list[float],
               back: list[float], clipping: bool, steps: int = 8) -> float:
    """The steady step of the engine's overlap (host_executor.py), simulated: the device runs the
    forward in order, each host unit once its last update is done and its weights loaded, then the
    backward in reverse; a host unit's gradient lands once returned over the link after its
    backward (the returns one after another; with clipping, every one at the last return's end), and
    the CPU's one worker runs, of the landed updates, the one the next forward reads first
    (switching to an earlier unit's as it lands). The step: the last steps' start times apart."""
    n = len(fwd)
    ready = [0.0] * n  # when each unit's weights are updated
    t = cpu = link = 0.0
    starts = []
    for _ in range(steps):
        starts.append(t)
        for i in range(n):
            t = max(t, ready[i] + load[i]) + fwd[i]
        landed = {}
        for i in reversed(range(n)):
            t += bwd[i]
            if update[i] is None:
                ready[i] = t
            else:
                link = landed[i] = max(t, link) + back[i]
        if clipping:
            landed = dict.fromkeys(landed, link)
        left = {i: update[i] for i in landed}
        while left:
            cpu = max(cpu, min(landed[i] for i in left))
            i = min(j for j in left if landed[j] <= cpu)  # the landed one the next forward reads first
            later = [landed[j] for j in left if j < i and landed[j] > cpu]  # an earlier unit landing meanwhile
            run = min([left[i], *(x - cpu for x in later)])
            cpu += run
            left[i] -= run
            if left[i] <= 1e-12:
                del left[i]
                ready[i] = cpu
    return starts[-1] - starts[-2]


def project(spec: RunSpec, m: MachineModel, ran: dict = EAGER, shadows: bool = False,
            experts_read: bool = False) -> Projection:
    """`ran`: engine settings as a measured run used them where their defaults have changed since
    (the layer kernels, the gradient slabs), and how many of its kept attention layers its plan put
    in host memory (offloaded_attention_layers); by default those of the points made before the
    compiled kernels were a GPU's default; {}: the engine's defaults. `shadows`: the run held whole
    float32 masters beside a bf16 shadow, as the store did before they streamed as they are (a
    result without `info.whole_masters`): 2 bytes more a parameter on the host, a load moved the
    shadow, and nothing was staged on the device. `experts_read`: the run's recompute computed the
    lean experts' down projection where nothing read it, as before lean_experts._DownCombine (a
    result without `info.unread_experts`)."""
    offloaded = ran.get("offloaded_attention_layers")
    cfg, shape = _engine_inputs(spec, {k: v for k, v in ran.items() if k != "offloaded_attention_layers"})
    device_gib = cfg.engine.device_memory_gb or m.device_gib  # a run's stated bound, as its plan took it
    R = spec.gpus  # data-parallel ranks, all on this host: the times are one rank's
    machine = Machine(True, int(device_gib * GiB), int(m.host_gib * GiB), gpus=R)
    s = resolve(cfg.engine, cfg.data, cfg.optim, shape, machine, Ranks(world=R, local_world=R))
    s = replace(s, device="cuda", **({} if offloaded is None else {"offloaded_attention_layers": offloaded}))
    p = memory.plan(shape, s)
    L, M = shape.num_layers, s.microbatches
    keep = layers_keeping_attention(shape, s.seq_len, s.no_recompute_layers, s.keep_attention_layers)
    sched = Schedule(L, s.checkpoint_every, s.no_recompute_layers, M, keep)
    flops = model_flops(shape.matmul_params(), shape.attention(), [spec.seq_len] * spec.batch_size * M)
    lens = [spec.seq_len] * (spec.batch_size // R) * M  # one rank's rows
    hw = sched.hardware_flops(shape, s.mlp_chunk_tokens, lens, lens,  # synthetic rows: no mask
                              EXPERTS.runs(s) and MLP.runs(s) and not experts_read)
    layer = Layout.of(shape.layer_specs).numel
    head = Layout.of(shape.head_specs).numel + (shape.vocab * shape.hidden if shape.tied else 0)
    embed = 0 if shape.tied else shape.vocab * shape.hidden
    on_device = set(range(s.device_tiles - 1))  # layer indices whose tiles live on the device
    if shape.tied and s.device_tiles:
        on_device.add("head")  # the tied embedding is the head's weight
        head -= shape.vocab * shape.hidden
    # a load moves a whole master as it is (cast on the device), a split one's (or an old run's) bf16 shadow
    whole = not s.split_masters and s.master != s.compute
    streamed = s.master.itemsize if whole and not shadows else s.compute.itemsize
    h2d = sum(layer if isinstance(u, int) else head for u in _transfers(sched.loads, s.weight_buffers)
              if u not in on_device) * streamed
    if s.device_tiles == 0:
        h2d += M * s.tokens * shape.hidden * 2  # the embedding's rows, gathered on the host
    host_layers = L - len(on_device - {"head"})
    # each rank returns its part of every host tile's summed gradient (distributed.Comm.reduce_part)
    d2h = (host_layers * layer + head + (embed if s.device_tiles == 0 else 0)) * 4 / R
    if s.offload_checkpoints:
        ckpt = sched.recomputed_blocks * M * s.tokens * shape.hidden * 2
        h2d, d2h = h2d + ckpt, d2h + ckpt
    offloaded = s.offloaded_attention_layers * M * kept_attention.kept_bytes(shape, s.tokens, 2)
    h2d, d2h = h2d + offloaded, d2h + offloaded
    host_params = host_layers * layer + head + (embed if s.device_tiles == 0 else 0)
    rate = _update_s_per_param(m, s, whole and shadows)
    again = [i for i in range(sched.recomputed_layers) if i not in keep]  # attention recomputed
    executed, dense = _causal(hw, shape, L, again, lens), _layer_hw_rate(m.layer_tflops, m.probe)
    moe = m.moe_layers.get(shape.family, {}).get(experts_variant(s))
    head_flops = 6 * shape.vocab * shape.hidden * sum(lens)  # the LM head's forward and backward, 6 v h a token
    if moe is None:
        gpu = executed / dense - _compiled_saving(m, s, shape, sched, lens)
    else:  # the layers at their MoE probe's rate, the LM head at the dense layer's
        gpu = head_flops / dense + (executed - head_flops) / _layer_hw_rate(*moe)
    # each rank updates its part of the host tiles with its share of the cores: one GPU's time
    terms = {"gpu": gpu, "h2d": h2d / (m.h2d_gbps * 1e9), "d2h": d2h / (m.d2h_gbps * 1e9),
             "cpu_optimizer": host_params * rate}
    if s.grad_slabs == 0:  # the ablation: compute waits for each layer's gradient copy and update
        bound, step = "serial", gpu + terms["d2h"] + terms["cpu_optimizer"]
        tail = 0.0
    else:
        bound = max(terms, key=terms.get)
        lm_head = head_flops / dense
        units = _units(L, on_device, sched.recomputed_layers, (gpu - lm_head) / L, lm_head,
                       {"embed": embed if s.device_tiles == 0 else 0, "layer": layer, "head": head}, rate,
                       streamed / (m.h2d_gbps * 1e9), 4 / R / (m.d2h_gbps * 1e9), s.clipping)
        piped = _pipelined(*units)
        step = max(piped, terms["h2d"], terms["d2h"])
        tail = max(0.0, piped - max(gpu, terms["cpu_optimizer"]))  # the update's time the overlap leaves exposed
    host_bytes, device_bytes = p.host_bytes, p.device_bytes
    if whole and shadows:
        host_bytes += sum(-(-Layout.of(specs).numel * s.compute.itemsize // PAGE) * PAGE
                          for k, (_, specs) in enumerate(shape.units()) if k >= s.device_tiles)
        device_bytes -= p.detail["device.load_staging"]
    return Projection(host_bytes, device_bytes, step, flops / step / 1e12,
                      {**terms, "tail": tail, "h2d_bytes": h2d, "d2h_bytes": d2h}, bound,
                      _rounded_shadows(shape, s))


def machine_of(env: dict) -> MachineModel | None:
    """The probed machine a result ran on, by its GPU and host cores."""
    return next((m for m in MACHINES.values() if m.match == (env.get("gpu"), env.get("cpu_cores"))), None)


def measured_points(roots: list[Path]) -> list[tuple[Path, dict]]:
    """(file, result) of every MegaTrain point that ran (`ok`) among the result files and under the
    result folders."""
    out = []
    for root in roots:
        for f in [root] if root.is_file() else sorted(root.rglob("*.json")):
            if "runs" in f.relative_to(root).parts[:-1]:
                continue  # a user's run of the main job, committed as its evidence: not this folder's machine
            try:
                r = json.loads(f.read_text())
            except (OSError, ValueError):
                continue
            if isinstance(r, dict) and r.get("system") == "megatrain" and r.get("status") == "ok" and r.get("median"):
                out.append((f, r))
    return out


def check(roots: list[Path]) -> list[dict]:
    """The model against every measured point (result files, or folders searched): predicted,
    measured and relative error of each quantity."""
    rows = []
    for f, r in measured_points(roots):
        m = machine_of(r.get("env") or {})
        spec = r.get("spec")
        if m is None or not isinstance(spec, dict) or spec.get("data") or "preset" not in (spec.get("model") or {}):
            continue  # a run on an unprobed machine, on a file's data (lengths vary) or a local checkpoint
        engine = (r.get("info") or {}).get("engine") or {}
        ran = {k: engine.get(k, v) for k, v in EAGER.items()}  # EAGER's before the setting existed
        ran["grad_slabs"] = engine.get("grad_slabs", 4)  # 4 before auto
        ran["device_tiles"] = engine.get("device_tiles", 0)  # 0 before auto
        # the C++ pass (its note names the library it loaded) updates split tiles; before it, torch's ops did
        ran["optimizer_kernel"] = "compiled" if "host_adamw" in (r.get("info") or {}).get("optimizer_kernel_note", "") \
            else "eager"
        # what the plan chose for `auto` when the point ran (the plan has tightened since, e.g. the
        # compiled loss's head chunk): the projection times that run, not today's choice
        ran |= {k: engine[k] for k in ("device_tiles", "no_recompute_layers", "mlp_chunk_tokens",
                                      "offloaded_attention_layers") if k in engine}
        run_spec = RunSpec.from_dict(spec)
        shadows = (r.get("info") or {}).get("whole_masters") != "streamed"  # the store before whole masters streamed
        experts_read = not (r.get("info") or {}).get("unread_experts")  # before the recompute left them out
        if "split_masters" in engine:
            ran["split_masters"] = engine["split_masters"]
        elif "split_masters" not in run_spec.options.get("engine", {}):  # recorded since auto split with the
            ran["split_masters"] = False                                  # compiled update; before, only to fit
            if project(run_spec, m, ran, shadows, experts_read).host_bytes > m.host_gib * GiB:
                ran["split_masters"] = True
        pr = project(run_spec, m, ran, shadows, experts_read)
        med, peak = r["median"], r.get("peak") or {}
        # the allocator the point ran with: shadows at their exact size, or (a result without
        # `pinned_shadows`) torch's power-of-two pinned blocks
        exact = (r.get("info") or {}).get("pinned_shadows") == "exact"
        host = pr.host_bytes + (0 if exact else pr.rounded_shadows) + POOLED.get(f"{f.parent.name}/{f.name}", 0) * COMPILE_WORKER
        # the run it is, whatever the repeat: near-duplicate points (A/B pairs of one setting) count once in the bands
        run = {k: v for k, v in spec.items() if k not in RUN_FREE}
        run["options"] = {k: v for k, v in (spec.get("options") or {}).items() if k != "trace"}
        row = {"machine": m.name, "point": str(f), "bound": pr.bound, "ranks": spec.get("gpus", 1),
               "run": json.dumps([m.name, run, ran], sort_keys=True)}
        for key, predicted, measured in (
                ("host_GiB", host / GiB, (peak.get("host_rss_bytes") or 0) / GiB),
                ("device_GiB", pr.device_bytes / GiB, (med.get("peak_device_allocated_bytes") or 0) / GiB),
                ("step_s", pr.step_s, med.get("step_time_s") or 0),
                ("h2d_GB", pr.terms["h2d_bytes"] / 1e9, (med.get("bytes_h2d") or 0) / 1e9),
                ("d2h_GB", pr.terms["d2h_bytes"] / 1e9, (med.get("bytes_d2h") or 0) / 1e9)):
            row[key] = {"projected": predicted, "measured": measured,
                        "error": (predicted - measured) / measured if measured else None}
        rows.append(row)
    return rows


# a result's spec fields that say how long or where it was measured, not what ran
RUN_FREE = ("steps", "warmup", "max_steps", "steady_spread", "timeout_s", "seed", "smoke")


def _quantile(sorted_values: list[float], q: float) -> float:
    """The q-quantile, linear between order statistics."""
    x = q * (len(sorted_values) - 1)
    lo = int(x)
    return sorted_values[lo] + (x - lo) * (sorted_values[min(lo + 1, len(sorted_values) - 1)] - sorted_values[lo])


def step_errors(rows: list[dict]) -> dict[str, list[float]]:
    """The step time's relative errors of the distinct runs among `check`'s rows (a run measured
    several times counts once, by its median error), sorted, by what bounds the step, by machine
    (`machine:NAME`), the data-parallel ones (`ranks>1`) and over all (`all`)."""
    runs: dict[str, list[dict]] = {}
    for r in rows:
        if r["step_s"]["error"] is not None:
            runs.setdefault(r["run"], []).append(r)
    out: dict[str, list[float]] = {}
    for same in runs.values():
        errors = sorted(r["step_s"]["error"] for r in same)
        error = _quantile(errors, 0.5)
        for key in ("all", same[0]["bound"], f"machine:{same[0]['machine']}", *(("ranks>1",) if same[0]["ranks"] > 1 else ())):
            out.setdefault(key, []).append(error)
    return {k: sorted(v) for k, v in out.items()}


BAND = (0.1, 0.9)  # the central 80% of the errors


def band(errors: dict[str, list[float]], bound: str, ranks: int = 1) -> tuple[float, float, str]:
    """The step time's error band of a projection bound by `bound`: the central 80% of the errors of
    the distinct runs with that bound (of several ranks: the data-parallel runs'), or of all runs
    where fewer than five are (said in the third item)."""
    key = next(k for k in ("ranks>1" if ranks > 1 else bound, "all") if len(errors.get(k, [])) >= 5 or k == "all")
    values = errors[key]
    return _quantile(values, BAND[0]), _quantile(values, BAND[1]), f"{key}, {len(values)} runs"


# The paper's scale rows (Figure 1: 4096 x 8 x 4 micro-batches), projected on its machines; its
# printed figure beside each where it prints one (GH200: 284, 264, "above 250").
PAPER_ROWS = (("gh200-paper", "qwen2.5-7b", "284"), ("gh200-paper", "qwen2.5-14b", "264"),
              ("gh200-paper", "qwen2.5-32b", "above 250"), ("h200-paper", "qwen2.5-32b", None),
              ("h200-paper", "qwen2.5-72b", None), ("h200-paper", "gpt-oss-120b", None))


def predictions(errors: dict[str, list[float]] | None = None) -> list[dict]:
    """The paper's rows on its machines, each with the band the measured runs' errors give it
    (`errors`: step_errors of the check; measured = projected / (1 + error))."""
    rows = []
    for projected in _paper_rows():
        row = dict(projected)
        if errors:
            lo, hi, basis = band(errors, row["bound"])
            step_s, tflops = row["step_s"], row["model_tflops"]
            row |= {"step_s_band": (step_s / (1 + hi), step_s / (1 + lo)),
                    "model_tflops_band": (tflops * (1 + lo), tflops * (1 + hi)), "band_basis": basis}
        rows.append(row)
    return rows


# Projected once per process: each scale table prints them, and each projection resolves and
# plans a paper-sized model (seconds).
@functools.cache
def _paper_rows() -> tuple[dict, ...]:
    rows = []
    for machine, preset, paper in PAPER_ROWS:
        spec = RunSpec(system="megatrain", model={"preset": preset}, seq_len=4096, batch_size=8, grad_accum=4)
        m = MACHINES[machine]
        pr = project(spec, m, ran={})  # the engine's defaults on a GPU: the compiled kernels, the lean experts
        short = [f"{what} {need / GiB:.0f} > {have:.0f} GiB" for what, need, have in
                 (("host", pr.host_bytes, m.host_gib), ("device", pr.device_bytes, m.device_gib)) if need > have * GiB]
        row = {"machine": machine, "preset": preset, "fits": "; ".join(short) or "yes", "host_GiB": pr.host_bytes / GiB,
               "device_GiB": pr.device_bytes / GiB, "step_s": pr.step_s, "model_tflops": pr.model_tflops,
               "bound": pr.bound, "paper_tflops": paper}
        rows.append(row)
    return tuple(rows)


def _update_s_per_param(m: MachineModel, s, shadow: bool) -> float:
    """The host's AdamW, seconds a parameter: the machine's probed rate of the host kernel over the
    run's master layout (`shadow`: a whole master that wrote its bf16 shadow too; where the probe
    timed only one of the two whole layouts, the other at its bandwidth), or its host copy's."""
    moved = {"whole": OPTIMIZER_BYTES, "shadow": OPTIMIZER_BYTES + SHADOW_BYTES}
    key = "shadow" if shadow else "whole"
    gps = m.adamw_gps
    if gps and s.optimizer_kernel == "compiled":
        if s.split_masters:
            return 1 / (gps["split"] * 1e9)
        other = "whole" if shadow else "shadow"
        return 1 / (gps[key] * 1e9) if key in gps else moved[key] / (gps[other] * 1e9 * moved[other])
    return moved[key] / (m.host_copy_gbps * 1e9) / (SPLIT_RATE[s.optimizer_kernel] if s.split_masters else 1.0)


def _pct(x: float | None) -> str:
    return "" if x is None else f"{100 * x:+.1f}%"


def write_report(roots: list[Path], out: Path) -> str:
    """The check against every measured point and the paper rows' predictions, as JSON and Markdown."""
    from megatrain.io import write_json, write_text
    rows = check(roots)
    errors = step_errors(rows)
    preds = predictions(errors)
    keys = ("host_GiB", "device_GiB", "step_s", "h2d_GB", "d2h_GB")
    lines = ["# The step model against every measured MegaTrain point", "",
             "Projected / measured, and the projection's error. Machines: " + "; ".join(
                 f"`{m.name}`: {m.source}" for m in MACHINES.values()), "",
             "| machine | point | bound | " + " | ".join(keys) + " |", "|---" * (3 + len(keys)) + "|"]
    for r in rows:
        cells = [f"{r[k]['projected']:.1f} / {r[k]['measured']:.1f} ({_pct(r[k]['error'])})" for k in keys]
        lines.append(f"| {r['machine']} | {r['point']} | {r['bound']} | " + " | ".join(cells) + " |")
    lines += ["", "Error over the points (median, smallest, largest):", ""]
    for k in keys:
        errs = sorted(r[k]["error"] for r in rows if r[k]["error"] is not None)
        if errs:
            lines.append(f"- {k}: {_pct(errs[len(errs) // 2])}, {_pct(errs[0])}, {_pct(errs[-1])} ({len(errs)} points)")
    lines += ["", "The step time's error over distinct runs (a setting measured several times counts once, by its "
              "median error): nothing in the model is fitted to a step, so every run is one it was not fitted on; "
              "by what bounds the projected step, and by machine (each machine's constants are its own probes'):", "",
              "| runs of | count | median | 10% | 90% | smallest | largest |", "|---" * 7 + "|"]
    for key, values in sorted(errors.items(), key=lambda kv: (kv[0] != "all", kv[0].startswith("machine:"), kv[0])):
        lines.append(f"| {key} | {len(values)} | {_pct(_quantile(values, 0.5))} | {_pct(_quantile(values, BAND[0]))} "
                     f"| {_pct(_quantile(values, BAND[1]))} | {_pct(values[0])} | {_pct(values[-1])} |")
    lines += ["", "# Predictions (not measurements): the paper's scale rows on its machines", "",
              "Each with the band that the central 80% of the measured runs' step errors gives it (the runs bound by "
              "the same resource where five or more are, else all): the measured machines' error, carried to "
              "machines whose constants are assumed.", "",
              "| machine | model | fits | host GiB | device GiB | step s (band) | model TFLOP/s (band) | bound | band of | paper |",
              "|---" * 10 + "|"]
    for p in preds:
        step, rate = (f"({p['step_s_band'][0]:.1f}-{p['step_s_band'][1]:.1f})",
                      f"({p['model_tflops_band'][0]:.0f}-{p['model_tflops_band'][1]:.0f})") if "band_basis" in p else ("", "")
        lines.append(f"| {p['machine']} | {p['preset']} | {p['fits']} | {p['host_GiB']:.0f} | {p['device_GiB']:.0f} "
                     f"| {p['step_s']:.1f} {step} | {p['model_tflops']:.0f} {rate} "
                     f"| {p['bound']} | {p.get('band_basis', 'no measured runs')} | {p['paper_tflops'] or 'not printed'} |")
    text = "\n".join(lines) + "\n"
    write_json(out / "projection.json", {"machines": {m.name: m.__dict__ for m in MACHINES.values()},
                                         "check": rows, "step_errors": errors, "predictions": preds})
    write_text(out / "projection.md", text)
    return text

"""One point, inside its own process: build the system, time its steps, write the result.

    python -m suite.worker SPEC.json RESULT.json

The result file is rewritten (atomically) after every step, so a point killed by its timeout or
by the host's OOM killer still leaves the steps it measured. Beside the steps it records where the
rest of the point's wall time went: `start_s` (the process's start, imports included; of it
`imported_s`, the interpreter's start and this module's imports, and `env_s`, the probe of the
machine and the code the result names; a worker forked from the runner's imports, `forked`, starts
at the fork), `setup_s` (the system's build)
and `close_s` (its teardown). The parent (suite.runner) adds the process tree's host-memory and
NVML peaks and the final status.
"""
from __future__ import annotations

import faulthandler
import json
import math
import os
import signal
import statistics
import sys
import time
import traceback

import torch

from megatrain.shapes import ModelShape
from megatrain.io import write_json
from megatrain.data import make_source
from megatrain.distributed import Ranks, check as check_ranks
from megatrain.metrics import environment, link_gbps, matmul_tflops, model_flops
from suite import timing
from suite.spec import RunSpec
from megatrain.memory import DoesNotFit
from suite.system import Unsupported, load


def _median(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if isinstance(r.get(key), (int, float)) and not isinstance(r[key], bool)]
    return statistics.median(values) if values else None


def medians(rows: list[dict]) -> dict:
    """Medians of every numeric per-step metric (one level of nesting, e.g. megatrain's `exposed`)."""
    out = {}
    for key in rows[0] if rows else ():
        if key == "step":
            continue
        if isinstance(rows[0][key], dict):
            out[key] = {k: _median([r[key] for r in rows], k) for k in rows[0][key]}
        elif (m := _median(rows, key)) is not None:
            out[key] = m
    return out


def layer_ratios(result: dict, spec: RunSpec) -> dict[str, float]:
    """Each decoder layer's rate in the step over its ceiling's: its ceiling's seconds (one layer's
    forward, recompute and backward of one micro-batch, alone on the device; the layer's own kind's
    where the ceiling has `seconds_by_layer`) times the micro-batches, over the median step's spans of
    that layer (the timeline's `layer_s.L<i>`); none where the system keeps no timeline."""
    ceiling = result["info"]["ceiling"]
    own = ceiling.get("seconds_by_layer", {})
    spans = (result["median"].get("exposed") or {}).items()
    return {layer: spec.grad_accum * own.get(layer, ceiling["seconds"]) / s
            for layer, s in ((key.removeprefix("layer_s."), s) for key, s in spans if key.startswith("layer_s.") and s)}


def run(spec: RunSpec, out: str | None, imported_s: float | None = None, forked: bool = False) -> dict:
    """Under torchrun (spec.gpus > 1) every rank runs this, on the GPU of its LOCAL_RANK, given the
    same global micro-batches; the first rank alone writes the result."""
    ranks = Ranks.from_env()
    if ranks.world != spec.gpus:
        raise ValueError(f"gpus {spec.gpus}, but {ranks.world} rank(s) started: launch the point through suite.runner")
    # more ranks than GPUs, a global batch that does not split: refused alike on every rank, by name
    check_ranks(ranks, spec.batch_size, "cuda" if torch.cuda.is_available() else "cpu", torch.cuda.device_count())
    local = int(os.environ.get("LOCAL_RANK", torch.cuda.current_device() if torch.cuda.is_available() else 0))
    device = torch.device("cuda", local) if torch.cuda.is_available() else torch.device("cpu")
    shape = ModelShape(spec.hf_config())
    flops = spec.model_flops_per_step()
    clock = time.perf_counter()
    env = environment(device)  # the GPU's first touch, NVML, git: part of start_s, timed apart as env_s
    env["matmul_tflops"] = matmul_tflops(device)  # the yardsticks of comparisons across machines
    env.update(link_gbps(device) or {})
    result = {"system": spec.system, "spec": spec.to_dict(), "status": "running", "env": env,
              "params": shape.total_params(), "model_flops_per_step": flops, "steps": [],
              "start_s": since_start(), "imported_s": imported_s, "forked": forked,
              "env_s": time.perf_counter() - clock}
    _write(out, result)
    system = None
    try:
        start = time.perf_counter()
        print(f"{spec.system}: setting up {shape.total_params():,} parameters on {device} "
              f"(model, state, the system's own builds)", file=sys.stderr, flush=True)
        system = load(spec.system)(spec, device)
        result["setup_s"] = time.perf_counter() - start  # building the model and its state
        result["env"]["cpu_threads"] = torch.get_num_threads()  # this rank's, as the system set them up
        print(f"{spec.system}: set up in {result['setup_s']:.0f} s; {spec.total_steps} steps "
              f"({spec.warmup} warm-up)", file=sys.stderr, flush=True)
        if system.model_flops_per_step is not None:  # it runs another model (Ratel's own GPT): count that one
            flops = result["model_flops_per_step"] = system.model_flops_per_step
        _write(out, result)  # a first step past the timeout still leaves the set-up's time and the FLOPs counted
        data = make_source(spec.data_config(), shape.vocab, spec.model_config().pretrained)
        times: list[float] = []  # the measured steps' (after the warm-up)
        index = 0
        while index < spec.warmup or _agreed(timing.wants_more(times, spec, since_start() or time.perf_counter() - clock)):
            microbatches = [data.next() for _ in range(spec.grad_accum)]
            if spec.data is not None:  # padded examples: count the real tokens only
                lengths = [n for mb in microbatches for n in mb.sequence_lengths()]
                flops = model_flops(shape.matmul_params(), shape.attention(), lengths)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            start = time.perf_counter()
            row = system.step(microbatches)
            seconds = time.perf_counter() - start
            if system.own_step_time:  # a system run as one script reports its steps
                seconds = row["step_time_s"]
            loss = None if row["loss"] is None else float(row["loss"])
            tokens = sum(lengths) if spec.data is not None else spec.tokens_per_step
            row = {**row, "step": index + 1, "loss": loss, "step_time_s": seconds,
                   "tokens": tokens, "tokens_per_s": tokens / seconds,
                   "model_tflops": flops / seconds / 1e12,
                   "peak_device_allocated_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None}
            if "hardware_flops" in row:  # recomputation included; on the clock of model_tflops
                row["hardware_tflops"] = row["hardware_flops"] / seconds / 1e12
            result["steps"].append(row)
            if index >= spec.warmup:
                times.append(seconds)
            index += 1
            _write(out, result)
            if loss is not None and not math.isfinite(loss):  # diverged: broken, not slow
                raise FloatingPointError(f"the loss is {loss} at step {index}: the system diverged")
            print(f"{spec.system} step {index} (of {spec.warmup} + {spec.steps}..{spec.measured_steps_limit}): {seconds:.2f} s, "
                  f"{row['model_tflops']:.1f} TFLOP/s, loss {loss}", file=sys.stderr, flush=True)
        summarize(result, spec)
        result["info"] = system.info()
        if spec.save_to:
            system.save(spec.save_to)
            result["saved_to"] = spec.save_to
        if "ceiling" in result["info"]:
            result["ratio_to_ceiling"] = result["median"]["model_tflops"] / result["info"]["ceiling"]["model_tflops"]
            result["layer_ratio_to_ceiling"] = layer_ratios(result, spec)
        result["status"] = "ok"
    except Unsupported as e:
        result.update(status="unsupported", reason=str(e))
    except DoesNotFit as e:
        result.update(status=_OOM_STATUS[e.memory], reason=str(e))
    except torch.cuda.OutOfMemoryError as e:
        result.update(status="oom_device", reason=str(e).splitlines()[0])
    except MemoryError as e:
        result.update(status="oom_host", reason=f"MemoryError: {e}")
    finally:
        if system is not None:
            start = time.perf_counter()
            system.close()
            result["close_s"] = time.perf_counter() - start
    return result


def summarize(result: dict, spec: RunSpec) -> None:
    """The medians of the measured steps' window, and the step time's spread (suite/timing.py)."""
    measured = result["steps"][spec.warmup:]
    if measured:
        result["median"] = medians(timing.window(measured, spec))
        result["timing"] = timing.summary(measured, spec)


def _agreed(more: bool) -> bool:
    """Rank 0's decision, on every rank (ranks that disagreed on the step count would wait on each
    other's collectives for ever)."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return more
    decision = [more]
    dist.broadcast_object_list(decision, src=0)
    return bool(decision[0])


def since_start() -> float | None:
    """Seconds from this process's start to now: the interpreter, the imports, the environment's
    probe. Both ends from /proc on the boot clock, in hundredths (psutil's start time adds the
    boot time, a whole second); None where there is no /proc."""
    try:
        with open("/proc/uptime") as f:
            now = float(f.read().split()[0])
        with open("/proc/self/stat") as f:  # field 22, the start in clock ticks, after the ")" of the name
            start = int(f.read().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
    return now - start


def _write(out: str | None, result: dict) -> None:
    if out is not None:
        write_json(out, result)


_OOM_STATUS = {"host": "oom_host", "disk": "oom_host", "device": "oom_device"}  # swap space is the host's


def main(argv: list[str], forked: bool = False) -> int:
    """`forked`: this process is the runner's child (suite.launch), its imports the runner's, its
    `start_s` from the fork."""
    imported = since_start() if forked else _IMPORTED_S
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the runner asks where a late point is
    spec_path, out = argv
    spec = RunSpec.from_dict(json.loads(open(spec_path).read()))
    if int(os.environ.get("RANK", 0)) != 0:
        out = None  # the first rank writes the result
    try:
        result = run(spec, out, imported, forked)
    except Exception as e:  # a failed point is a result: keep what was measured, say why
        result = json.loads(open(out).read()) if out and os.path.exists(out) else {"system": spec.system,
                                                                                 "spec": spec.to_dict()}
        result.update(status="error", reason=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
    _write(out, result)
    return 0


_IMPORTED_S = since_start()  # the imports above made (torch, transformers, the suite's)

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Probe: the host AdamW's rate, in one process, on one tile of N elements (float32 masters, bf16
shadow, float32 gradient; all of torch's threads unless --threads), for every way the engine has
or had of updating it, beside the memory bandwidth that bounds them:

- one_pass_whole, one_pass_split: the C++ kernel (fused_adamw.py), a whole or a split master
  (`engine.optimizer_kernel: compiled`, the engine's default);
- one_pass_master: the C++ kernel on a whole float32 master with no shadow to write (a float32
  run's tile; what a master streamed as it is, cast on the device, would update);
- eager_whole, eager_split: torch's fused AdamW and the passes around it (`optimizer_kernel: eager`);
- inductor_whole: the one-pass update of a whole master as torch.compile built it before the C++
  kernel replaced it (its function and options, kept here to compare; --no-inductor skips its
  build, tens of seconds on a machine's first run);
- torch_adamw_fused: torch.optim.AdamW(fused=True) on N float32 parameters, no shadow;
- stream_copy, stream_triad: torch's a.copy_(b) and torch.add(b, c, alpha=s, out=a) on N floats,
  all threads; STREAM's byte counts (8 and 12 bytes an element, no write-allocate). torch's ops are
  not a tuned STREAM (no streaming stores), so their bandwidth is a floor of the machine's.

Rounds interleave the paths (the first round is a warm-up, reported apart). Each path's implied
bandwidth is its rate times the bytes it moves per parameter (`bytes_per_param`, counted from its
passes: the one pass 30 whole, 28 split and 28 a master alone; eager whole 34, the shadow's recast a second pass;
eager split about 48, the join and split and their searches for ties around torch's 28).
Prints a line per path; --out writes the JSON (config, environment, samples, medians).

On the GPU host (16 cores, under 3 minutes):
    PYTHONPATH=. python experiments/probes/adamw_rate.py --n 268435456 --out adamw_rate.json
On the 2-core CPU machine: --n 16777216.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import time

import torch

from megatrain import adamw, fused_adamw
from megatrain.config import OptimConfig
from megatrain.shapes import ParamSpec
from megatrain.store import Layout, Tile

BYTES = {"one_pass_whole": 30, "one_pass_split": 28, "one_pass_master": 28, "eager_whole": 34, "eager_split": 48, "inductor_whole": 30,
         "torch_adamw_fused": 28, "stream_copy": 8, "stream_triad": 12}


def inductor_update(param, grad, exp_avg, exp_avg_sq, shadow, decay, step_size, bc2_sqrt, beta1: float,
                    beta2: float, eps: float) -> None:
    """The inductor-built update the C++ kernel replaced: torch's fused AdamW's arithmetic and the
    shadow's cast, in one loop."""
    param.mul_(decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    param.sub_(step_size * exp_avg / (exp_avg_sq.sqrt() / bc2_sqrt + eps))
    shadow.copy_(param)


def environment() -> dict:
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip() or None
    except OSError:
        commit = None
    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                 platform.processor()) if os.path.exists("/proc/cpuinfo") else platform.processor()
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else None
    return {"cpu_model": model, "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "host_ram_bytes": ram, "torch": torch.__version__, "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "python": platform.python_version(), "git_commit": commit}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=1 << 28, help="elements of the tile (default 2^28)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds after the warm-up")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--no-inductor", action="store_true", help="skip the inductor-built update")
    parser.add_argument("--out", default=None, help="write the JSON here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    n, cfg, lr = args.n, OptimConfig(lr=1e-4, weight_decay=0.1), 1e-4
    start = time.perf_counter()
    build = fused_adamw.build()
    setup = {"one_pass_kernel_s": time.perf_counter() - start, "one_pass_kernel_compiled": build.compiled,
             "one_pass_kernel_error": build.why}

    gen = torch.Generator().manual_seed(0)
    grad = torch.randn(n, generator=gen) * 1e-3
    tiles = {}
    for layout in ("whole", "split", "master"):
        tile = tiles[layout] = Tile(layout, Layout.of([ParamSpec("w", (n // 64, 64))]), torch.float32,
                                    torch.float32 if layout == "master" else torch.bfloat16, False, False,
                                    split=layout == "split")
        tile.reset()
        tile.write_master(torch.randn(n, generator=gen) * 0.02)
    scratch = adamw.Scratch()  # the host executor keeps one
    params = torch.nn.Parameter(torch.randn(n, generator=gen) * 0.02)
    params.grad = grad
    torch_adamw = torch.optim.AdamW([params], lr=lr, weight_decay=0.1, fused=True)
    a, b, c = torch.empty(n), torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    step = {"k": 0}  # each path's update count: a tile updated by several paths still sees a step

    def tile_update(layout: str, compiled: bool):
        def run():
            step["k"] += 1
            adamw.adamw(tiles[layout], 0, n, grad, adamw.Update(step["k"], lr, cfg), scratch=scratch, compiled=compiled)
        return run

    paths = {"one_pass_whole": tile_update("whole", True), "one_pass_split": tile_update("split", True),
             "one_pass_master": tile_update("master", True), "eager_whole": tile_update("whole", False), "eager_split": tile_update("split", False),
             "torch_adamw_fused": torch_adamw.step,
             "stream_copy": lambda: a.copy_(b), "stream_triad": lambda: torch.add(b, c, alpha=3.0, out=a)}
    if build.why is not None:
        del paths["one_pass_whole"], paths["one_pass_split"], paths["one_pass_master"]
    if not args.no_inductor:
        from megatrain.kernel_build import compiled
        kernel = compiled(inductor_update, **{"cpp.dynamic_threads": True, "cpp_wrapper": True})
        tile = tiles["whole"]
        beta1, beta2 = cfg.betas

        def inductor():
            step["k"] += 1
            t = step["k"]
            def scalar(x):
                return torch.tensor(x, dtype=torch.float32)
            kernel(tile.master, grad, tile.exp_avg, tile.exp_avg_sq, tile.shadow, scalar(1 - lr * cfg.weight_decay),
                   scalar(lr / (1 - beta1 ** t)), scalar(math.sqrt(1 - beta2 ** t)), beta1, beta2, cfg.eps)
        start = time.perf_counter()
        try:
            inductor()  # the build
            paths["inductor_whole"] = inductor
            setup["inductor_build_s"] = time.perf_counter() - start
        except Exception as e:  # a machine where inductor cannot build: a result, not a crash
            setup["inductor_build_s"], setup["inductor_error"] = None, f"{type(e).__name__}: {e}"

    samples = {name: [] for name in paths}
    for _ in range(args.rounds + 1):
        for name, run in paths.items():
            t0 = time.perf_counter()
            run()
            samples[name].append(time.perf_counter() - t0)
    report = {}
    for name, times in samples.items():
        warm, timed = times[0], times[1:]
        median = statistics.median(timed)
        report[name] = {"median_g_params_per_s": n / median / 1e9, "best_g_params_per_s": n / min(timed) / 1e9,
                        "bytes_per_param": BYTES[name], "median_gb_per_s": BYTES[name] * n / median / 1e9,
                        "samples_s": timed, "warmup_s": warm}
        unit = "G elements/s" if name.startswith("stream") else "G params/s"
        print(f"{name:18s} {report[name]['median_g_params_per_s']:7.3f} {unit} (best {report[name]['best_g_params_per_s']:.3f})"
              f"  {report[name]['median_gb_per_s']:7.2f} GB/s at {BYTES[name]} B/param")
    print("set-up:", json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in setup.items()}))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"config": {"n": n, "rounds": args.rounds, "threads": torch.get_num_threads(), "lr": lr,
                                  "weight_decay": cfg.weight_decay, "betas": list(cfg.betas)},
                       "environment": environment(), "setup_s": setup, "report": report}, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()

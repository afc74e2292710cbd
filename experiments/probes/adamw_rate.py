"""Probe: the host AdamW's rate, in one process, on one tile of N elements (float32 masters,
float32 gradient, bf16 compute; all of torch's threads unless --threads), for every way the engine
has of updating it, beside the memory bandwidth that bounds them:

- one_pass_whole, one_pass_split: the C++ kernel (fused_adamw.py), a whole master (pinned, streamed
  as it is and cast on the device: no shadow to write) or a split one (its bf16 shadow and low
  halves) (`engine.optimizer_kernel: compiled`, the engine's default);
- eager_whole, eager_split: torch's fused AdamW and the passes around it (`optimizer_kernel: eager`);
- torch_adamw_fused: torch.optim.AdamW(fused=True) on N float32 parameters;
- one_pass_separate: the C++ kernel's whole-master update on torch_adamw_fused's own tensors (the
  parameters, the gradient and the optimizer's moments, each an allocation of its own), where the
  tile's arrays share blocks at page-aligned offsets: beside one_pass_whole and eager_whole (torch's
  kernel on the tile) it says whether a gap to torch's rate is the kernel's or the memory's;
- candidate_whole, candidate_split (with --candidate SOURCE): the one pass built from another source
  of host_adamw.cpp (its own cache entry; its build's seconds in `setup_s`), in the same rounds:
  a change to the kernel against the tree's, measured in one process;
- stream_copy, stream_triad: torch's a.copy_(b) and torch.add(b, c, alpha=s, out=a) on N floats,
  all threads; STREAM's byte counts (8 and 12 bytes an element, no write-allocate). torch's ops are
  not a tuned STREAM (no streaming stores), so their bandwidth is a floor of the machine's;
- c_copy, c_triad and c_copy_nt, c_triad_nt: STREAM's copy and triad in C++ (host_stream.cpp,
  built here with the machine's compiler, -O3 -march=native, OpenMP on torch's threads), with plain
  stores and with non-temporal ones, which do not read the written lines first: the machine's
  bandwidth as STREAM measures it (the best of them), where a C++ compiler is.

Rounds interleave the paths (the first round is a warm-up, reported apart); each AdamW path's rate
over torch's fused AdamW's is taken round by round (`of_torch`: the median and range of the
rounds' ratios), which the host's bandwidth, varying between runs, moves less than it moves
either rate; and over torch's fused kernel alone, eager_whole, without the optimizer's Python
around it (`of_torch_kernel`: what matters on a small tile, where that Python is a share of the time). Each path's implied
bandwidth is its rate times the bytes it moves per parameter (`bytes_per_param`, counted from its
passes: the one pass 28 either layout, torch's 28; eager split about 48, the join and split and
their searches for ties around torch's 28).
Prints a line per path; --out writes the JSON (config, environment, samples, medians).

The default N is a Qwen2.5-7B layer's tile (233,057,792 parameters). A power of two is not a length
to measure at: on the 2-core CPU machine, at 2^26, 2^27 and 2^28 every update of the tile's arrays
(the moments one block, each array page-aligned), torch's own kernel among them, ran at 0.61-0.81 of
torch's fused AdamW on allocations of its own (the kernel on those 0.88-1.04), and at 0.73-1.04 one
to seventeen pages longer (`results/cpu-bench/probes/adamw_alias/`); no preset's layer has such a
length.

On the GPU host (16 cores, under 3 minutes):
    PYTHONPATH=. python experiments/probes/adamw_rate.py --out adamw_rate.json
On the 2-core CPU machine: --n 16777216. The arithmetic alone, on data a core's caches hold:
--n 262144 --threads 1 --rounds 30. --extra-flags=-mprefer-vector-width=512 builds the kernel with more compiler flags (after an =).
"""
from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import platform
import statistics
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from megatrain import adamw, fused_adamw
from megatrain.config import OptimConfig
from megatrain.shapes import ParamSpec
from megatrain.store import Layout, Tile

BYTES = {"one_pass_whole": 28, "one_pass_split": 28, "one_pass_separate": 28, "candidate_whole": 28,
         "candidate_split": 28, "eager_whole": 28, "eager_split": 48, "torch_adamw_fused": 28, "stream_copy": 8,
         "stream_triad": 12, "c_copy": 8, "c_triad": 12, "c_copy_nt": 8, "c_triad_nt": 12}
STREAM_SOURCE = Path(__file__).with_name("host_stream.cpp")


def stream_library(directory: str) -> tuple[ctypes.CDLL | None, str | None]:
    """host_stream.cpp built into `directory` and loaded, or None and why not."""
    cxx = shutil.which(os.environ.get("CXX", "c++"))
    if cxx is None:
        return None, "no C++ compiler (c++, or $CXX)"
    out = os.path.join(directory, "host_stream.so")
    done = subprocess.run([cxx, "-O3", "-march=native", "-fopenmp", "-std=c++17", "-fPIC", "-shared", str(STREAM_SOURCE),
                           "-o", out], capture_output=True, text=True)
    if done.returncode:
        return None, f"{cxx} failed: {done.stderr.strip()[-300:]}"
    library = ctypes.CDLL(out)
    library.host_stream_copy.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64, ctypes.c_int, ctypes.c_int]
    library.host_stream_triad.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_float, ctypes.c_int64, ctypes.c_int,
                                                                   ctypes.c_int]
    return library, None


def build_of(source: Path) -> fused_adamw.Build:
    """fused_adamw.build() of another source of the kernel, the tree's build left the process's."""
    tree = fused_adamw.SOURCE, fused_adamw._build
    fused_adamw.SOURCE, fused_adamw._build = source, None
    try:
        return fused_adamw.build()
    finally:
        fused_adamw.SOURCE, fused_adamw._build = tree


def with_build(build: fused_adamw.Build, run):
    """`run` with `build` as the process's kernel for the call."""
    def swapped():
        tree, fused_adamw._build = fused_adamw._build, build
        try:
            run()
        finally:
            fused_adamw._build = tree
    return swapped


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
            "python": platform.python_version(), "git_commit": commit, "openmp_libraries": openmp_libraries()}


def openmp_libraries() -> list[str]:
    """The OpenMP runtimes this process has mapped: one where the kernel's OpenMP is torch's, two where
    each keeps a pool of its own threads."""
    try:
        with open("/proc/self/maps") as f:
            return sorted({line.split()[-1] for line in f if "omp" in line.rsplit("/", 1)[-1].lower()})
    except OSError:
        return []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=233_057_792,
                        help="elements of the tile (default a Qwen2.5-7B layer's, 233,057,792)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds after the warm-up")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--extra-flags", default="",
                        help="more compiler flags for the one-pass kernel, after an =: --extra-flags=-mprefer-vector-width=512 (its own build)")
    parser.add_argument("--candidate", default=None, type=Path,
                        help="another source of host_adamw.cpp, built and timed beside the tree's (candidate_*)")
    parser.add_argument("--out", default=None, help="write the JSON here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    fused_adamw.FLAGS = [*fused_adamw.FLAGS, *args.extra_flags.split()]  # the cache names a build by its flags
    n, cfg, lr = args.n, OptimConfig(lr=1e-4, weight_decay=0.1), 1e-4
    start = time.perf_counter()
    build = fused_adamw.build()
    setup = {"one_pass_kernel_s": time.perf_counter() - start, "one_pass_kernel_compiled": build.compiled,
             "one_pass_kernel_error": build.why}
    candidate = None
    if args.candidate:
        start = time.perf_counter()
        candidate = build_of(args.candidate)
        setup |= {"candidate_kernel_s": time.perf_counter() - start, "candidate_kernel_compiled": candidate.compiled,
                  "candidate_kernel_error": candidate.why, "candidate_source": str(args.candidate),
                  "candidate_sha256": hashlib.sha256(args.candidate.read_bytes()).hexdigest()}

    gen = torch.Generator().manual_seed(0)
    grad = torch.randn(n, generator=gen) * 1e-3
    tiles = {}
    for layout in ("whole", "split"):
        tile = tiles[layout] = Tile(layout, Layout.of([ParamSpec("w", (n // 64, 64))]), torch.float32,
                                    torch.bfloat16, False, False, split=layout == "split")
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
             "eager_whole": tile_update("whole", False), "eager_split": tile_update("split", False),
             "torch_adamw_fused": torch_adamw.step,
             "stream_copy": lambda: a.copy_(b), "stream_triad": lambda: torch.add(b, c, alpha=3.0, out=a)}
    torch_adamw.step()  # its moments, made by the first step
    moments = torch_adamw.state[params]

    def separate():
        step["k"] += 1
        fused_adamw.update(grad, moments["exp_avg"], moments["exp_avg_sq"], step["k"], lr, cfg.weight_decay, cfg,
                           master=params.data)
    paths["one_pass_separate"] = separate
    if build.why is not None:
        del paths["one_pass_whole"], paths["one_pass_split"], paths["one_pass_separate"]
    if candidate is not None and candidate.why is None:
        for layout in ("whole", "split"):
            paths[f"candidate_{layout}"] = with_build(candidate, tile_update(layout, True))
    threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory() as directory:
        library, setup["stream_build_error"] = stream_library(directory)
    if library is not None:
        for nt, suffix in ((0, ""), (1, "_nt")):
            paths[f"c_copy{suffix}"] = lambda nt=nt: library.host_stream_copy(a.data_ptr(), b.data_ptr(), n, threads, nt)
            paths[f"c_triad{suffix}"] = lambda nt=nt: library.host_stream_triad(a.data_ptr(), b.data_ptr(), c.data_ptr(),
                                                                                3.0, n, threads, nt)

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
        stream = name.startswith(("stream", "c_"))
        for key, other in (("of_torch", "torch_adamw_fused"), ("of_torch_kernel", "eager_whole")):
            if not stream and name not in ("torch_adamw_fused", other):  # its rate over the other's, round by round
                ratios = [t / s for s, t in zip(timed, samples[other][1:])]
                report[name][key] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
        paired, kernel = report[name].get("of_torch"), report[name].get("of_torch_kernel")
        print(f"{name:18s} {report[name]['median_g_params_per_s']:7.3f} {'G elements/s' if stream else 'G params/s'}"
              f" (best {report[name]['best_g_params_per_s']:.3f})  {report[name]['median_gb_per_s']:7.2f} GB/s at"
              f" {BYTES[name]} B/param" + (f"  {paired['median']:.2f} of torch's a round ({paired['min']:.2f}-"
                                          f"{paired['max']:.2f})" if paired else "")
              + (f", {kernel['median']:.2f} of its kernel" if kernel else ""))
    print("set-up:", json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in setup.items()}))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"config": {"n": n, "rounds": args.rounds, "threads": torch.get_num_threads(), "lr": lr,
                                  "kernel_flags": fused_adamw.FLAGS,
                                  "weight_decay": cfg.weight_decay, "betas": list(cfg.betas)},
                       "environment": environment(), "setup_s": setup, "report": report}, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()

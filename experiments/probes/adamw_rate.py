"""Probe: the CPU AdamW update rate of one host tile (float32 masters, bf16 shadow), elements/s, as
the optimizer worker runs it (optim.adamw over the whole tile from a float32 gradient), for a side
by side of two engine trees: this one and the 14-byte store before issue 21. One process per point;
run it from outside the repository so PYTHONPATH picks the tree:

    git archive 93983a0 megatrain | tar -x -C /tmp/before   # the 14-byte store
    cd /tmp && for t in /tmp/before /path/to/repo; do
        T=2 PYTHONPATH=$t python /path/to/repo/experiments/probes/adamw_rate.py 33554432 5 $t; done

T: torch threads (default: torch's). Prints the median and best rate, the samples and the warm-up apart.
"""
import os
import statistics
import sys
import time

import torch

from megatrain import optim
from megatrain.config import OptimConfig
from megatrain.shapes import ParamSpec
from megatrain.store import Layout, Tile

N, reps, label = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else ""
if "T" in os.environ:
    torch.set_num_threads(int(os.environ["T"]))
cfg = OptimConfig(lr=1e-4, weight_decay=0.1)
tile = Tile("layer", Layout.of([ParamSpec("w", (N // 64, 64))]), torch.float32, torch.bfloat16, False, False)
gen = torch.Generator().manual_seed(0)
start = torch.randn(N, generator=gen) * 0.02
if hasattr(tile, "write_master"):  # split masters
    tile.reset()
    tile.write_master(start)
else:  # the 14-byte store: a whole float32 master beside the shadow
    tile.master.copy_(start)
    tile.refresh_shadow()
    tile.exp_avg.zero_()
    tile.exp_avg_sq.zero_()
grad = torch.randn(N, generator=gen) * 1e-3
extra = {"scratch": optim.Scratch()} if hasattr(optim, "Scratch") else {}  # the worker keeps one
times = []
for step in range(1, reps + 2):
    t0 = time.perf_counter()
    optim.adamw(tile, 0, N, grad, step, 1e-4, cfg, 1.0, **extra)
    times.append(time.perf_counter() - t0)
warm, times = times[0], times[1:]
print(f"{label} threads={torch.get_num_threads()} N={N} median {N / statistics.median(times) / 1e9:.3f} G elem/s "
      f"best {N / min(times) / 1e9:.3f} samples_s {[round(t, 4) for t in times]} warmup_s {warm:.3f}")

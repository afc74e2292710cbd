"""Probe: the CPU AdamW update rate of one host tile (float32 masters, bf16 shadow), elements/s, as
the optimizer worker runs it (optim.adamw over the whole tile from a float32 gradient), for a side
by side of the two layouts (engine.split_masters): SPLIT=1 the masters split into the shadow and
their low halves (12 B/param), SPLIT=0 a whole float32 master beside the shadow (14 B/param);
COMPILED=1 the one-pass update of a whole master (engine.optimizer_kernel, fused_adamw.py).
One process per point, interleaved:

    for r in 1 2 3; do for s in "SPLIT=0 COMPILED=0" "SPLIT=0 COMPILED=1" "SPLIT=1 COMPILED=0"; do
        env $s T=2 PYTHONPATH=. python experiments/probes/adamw_rate.py 33554432 5 "$s"; done; done

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
tile = Tile("layer", Layout.of([ParamSpec("w", (N // 64, 64))]), torch.float32, torch.bfloat16, False, False,
            split=os.environ.get("SPLIT", "1") == "1")
gen = torch.Generator().manual_seed(0)
tile.reset()
tile.write_master(torch.randn(N, generator=gen) * 0.02)
grad = torch.randn(N, generator=gen) * 1e-3
scratch = optim.Scratch()  # the worker keeps one
times = []
for step in range(1, reps + 2):
    t0 = time.perf_counter()
    optim.adamw(tile, 0, N, grad, step, 1e-4, cfg, 1.0, scratch=scratch, compiled=os.environ.get("COMPILED") == "1")
    times.append(time.perf_counter() - t0)
warm, times = times[0], times[1:]
print(f"{label} split={tile.split} threads={torch.get_num_threads()} N={N} median {N / statistics.median(times) / 1e9:.3f} G elem/s "
      f"best {N / min(times) / 1e9:.3f} samples_s {[round(t, 4) for t in times]} warmup_s {warm:.3f}")

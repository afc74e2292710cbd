"""Probe: CPU AdamW throughput of one host tile (float32 masters split into the bf16 shadow and the
low halves, docs/host-store.md) on this host, as the host executor runs it, and its parts.
Prints G elements/s per variant. Usage: python experiments/probes/cpu_adam.py [ELEMENTS]
(default: one 7B layer, 233 M; torch's default thread count unless OMP_NUM_THREADS says)."""
import sys
import threading
import time

import torch

from megatrain import adamw
from megatrain.config import OptimConfig
from megatrain.shapes import ParamSpec
from megatrain.store import Layout, Tile, join, split

N = int(sys.argv[1]) if len(sys.argv) > 1 else 233_057_792
cfg = OptimConfig(lr=1e-5, weight_decay=0.1)
pinned = torch.cuda.is_available()
tile = Tile("layer", Layout.of([ParamSpec("w", (N // 64, 64))]), torch.float32, torch.bfloat16, pinned, False,
            split=True)
tile.reset()
tile.write_master(torch.randn(N) * 0.02)
grad = torch.randn(N, pin_memory=pinned) * 1e-3
scratch = adamw.Scratch()
print("threads main", torch.get_num_threads())


def timed(fn, reps=3):
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


def in_thread(fn):
    box = {}
    th = threading.Thread(target=lambda: box.update(t=timed(fn), n=torch.get_num_threads()))
    th.start()
    th.join()
    return box["t"], box["n"]


def update():
    adamw.adamw(tile, 0, N, grad, adamw.Update(1, 1e-5, cfg), scratch=scratch)


t = timed(update)
t2, n2 = in_thread(update)
print(f"adamw, split tile: main {N / t / 1e9:.3f} G/s, worker thread ({n2} threads) {N / t2 / 1e9:.3f} G/s")
# the parts of one chunk
n = min(N, adamw.CHUNK)
p, wide = torch.empty(n), torch.empty(n, dtype=torch.int32)
m, v = tile.exp_avg[:n], tile.exp_avg_sq[:n]
step = torch.tensor(1.0)
print(f"join:  {n / timed(lambda: join(tile.shadow[:n], tile.low[:n], v, p, wide)) / 1e9:.3f} G/s")
t = timed(lambda: torch._fused_adamw_([p], [grad[:n]], [m], [v], [], [step], lr=1e-5, beta1=0.9, beta2=0.95,
                                      weight_decay=0.1, eps=1e-8, amsgrad=False, maximize=False))
print(f"_fused_adamw_: {n / t / 1e9:.3f} G/s")
print(f"split: {n / timed(lambda: split(p, tile.shadow[:n], tile.low[:n], v)) / 1e9:.3f} G/s")
print(f"shadow cast alone: {n / timed(lambda: tile.shadow[:n].copy_(p)) / 1e9:.3f} G/s")

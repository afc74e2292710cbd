"""Probe: CPU AdamW throughput of one 7B-layer tile (233 M params) on this host, in the ways the
optimizer worker could run it. Prints G params/s per variant."""
import threading
import time

import torch

from megatrain import optim
from megatrain.shapes import ParamSpec
from megatrain.config import OptimConfig
from megatrain.store import Layout, Tile

N = 233_057_792
cfg = OptimConfig(lr=1e-5, weight_decay=0.0)
pinned = torch.cuda.is_available()
tile = Tile("layer", Layout.of([ParamSpec("w", (N,))]), torch.float32, torch.bfloat16, pinned, False)
for t in (tile.master, tile.exp_avg, tile.exp_avg_sq):
    t.normal_()
grad = torch.randn(N, pin_memory=pinned)
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


a = torch.empty(N)
b = torch.randn(N)
print(f"copy fp32 {N * 8 / timed(lambda: a.copy_(b)) / 1e9:.1f} GB/s (read+write)")
print(f"sum fp32 {N * 4 / timed(lambda: b.sum()) / 1e9:.1f} GB/s (read)")
print(f"vector_norm {N / timed(lambda: torch.linalg.vector_norm(b)) / 1e9:.2f} G/s")
for chunk in (1 << 18, 1 << 20, 1 << 22, 1 << 24):
    optim.CHUNK = chunk
    t = timed(lambda: optim.adamw(tile, 0, N, grad, 1, 1e-5, cfg, 1.0))
    t2, n2 = in_thread(lambda: optim.adamw(tile, 0, N, grad, 1, 1e-5, cfg, 1.0))
    print(f"adamw chunk {chunk:>9}: main {N / t / 1e9:.2f} G/s, worker thread ({n2} threads) {N / t2 / 1e9:.2f} G/s")
optim.CHUNK = 1 << 20
# without the shadow refresh
shadow = tile.shadow
tile.shadow = tile.master
t = timed(lambda: optim.adamw(tile, 0, N, grad, 1, 1e-5, cfg, 1.0))
tile.shadow = shadow
print(f"adamw no shadow: {N / t / 1e9:.2f} G/s")
# plain fused AdamW on the whole tensor
p, m, v = tile.master, tile.exp_avg, tile.exp_avg_sq
step = torch.tensor(1.0)
t = timed(lambda: torch._fused_adamw_([p], [grad], [m], [v], [], [step], lr=1e-5, beta1=0.9, beta2=0.95,
                                      weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False))
print(f"_fused_adamw_ whole tensor: {N / t / 1e9:.2f} G/s")
t = timed(lambda: shadow.copy_(p))
print(f"shadow cast whole: {N / t / 1e9:.2f} G/s")

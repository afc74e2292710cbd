"""Probe: the float32 step gradient's add of a bf16 weight gradient, the library's add against the
engine's (megatrain.accumulate.add_into), over one decoder layer's parameters.

A model's layer parameters (shapes from its config, `--preset`) get a float32 accumulator and a
bf16 gradient each; every form adds all of them `--reps` times. Reported per form: milliseconds a
micro-batch (one add of every parameter), the bytes moved (4 + 2 + 4 a parameter) per second,
and whether the sums equal the library's to the bit; on a GPU the engine's kernel at other
launch shapes (elements a program, warps). For scale: a float32 add of two float32
tensors and a copy of the accumulator, the device's own elementwise rates on the same bytes; the
accumulator's zeroing and a bf16 gradient copied into it, by torch and by the engine's
copy_into (what a step's first micro-batch does in place of zeroing and adding).

    python -m experiments.probes.grad_add --preset gpt-oss-120b --out grad_add.json
"""
from __future__ import annotations

import argparse
import functools
import json

import torch

from megatrain import accumulate
from megatrain.accumulate import add_into, copy_into, triton
from megatrain.config import ModelConfig
from megatrain.shapes import ModelShape, load_hf_config


def timed(fn, reps: int, cuda: bool) -> float:
    """Seconds a call, the mean of `reps` after one warm-up."""
    import time
    fn()
    if cuda:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / reps
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="gpt-oss-120b")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out")
    args = ap.parse_args()
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    specs = ModelShape(load_hf_config(ModelConfig(preset=args.preset))).layer_specs  # the largest layer's
    shapes = {s.name: tuple(s.shape) for s in specs}
    gen = torch.Generator(device=dev).manual_seed(0)
    accs = [torch.randn(s, generator=gen, device=dev) for s in shapes.values()]
    grads = [torch.randn(s, generator=gen, device=dev).to(torch.bfloat16) for s in shapes.values()]
    params = sum(a.numel() for a in accs)

    def library(targets):
        for a, g in zip(targets, grads):
            a.add_(g)

    def blocks(block: int, warps: int):  # the engine's kernel at other launch shapes
        for a, g in zip(accs, grads):
            accumulate._add_kernel[(triton.cdiv(a.numel(), block),)](a, g, a.numel(), BLOCK=block, num_warps=warps)

    def engine(targets):
        for a, g in zip(targets, grads):
            add_into(a, g)

    # bit-for-bit: one add of each from the same start
    ref, own = [a.clone() for a in accs], [a.clone() for a in accs]
    library(ref)
    engine(own)
    equal = all(torch.equal(r, o) for r, o in zip(ref, own))
    del ref, own
    floats = [g.float() for g in grads]
    forms = {
        "library add (fp32 += bf16)": (lambda: library(accs), 10),
        "engine add_into (fp32 += bf16)": (lambda: engine(accs), 10),
        **{f"kernel block {b} warps {w}": (functools.partial(blocks, b, w), 10)
           for b, w in ((1024, 4), (4096, 8), (8192, 16)) if cuda},
        "fp32 += fp32": (lambda: [a.add_(f) for a, f in zip(accs, floats)], 12),
        "fp32 copy": (lambda: [f.copy_(a) for a, f in zip(accs, floats)], 8),
        # what a step's first micro-batch could do instead of zeroing the accumulator and adding
        "zeroing (fp32 = 0)": (lambda: [a.zero_() for a in accs], 4),
        "fp32 = bf16 (a copy)": (lambda: [a.copy_(g) for a, g in zip(accs, grads)], 6),
        "engine copy_into (fp32 = bf16)": (lambda: [copy_into(a, g) for a, g in zip(accs, grads)], 6),
    }
    rows = {}
    for name, (fn, bytes_per) in forms.items():
        s = timed(fn, args.reps, cuda)
        rows[name] = {"ms": s * 1e3, "bytes_per_param": bytes_per, "GB_s": params * bytes_per / s / 1e9}
    out = {"preset": args.preset, "device": torch.cuda.get_device_name(dev) if cuda else "cpu",
           "params": params, "tensors": {k: list(v) for k, v in shapes.items()}, "reps": args.reps,
           "bit_equal": equal, "forms": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    print(f"{args.preset}: {params / 1e9:.2f} B layer parameters, {args.reps} reps, engine == library bit for bit: {equal}")
    for name, r in rows.items():
        print(f"  {name:32s} {r['ms']:8.2f} ms  {r['GB_s']:8.1f} GB/s ({r['bytes_per_param']} B/param)")


if __name__ == "__main__":
    main()

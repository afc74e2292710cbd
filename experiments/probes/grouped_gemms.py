"""Probe: a mixture-of-experts layer's grouped GEMMs one at a time, at a preset's shape: each product
of the experts' forward and backward (torch's grouped GEMM over the rows sorted by expert, the
operands laid out as the lean experts lay them), the weight gradients also with other layouts, and
a dense GEMM of the same FLOPs beside each.

The rows are a layer's picks at `--tokens` tokens routed top-k among the preset's experts at random
(uniform scores, so the experts' counts vary as a random router's do). Per product: milliseconds a
call and TFLOP/s at its 2 x rows x in x out FLOPs, the calls issued back to back as a layer issues
them (CUDA events around each of ROUNDS rounds of --reps / ROUNDS calls after a warm-up: the median
round, and the rounds' range over it as `spread`, which on the H200 reached 3-40% with the GPU's
clock moving under these random operands); per weight-gradient layout the largest difference from
the engine's layout (the same sums, perhaps in another order).

Products, for each projection (`up`: hidden -> the gate and up halves, or the up alone; `down`:
expert width -> hidden) with the weights stacked as the library stacks them (GPT-OSS (experts, in,
out), Qwen3-MoE and Mixtral (experts, out, in)):
    fwd     rows x weight                                    (the forward and the recompute)
    dgrad   the output's gradient x weight^T                 (the input's gradient)
    wgrad   rows^T x the output's gradient, each expert's    (the weight's gradient; K is the rows)
Weight-gradient layouts: `engine` (F.grouped_mm(rows.t(), grad): both operands with the rows
strided, as autograd's and _DownCombine's), `swapped` (grad^T x rows, transposed back), `loop`
(torch.mm per expert, the offsets read on the host: a reference, not a path without a sync).
With --autotune, each grouped product also built by torch.compile in max-autotune mode
(`*_autotuned`: inductor times torch's grouped GEMM against its Triton templates and takes the
fastest; its AUTOTUNE tables go to stderr), its largest difference from torch's own. The
operands copied so that the rows run contiguous are no layout for these counts: torch's grouped
GEMM asserts on the device that each group's extent along a contiguous dynamic dimension is a
multiple of 16 bytes.

    python -m experiments.probes.grouped_gemms --preset gpt-oss-20b --out grouped_gemms.json
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F

from megatrain.config import ModelConfig
from megatrain.shapes import load_hf_config


ROUNDS = 5


def timed(fn, reps: int) -> list[float]:
    """Milliseconds a call in each of ROUNDS rounds of `reps` / ROUNDS calls back to back, after a
    warm-up."""
    for _ in range(3):
        fn()
    calls = max(1, reps // ROUNDS)
    times = []
    for _ in range(ROUNDS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return times


def autotuned(product):
    """`product` (tensors in, one tensor out) built by torch.compile's max-autotune."""
    return torch.compile(product, mode="max-autotune-no-cudagraphs", dynamic=False, fullgraph=True)


def products(x: torch.Tensor, weight: torch.Tensor, transposed: bool, offsets: torch.Tensor,
             bounds: list[int], gen: torch.Generator, reps: int, autotune: bool = False) -> dict:
    """The three products of one projection; `weight` stacked (experts, in, out) if `transposed`,
    else (experts, out, in)."""
    w = weight if transposed else weight.transpose(-2, -1)  # (experts, in, out) either way, as a view
    rows, n_in, n_out = x.shape[0], w.shape[1], w.shape[2]
    grad = torch.randn(rows, n_out, generator=gen, device="cuda").to(torch.bfloat16)
    flops = 2 * rows * n_in * n_out
    dense_w = torch.randn(n_in, n_out, generator=gen, device="cuda").to(torch.bfloat16)

    def engine_wgrad():
        if transposed:
            return F.grouped_mm(x.t(), grad, offs=offsets)
        return F.grouped_mm(grad.t(), x, offs=offsets).transpose(-2, -1)  # autograd's for a col-major weight

    def swapped():
        if transposed:
            return F.grouped_mm(grad.t(), x, offs=offsets).transpose(-2, -1)
        return F.grouped_mm(x.t(), grad, offs=offsets)

    def loop():
        out = x.new_empty(len(bounds) - 1, n_in, n_out)
        for e in range(len(bounds) - 1):
            torch.mm(x[bounds[e]:bounds[e + 1]].t(), grad[bounds[e]:bounds[e + 1]], out=out[e])
        return out

    forms = {
        "fwd": lambda: F.grouped_mm(x, w, offs=offsets),
        "fwd_dense": lambda: torch.mm(x, dense_w),
        "dgrad": lambda: F.grouped_mm(grad, w.transpose(-2, -1), offs=offsets),
        "dgrad_dense": lambda: torch.mm(grad, dense_w.t()),
        "wgrad_engine": engine_wgrad,
        "wgrad_swapped": swapped,
        "wgrad_loop": loop,
        "wgrad_dense": lambda: torch.mm(x.t(), grad),
    }
    if autotune:
        fwd = autotuned(lambda a, b, o: F.grouped_mm(a, b, offs=o))
        wgrad = autotuned(lambda a, b, o: F.grouped_mm(a.t(), b, offs=o) if transposed
                          else F.grouped_mm(b.t(), a, offs=o).transpose(-2, -1))
        forms.update({"fwd_autotuned": lambda: fwd(x, w, offsets),
                      "dgrad_autotuned": lambda: fwd(grad, w.transpose(-2, -1), offsets),
                      "wgrad_autotuned": lambda: wgrad(x, grad, offsets)})
    eager = {"fwd": forms["fwd"], "dgrad": forms["dgrad"], "wgrad": engine_wgrad}
    want = engine_wgrad().float()
    report = {"rows": rows, "in": n_in, "out": n_out, "gflop": flops / 1e9}
    for name, fn in forms.items():
        rounds = timed(fn, reps)
        ms = statistics.median(rounds)
        entry = {"ms": ms, "spread": (max(rounds) - min(rounds)) / ms, "tflops": flops / ms / 1e9}
        if name.startswith("wgrad") and not name.endswith(("dense", "autotuned")):
            entry["max_diff"] = (fn().float() - want).abs().max().item()
        if name.endswith("autotuned"):
            entry["max_diff"] = (fn().float() - eager[name.split("_")[0]]().float()).abs().max().item()
        report[name] = entry
        print(f"  {name:22s} {ms:7.3f} ms {entry['tflops']:7.1f} TFLOP/s", flush=True)
    return report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="gpt-oss-20b")
    p.add_argument("--tokens", type=int, default=8 * 4096)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--autotune", action="store_true", help="also each grouped product by torch.compile's max-autotune")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    hf = load_hf_config(ModelConfig(preset=a.preset), cuda=True)
    experts = getattr(hf, "num_local_experts", None) or hf.num_experts
    k = hf.num_experts_per_tok
    width = getattr(hf, "moe_intermediate_size", None) or hf.intermediate_size
    transposed = hf.model_type == "gpt_oss"  # the library's stacking: GPT-OSS (experts, in, out)
    gen = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.rand(a.tokens, experts, generator=gen, device="cuda").topk(k).indices.reshape(-1).sort().values
    counts = torch.bincount(ids, minlength=experts)
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    bounds = [0] + offsets.tolist()
    x = torch.randn(ids.numel(), hf.hidden_size, generator=gen, device="cuda").to(torch.bfloat16)
    h = torch.randn(ids.numel(), width, generator=gen, device="cuda").to(torch.bfloat16)

    def stack(n_in: int, n_out: int) -> torch.Tensor:
        shape = (experts, n_in, n_out) if transposed else (experts, n_out, n_in)
        return (torch.randn(shape, generator=gen, device="cuda") / n_in ** 0.5).to(torch.bfloat16)

    report = {"preset": a.preset, "tokens": a.tokens, "experts": experts, "top_k": k,
              "rows_per_expert": {"min": counts.min().item(), "max": counts.max().item()},
              "device": torch.cuda.get_device_name(), "torch": torch.__version__}
    for name, rows, n_in, n_out in (("up", x, hf.hidden_size, 2 * width), ("down", h, width, hf.hidden_size)):
        print(f"{a.preset} {name}: {rows.shape[0]} rows, {n_in} -> {n_out}", flush=True)
        report[name] = products(rows, stack(n_in, n_out), transposed, offsets, bounds, gen, a.reps, a.autotune)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()

"""Probe: the experts' rows moved on the GPU, each way the engine could: the tokens' rows gathered
into expert order (x[perm // k], lean_experts._ToExperts: torch's index against index_select and a
Triton row copy, gather_rows.py's, at several launch shapes), and each expert's rows summed (the experts' biases'
gradients, megatrain.expert_bias.expert_sums: the engine's Triton kernel at its launch shape and
others against torch's segment sum over the bf16 rows, which adds in bf16, and over float32 rows,
the engine's route where the kernel does not run).

The rows are a layer's picks at `--tokens` tokens routed top-k among the preset's experts at random,
in expert order; the sums at each of the two widths the biases have (the up projection's 2 x expert
width, the down projection's the hidden size). Reported per form: milliseconds a call (CUDA events,
the median of --reps after a warm-up), GB/s of the rows read (the gather: written), and the
largest error against float64 sums (the gather: whether it is torch's, to the bit).

    python -m experiments.probes.expert_rows --preset gpt-oss-20b --out expert_rows.json
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch

from megatrain import expert_bias, gather_rows
from megatrain.config import ModelConfig
from megatrain.shapes import load_hf_config

SHAPES = [(32, 128, 4), (32, 128, 8), (64, 128, 4), (64, 128, 8), (128, 64, 4), (16, 256, 4), (64, 256, 8),
          (64, 64, 4), (128, 64, 2), (128, 32, 4), (256, 32, 4), (256, 64, 4), (256, 64, 8), (128, 128, 8)]
GATHERS = [(1, 1024, 4), (2, 1024, 4), (4, 512, 4), (8, 256, 4), (4, 1024, 8), (16, 128, 4), (16, 128, 8),
           (32, 64, 4), (32, 128, 4), (16, 256, 4), (64, 64, 4)]


def gather(x: torch.Tensor, idx: torch.Tensor, block_r: int, block_c: int, warps: int) -> torch.Tensor:
    """gather_rows' kernel at another launch shape."""
    out = x.new_empty(idx.numel(), x.shape[1])
    gather_rows._gather_kernel[(-(-idx.numel() // block_r), -(-x.shape[1] // block_c))](
        x, idx, out, idx.numel(), x.shape[1], BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps)
    return out


def run(forms: dict, reps: int, check) -> dict:
    """Each form timed, and `check(result)`'s figure of its result; a form that fails is recorded."""
    results = {}
    for name, fn in forms.items():
        try:
            seconds = timed(fn, reps)
        except Exception as e:  # a launch shape Triton cannot build here: a result, not a crash
            results[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
            print(f"{name:<28} failed: {results[name]['error']}")
            continue
        results[name] = {"ms": seconds * 1e3, **check(fn())}
        print(f"{name:<28} {seconds * 1e3:7.3f} ms  {json.dumps({k: v for k, v in results[name].items() if k != 'ms'})}")
    return results


def timed(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def kernel(rows: torch.Tensor, counts: torch.Tensor, block_r: int, block_c: int, warps: int) -> torch.Tensor:
    width = rows.shape[1]
    out = rows.new_empty(counts.numel(), width)
    expert_bias._expert_sums_kernel[(counts.numel(), -(-width // block_c))](
        rows, counts.cumsum(0), out, width, BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="gpt-oss-20b")
    p.add_argument("--tokens", type=int, default=8 * 4096)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    hf = load_hf_config(ModelConfig(preset=a.preset), cuda=True)
    experts, k = hf.num_local_experts, hf.num_experts_per_tok
    gen = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.rand(a.tokens, experts, generator=gen, device="cuda").topk(k).indices.reshape(-1).sort().values
    counts = torch.bincount(ids, minlength=experts)
    report = {"preset": a.preset, "tokens": a.tokens, "experts": experts, "top_k": k, "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "sums_default": [expert_bias.SUM_R, expert_bias.SUM_C], "sums": {}}
    perm = torch.rand(a.tokens * k, generator=gen, device="cuda").argsort()  # the picks' order by expert
    x = torch.randn(a.tokens, hf.hidden_size, generator=gen, device="cuda").to(torch.bfloat16)
    idx = perm // k
    want = x[idx]
    gb = want.numel() * 2 / 1e9
    forms = {"gather_index": lambda: x[perm // k], "gather_index_select": lambda: x.index_select(0, perm // k)}
    for r, c, w in GATHERS:
        forms[f"gather_triton_{r}x{c}_w{w}"] = lambda r=r, c=c, w=w: gather(x, perm // k, r, c, w)
    report["gather"] = run(forms, a.reps, lambda got: {"same": torch.equal(got, want)})
    for v in report["gather"].values():
        if "ms" in v:
            v["gb_per_s_written"] = gb / v["ms"] * 1e3
    for width in (2 * hf.intermediate_size, hf.hidden_size):
        rows = torch.randn(ids.numel(), width, generator=gen, device="cuda").to(torch.bfloat16)
        exact = torch.zeros(experts, width, dtype=torch.float64, device="cuda").index_add_(0, ids, rows.double())
        forms = {"sums_torch_bf16": lambda: torch.segment_reduce(rows, "sum", lengths=counts, axis=0, unsafe=True),
                 "sums_torch_float": lambda: torch.segment_reduce(rows.float(), "sum", lengths=counts, axis=0,
                                                                  unsafe=True).to(rows.dtype)}
        for r, c, w in SHAPES:
            forms[f"sums_triton_{r}x{c}_w{w}"] = lambda r=r, c=c, w=w: kernel(rows, counts, r, c, w)
        print(f"sums at width {width} (of {exact.abs().max().item():.3g} at most)")
        report["sums"][str(width)] = run(forms, a.reps, lambda got: {
            "max_error": (got.double() - exact).abs().max().item()})
        for v in report["sums"][str(width)].values():
            if "ms" in v:
                v["gb_per_s_read"] = rows.numel() * 2 / v["ms"] / 1e6
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()

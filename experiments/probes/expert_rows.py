"""Probe: the experts' rows moved on the GPU, each way the engine could: the tokens' rows gathered
into expert order (x[perm // k], lean_experts._ToExperts: torch's index against index_select and a
Triton row copy, gather_rows.py's, at several launch shapes), and each expert's rows summed (the experts' biases'
gradients, megatrain.expert_bias.expert_sums: the engine's Triton kernel at its launch shape and
others against torch's segment sum over the bf16 rows, which adds in bf16, and over float32 rows,
the engine's route where the kernel does not run); and GPT-OSS's clamped gate with the up
projection's bias inside (expert_bias's forward kernel, and its backward kernel with the bias's
gradient summed in the pass, beside the same kernel followed by expert_sums) and the backward's rows
gathered with their bias dots and the down bias's gradient (`rows_and_bias_dots`), at several launch
shapes: each one's rows against the engine's launch shape's, to the bit, its float32 sums by the
largest error against the largest.

The rows are a layer's picks at `--tokens` tokens routed top-k among the preset's experts at random,
in expert order; the sums at each of the two widths the biases have (the up projection's 2 x expert
width, the down projection's the hidden size). Reported per form: milliseconds a call (CUDA events,
the median of --reps after a warm-up), GB/s of the rows read (the gather: written), and the
largest error against float64 sums (the gather and the gate: whether it is the engine's, to the bit).

    python -m experiments.probes.expert_rows --preset gpt-oss-20b --out expert_rows.json
"""
from __future__ import annotations

import argparse
import functools
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

GATES = [(16, 64, 4), (8, 64, 4), (8, 128, 4), (16, 128, 4), (16, 128, 8), (32, 64, 4), (32, 64, 8), (32, 128, 8),
         (64, 64, 8), (4, 256, 4), (16, 256, 8)]
# the backward's kernels, a chunk of one expert's rows by a block of columns: rows a chunk, rows a step, columns, warps
BACKWARDS = [(128, 8, 64, 4), (256, 8, 64, 4), (512, 8, 64, 4), (1024, 8, 64, 4), (2048, 8, 64, 4), (512, 8, 64, 2),
             (512, 8, 64, 8), (128, 16, 64, 8), (512, 4, 128, 4), (1024, 4, 128, 4), (512, 4, 64, 2), (512, 16, 64, 8)]
ROWS_DOTS = [(128, 16, 128, 4), (256, 16, 128, 4), (512, 16, 128, 4), (1024, 16, 128, 4), (2048, 16, 128, 4),
             (512, 32, 128, 4), (512, 8, 256, 4), (1024, 8, 256, 4), (512, 16, 64, 4), (512, 16, 128, 8)]


def gather(x: torch.Tensor, idx: torch.Tensor, block_r: int, block_c: int, warps: int) -> torch.Tensor:
    """gather_rows' kernel at another launch shape."""
    out = x.new_empty(idx.numel(), x.shape[1])
    gather_rows._gather_kernel[(-(-idx.numel() // block_r), -(-x.shape[1] // block_c))](
        x, idx, out, idx.numel(), x.shape[1], BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps)
    return out


def gate(y: torch.Tensor, bias: torch.Tensor, ids: torch.Tensor, limit: float, alpha: float, block_r: int,
         block_c: int, warps: int) -> torch.Tensor:
    """expert_bias's gate forward at another launch shape."""
    rows, width = y.shape[0], y.shape[1] // 2
    out = y.new_empty(rows, width)
    expert_bias._forward_kernel[(-(-rows // block_r), -(-width // block_c))](
        y, bias, ids, out, rows, width, limit, alpha, BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps)
    return out


def same(got, want, exact: tuple = (), close: tuple = ()) -> dict:
    """A result against the engine's launch shape's: a tensor, or the tuple's `exact` places, to the
    bit; its `close` (name, place) float32 sums (each row's dots, whose order depends on the column
    blocks; the biases' gradients, on the chunks) by the largest error against the largest."""
    if isinstance(want, torch.Tensor):
        return {"same": torch.equal(got, want)}
    row = {"same": all(torch.equal(got[i], want[i]) for i in exact)}
    for name, i in close:
        row[f"{name}_rel_error"] = ((got[i].float() - want[i].float()).abs().max() / want[i].float().abs().max()).item()
    return row


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
    if hf.model_type == "gpt_oss":  # GPT-OSS's clamped gate, its limit and alpha the library's experts'
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
        with torch.device("meta"):
            library = GptOssExperts(hf)
        limit, alpha = library.limit, library.alpha
        width = hf.intermediate_size
        y = torch.randn(ids.numel(), 2 * width, generator=gen, device="cuda").to(torch.bfloat16) * 4
        bias = torch.randn(experts, 2 * width, generator=gen, device="cuda").to(torch.bfloat16)
        d = torch.randn(ids.numel(), width, generator=gen, device="cuda").to(torch.bfloat16)
        weights = torch.rand(ids.numel(), generator=gen, device="cuda").to(torch.bfloat16)  # the router weights, by row
        report["gate_default"] = [expert_bias.BLOCK_R, expert_bias.BLOCK_C]
        want = gate(y, bias, ids, limit, alpha, expert_bias.BLOCK_R, expert_bias.BLOCK_C, 4)
        report["gate_forward"] = run({f"gate_forward_{r}x{c}_w{w}": lambda r=r, c=c, w=w: gate(
            y, bias, ids, limit, alpha, r, c, w) for r, c, w in GATES}, a.reps, lambda got: same(got, want))
        # the backward: y's gradient and h w written, y and the gradient through the down projection read;
        # with the bias's gradient summed in the pass, or by expert_sums after it (the rows read again)
        report["gate_backward_default"] = list(expert_bias.BACKWARD)
        backward = functools.partial(expert_bias.gate_backward, y, bias, counts, d, weights, limit, alpha)
        forms = {f"gate_backward_{'x'.join(map(str, s))}": lambda s=s: backward(sums=True, shape=s) for s in BACKWARDS}
        forms["gate_backward_then_sums"] = lambda: (lambda out: (*out[:3], expert_bias.expert_sums(out[0], counts)))(
            backward(sums=False))
        want = backward(sums=True)
        report["gate_backward"] = run(forms, a.reps, lambda got: same(got, want, (0, 2), (("dots", 1), ("sums", 3))))
        moved = ids.numel() * (6 * width * 2 + 4)
        # the backward's rows: each its token's gradient gathered (written), with its bias dot and the down bias's sum
        g = torch.randn(a.tokens, hf.hidden_size, generator=gen, device="cuda").to(torch.bfloat16)
        b_down = torch.randn(experts, hf.hidden_size, generator=gen, device="cuda").to(torch.bfloat16)
        report["rows_dots_default"] = list(expert_bias.ROWS_DOTS)
        rows_dots = functools.partial(expert_bias.rows_and_bias_dots, g, perm // k, b_down, counts, weights)
        forms = {f"rows_dots_{'x'.join(map(str, s))}": lambda s=s: rows_dots(sums=True, shape=s) for s in ROWS_DOTS}
        want = rows_dots(sums=True)
        report["rows_dots"] = run(forms, a.reps, lambda got: same(got, want, (0,), (("dots", 1), ("sums", 2))))
        for key, size in (("gate_forward", ids.numel() * 3 * width * 2), ("gate_backward", moved),
                          ("rows_dots", ids.numel() * hf.hidden_size * 2)):
            for v in report[key].values():
                if "ms" in v:
                    v["gb_per_s_moved" if key != "rows_dots" else "gb_per_s_written"] = size / v["ms"] / 1e6
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()

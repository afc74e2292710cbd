"""Probe: the experts' rows moved on the GPU, each way the engine could: the tokens' rows gathered
into expert order (x[perm // k], lean_experts._ToExperts: torch's index against index_select and a
Triton row copy, gather_rows.py's, at several launch shapes), and each expert's rows summed (the experts' biases'
gradients, megatrain.expert_bias.expert_sums: the engine's Triton kernel at its launch shape and
others against torch's segment sum over the bf16 rows, which adds in bf16, and over float32 rows,
the engine's route where the kernel does not run); and GPT-OSS's clamped gate with the up
projection's bias inside (expert_bias's forward and backward kernels, elementwise over the rows:
each launch shape's result against the engine's, to the bit).

The rows are a layer's picks at `--tokens` tokens routed top-k among the preset's experts at random,
in expert order; the sums at each of the two widths the biases have (the up projection's 2 x expert
width, the down projection's the hidden size). Reported per form: milliseconds a call (CUDA events,
the median of --reps after a warm-up), GB/s of the rows read (the gather: written), and the
largest error against float64 sums (the gather and the gate: whether it is the engine's, to the bit).

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

GATES = [(16, 64, 4), (8, 64, 4), (8, 128, 4), (16, 128, 4), (16, 128, 8), (32, 64, 4), (32, 64, 8), (32, 128, 8),
         (64, 64, 8), (4, 256, 4), (16, 256, 8)]


def gather(x: torch.Tensor, idx: torch.Tensor, block_r: int, block_c: int, warps: int) -> torch.Tensor:
    """gather_rows' kernel at another launch shape."""
    out = x.new_empty(idx.numel(), x.shape[1])
    gather_rows._gather_kernel[(-(-idx.numel() // block_r), -(-x.shape[1] // block_c))](
        x, idx, out, idx.numel(), x.shape[1], BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps)
    return out


def gate(y: torch.Tensor, bias: torch.Tensor, ids: torch.Tensor, through: torch.Tensor | None, limit: float,
         alpha: float, block_r: int, block_c: int, warps: int, weights: torch.Tensor | None = None):
    """expert_bias's gate forward (through None: the gate's output) or backward (from the down
    projection's input gradient before the router's `weights`: y's gradient and each row's
    <through, h>)."""
    rows, width = y.shape[0], y.shape[1] // 2
    grid = (-(-rows // block_r), -(-width // block_c))
    if through is None:
        out = y.new_empty(rows, width)
        expert_bias._forward_kernel[grid](y, bias, ids, out, rows, width, limit, alpha, BLOCK_R=block_r,
                                          BLOCK_C=block_c, num_warps=warps)
        return out
    out = torch.empty_like(y)
    dots = torch.empty(rows, grid[1], dtype=torch.float32, device=y.device)
    expert_bias._backward_kernel[grid](y, bias, ids, through, weights, out, dots, rows, width, limit, alpha,
                                       BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps)
    return out, dots.sum(dim=1)


# the gate's backward a block of whole rows a program, its columns in a loop: each row's <through, h> summed in
# registers (no partial sums written, no sum after); rows, columns a step, warps
ROW_GATES = [(1, 1024, 4), (2, 512, 4), (4, 256, 4), (2, 1024, 8), (4, 512, 8), (8, 256, 8)]

if expert_bias.triton is not None:
    tl = expert_bias.tl

    @expert_bias.triton.jit
    def _gate_backward_rows(y_ptr, b_ptr, ids_ptr, t_ptr, w_ptr, dy_ptr, dots_ptr, rows, limit, alpha,
                            width: tl.constexpr, ROWS: tl.constexpr, BLOCK_C: tl.constexpr):
        """expert_bias._backward_kernel's arithmetic over whole rows: dy, and each row's <t, h> in dots (rows);
        the width a constant (the kernels are built for fixed widths, kernel_build.py)."""
        r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        rmask = r < rows
        r64 = r.to(tl.int64)
        e = tl.load(ids_ptr + r, mask=rmask, other=0).to(tl.int64)
        w = tl.load(w_ptr + r, mask=rmask, other=0.0).to(tl.float32)
        acc = tl.zeros((ROWS,), dtype=tl.float32)
        for start in range(0, width, BLOCK_C):
            c = start + tl.arange(0, BLOCK_C)
            c2 = 2 * start + tl.arange(0, 2 * BLOCK_C)
            mask = rmask[:, None] & (c < width)[None, :]
            mask2 = rmask[:, None] & (c2 < 2 * width)[None, :]
            y = tl.load(y_ptr + r64[:, None] * (2 * width) + c2[None, :], mask=mask2, other=0.0)
            b = tl.load(b_ptr + e[:, None] * (2 * width) + c2[None, :], mask=mask2, other=0.0)
            x = (y.to(tl.float32) + b.to(tl.float32)).to(y.dtype).to(tl.float32)
            gate, up = tl.split(tl.reshape(x, (ROWS, BLOCK_C, 2)))
            t = tl.load(t_ptr + r64[:, None] * width + c[None, :], mask=mask, other=0.0)
            d = (t.to(tl.float32) * w[:, None]).to(t.dtype).to(tl.float32)
            g = tl.minimum(gate, limit)
            u = tl.minimum(tl.maximum(up, -limit), limit)
            sig = tl.sigmoid(g * alpha)
            h = ((u + 1) * (g * sig)).to(t.dtype).to(tl.float32)
            acc += tl.sum(t.to(tl.float32) * h, axis=1)
            d_gate = tl.where(gate <= limit, d * (u + 1) * sig * (1 + alpha * g * (1 - sig)), 0.0)
            d_up = tl.where((up >= -limit) & (up <= limit), d * g * sig, 0.0)
            dy = tl.reshape(tl.join(d_gate, d_up), (ROWS, 2 * BLOCK_C))
            tl.store(dy_ptr + r64[:, None] * (2 * width) + c2[None, :], dy.to(dy_ptr.dtype.element_ty), mask=mask2)
        tl.store(dots_ptr + r, acc, mask=rmask)


def gate_rows(y: torch.Tensor, bias: torch.Tensor, ids: torch.Tensor, through: torch.Tensor, limit: float,
              alpha: float, rows_a: int, block_c: int, warps: int, weights: torch.Tensor):
    """The gate's backward by `_gate_backward_rows`: y's gradient and each row's <through, h>."""
    rows, width = y.shape[0], y.shape[1] // 2
    out = torch.empty_like(y)
    dots = torch.empty(rows, dtype=torch.float32, device=y.device)
    _gate_backward_rows[(-(-rows // rows_a),)](y, bias, ids, through, weights, out, dots, rows, limit, alpha,
                                               width=width, ROWS=rows_a, BLOCK_C=block_c, num_warps=warps)
    return out, dots


def same(got, want) -> dict:
    """The gate's output, or its backward's y gradient, against the engine's launch shape's: to the
    bit; the backward's row sums (their order depends on the column blocks): the largest relative error."""
    if isinstance(want, torch.Tensor):
        return {"same": torch.equal(got, want)}
    return {"same": torch.equal(got[0], want[0]),
            "dots_rel_error": ((got[1] - want[1]).abs().max() / want[1].abs().max()).item()}


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
        width = hf.intermediate_size
        y = torch.randn(ids.numel(), 2 * width, generator=gen, device="cuda").to(torch.bfloat16) * 4
        bias = torch.randn(experts, 2 * width, generator=gen, device="cuda").to(torch.bfloat16)
        d = torch.randn(ids.numel(), width, generator=gen, device="cuda").to(torch.bfloat16)
        report["gate_default"] = [expert_bias.BLOCK_R, expert_bias.BLOCK_C]
        moved = {"forward": ids.numel() * 3 * width * 2, "backward": ids.numel() * (5 * width * 2 + 4)}
        weights = torch.rand(ids.numel(), generator=gen, device="cuda").to(torch.bfloat16)  # the router weights, by row
        for way, grad in (("forward", None), ("backward", d)):
            want = gate(y, bias, ids, grad, library.limit, library.alpha, expert_bias.BLOCK_R, expert_bias.BLOCK_C, 4,
                        weights)
            forms = {f"gate_{way}_{r}x{c}_w{w}": lambda r=r, c=c, w=w, grad=grad: gate(
                y, bias, ids, grad, library.limit, library.alpha, r, c, w, weights) for r, c, w in GATES}
            if grad is not None:
                forms.update({f"gate_backward_rows_{r}x{c}_w{w}": lambda r=r, c=c, w=w: gate_rows(
                    y, bias, ids, d, library.limit, library.alpha, r, c, w, weights) for r, c, w in ROW_GATES})
            report[f"gate_{way}"] = run(forms, a.reps, lambda got, want=want: same(got, want))
            for v in report[f"gate_{way}"].values():
                if "ms" in v:
                    v["gb_per_s_moved"] = moved[way] / v["ms"] / 1e6
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()

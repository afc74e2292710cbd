"""The decoder layers' RMSNorms, keeping only their input for the backward, over token chunks.

The library's RMSNorm (Llama, Qwen2, Qwen3, Mistral, Phi-3, Qwen3-MoE, Mixtral; GPT-OSS scales by the
weight before casting back, `scale` "float32"; Gemma by (1 + weight), in float32 too, "one_plus")
upcasts its input to float32 and autograd
keeps that copy, and the normalised input in the compute dtype, for the backward: three
hidden-size tensors of the compute dtype per norm and token, beside the input itself, which the
graph holds anyway (the layer's input, or the residual sum). Here the forward is the library's
arithmetic, op for op, and the backward runs it again from the saved input before
differentiating it: the same ops, so the same gradients, for a norm's worth of elementwise work.
Six hidden-size tensors less per layer and token: 21 GiB per layer at 512K tokens of the 7B shape.

`compiled` (engine.norm_kernel): the same forward, and its backward written out (`_backward`: the
gradients of the same products, the weight's summed in float32), each built by torch.compile into
one fused kernel, instead of a dozen elementwise kernels that each read and write hidden-size
rows: on a GPU the norms' share of a layer's time is what it can save. Inside a kernel the
arithmetic stays in float32 and sums run in another order, so it agrees with the library's norm
to rounding, not bit for bit. `auto`, the default, compiles them on a GPU, where they are faster,
and keeps the library's ops on the CPU, where the engine is held exact against the library.

Over CHUNK rows both run a chunk of rows at a time: the float32 temporaries of a norm (and of
its backward, about eight hidden-size tensors: 28 GiB at 512K tokens of the 7B shape, the peak of
a layer's backward) are then a chunk's. Rows narrower than NARROW (Qwen3's head norms: 128 wide,
32 and 4 to a token) go in chunks of as many elements as CHUNK rows of NARROW: in chunks of CHUNK
rows, a Qwen3 layer's head norms at 8 x 4096 tokens were 16 and 2 chunks each way, each a small kernel
and a copy into the output. Rows are independent, so the output and the input gradient are
unchanged; the weight's gradient sums the chunks in float32.
"""
from __future__ import annotations

import torch
from torch import nn

from megatrain import kernel_build

CHUNK, NARROW = 65536, 2048  # rows a chunk, of NARROW elements or more; narrower rows: CHUNK x NARROW elements


def _chunk_rows(width: int) -> int:
    return CHUNK * max(1, NARROW // width)


def _width_of_the_kernel(x: torch.Tensor) -> None:
    """In a compiled kernel, the rows' width is a constant of the kernel: one kernel a width. Its
    reduction's launch configuration is chosen from the sizes of the call that builds it
    (deterministic mode: none timed), and a kernel built at the first norm's width, the hidden size,
    ran Qwen3's head norms (q_norm, k_norm: 128-wide rows, 32 and 4 to a token) at that width's
    configuration: a Qwen3-30B-A3B layer's ceiling at 8 x 4096 tokens took 72.1 ms on the H200, the
    norms' kernels about 19 of it, and 58.1 with a kernel a width
    (docs/decisions.md, "A norm kernel a row width")."""
    if torch.compiler.is_compiling():
        torch._dynamo.mark_static(x, -1)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, scale: str = "input") -> torch.Tensor:
    """The library's RMSNorm forward: float32 statistics, scaled by the weight in the input's dtype
    (`scale` "input"), or scaled in float32 and then cast: by the weight (GPT-OSS's, "float32") or by
    1 + weight (Gemma's, "one_plus")."""
    _width_of_the_kernel(x)
    xf = x.to(torch.float32)
    variance = xf.pow(2).mean(-1, keepdim=True)
    if scale == "one_plus":
        return (xf * torch.rsqrt(variance + eps) * (1.0 + weight.float())).to(x.dtype)
    if scale == "float32":
        return (weight * (xf * torch.rsqrt(variance + eps))).to(x.dtype)
    return weight * (xf * torch.rsqrt(variance + eps)).to(x.dtype)


def _grads(x: torch.Tensor, weight: torch.Tensor, eps: float, scale: str, dy: torch.Tensor):
    """(dx, dw) by autograd through the forward's own ops."""
    x, weight = x.detach().requires_grad_(), weight.detach().requires_grad_()
    with torch.enable_grad():
        y = _rms_norm(x, weight, eps, scale)
    return torch.autograd.grad(y, (x, weight), dy)


def _backward(x: torch.Tensor, weight: torch.Tensor, eps: float, scale: str, dy: torch.Tensor):
    """(dx, dw) of `_rms_norm` written out for the compiled kernel: n = x r in float32 with
    r = rsqrt(mean(x^2) + eps), dx = r (dn - n mean(dn n)); dn and dw from the products the forward
    made (in the input's dtype, or, scaled in float32, in float32); dw in float32."""
    _width_of_the_kernel(x)
    xf = x.to(torch.float32)
    r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    n = xf * r
    if scale != "input":
        dyf = dy.to(torch.float32)
        dn = dyf * (1.0 + weight.float() if scale == "one_plus" else weight)
        dw = (dyf * n).reshape(-1, n.shape[-1]).sum(0)
    else:
        dn = (dy * weight).to(torch.float32)
        dw = (dy * n.to(x.dtype)).to(torch.float32).reshape(-1, n.shape[-1]).sum(0)
    dx = r * (dn - n * (dn * n).mean(-1, keepdim=True))
    return dx.to(x.dtype), dw


_compiled_forward = kernel_build.compiled(_rms_norm)
_compiled_backward = kernel_build.compiled(_backward)


class _LeanRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps: float, scale: str, compiled: bool):
        ctx.save_for_backward(x, weight)  # the engine's hooks turn the weight into a reference
        ctx.eps, ctx.scale, ctx.compiled = eps, scale, compiled
        norm = _compiled_forward if compiled else _rms_norm
        rows = x.reshape(-1, x.shape[-1])  # one rank whatever the caller's (a kernel is built per rank)
        chunk = _chunk_rows(rows.shape[1])
        if rows.shape[0] <= chunk:
            return norm(rows, weight, eps, scale).view(x.shape)
        out = torch.empty_like(rows)
        for lo in range(0, rows.shape[0], chunk):
            out[lo: lo + chunk] = norm(rows[lo: lo + chunk], weight, eps, scale)
        return out.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        grads = _compiled_backward if ctx.compiled else _grads
        rows, drows = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
        chunk = _chunk_rows(rows.shape[1])
        if rows.shape[0] <= chunk:
            dx, dw = grads(rows, weight, ctx.eps, ctx.scale, drows)
            return dx.view(x.shape), dw.to(weight.dtype), None, None, None
        dx = torch.empty_like(rows)
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for lo in range(0, rows.shape[0], chunk):
            dx[lo: lo + chunk], dw_chunk = grads(rows[lo: lo + chunk], weight, ctx.eps, ctx.scale,
                                                 drows[lo: lo + chunk])
            dw += dw_chunk
        return dx.view(x.shape), dw.to(weight.dtype), None, None, None


def make_lean(norm: nn.Module, scale: str = "input", compiled: bool = False) -> None:
    """Make a decoder layer's RMSNorm keep only its input (its parameters and output unchanged);
    `scale`: how the family's norm applies its weight (_rms_norm: "input", "float32" for GPT-OSS,
    "one_plus" for Gemma); `compiled`: the fused kernels (engine.norm_kernel)."""
    eps = norm.eps if scale == "one_plus" else norm.variance_epsilon  # Gemma's module names it eps
    norm.forward = lambda x: _LeanRMSNorm.apply(x, norm.weight, eps, scale, compiled)

"""The decoder layers' RMSNorms, keeping only their input for the backward, over token chunks.

The library's RMSNorm (Llama, Qwen2, Qwen3, Mistral, Qwen3-MoE; GPT-OSS scales by the weight before
casting back, `float32_scale`) upcasts its input to float32 and autograd
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

Over CHUNK tokens both run a chunk of tokens at a time: the float32 temporaries of a norm (and of
its backward, about eight hidden-size tensors: 28 GiB at 512K tokens of the 7B shape, the peak of
a layer's backward) are then a chunk's. Rows are independent, so the output and the input
gradient are unchanged; the weight's gradient sums the chunks in float32.
"""
from __future__ import annotations

import torch
from torch import nn

from megatrain import kernel_build

CHUNK = 65536  # tokens


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


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, float32_scale: bool = False) -> torch.Tensor:
    """The library's RMSNorm forward: float32 statistics, scaled in the input's dtype (or, GPT-OSS's,
    scaled in float32 and then cast)."""
    _width_of_the_kernel(x)
    xf = x.to(torch.float32)
    variance = xf.pow(2).mean(-1, keepdim=True)
    if float32_scale:
        return (weight * (xf * torch.rsqrt(variance + eps))).to(x.dtype)
    return weight * (xf * torch.rsqrt(variance + eps)).to(x.dtype)


def _grads(x: torch.Tensor, weight: torch.Tensor, eps: float, float32_scale: bool, dy: torch.Tensor):
    """(dx, dw) by autograd through the forward's own ops."""
    x, weight = x.detach().requires_grad_(), weight.detach().requires_grad_()
    with torch.enable_grad():
        y = _rms_norm(x, weight, eps, float32_scale)
    return torch.autograd.grad(y, (x, weight), dy)


def _backward(x: torch.Tensor, weight: torch.Tensor, eps: float, float32_scale: bool, dy: torch.Tensor):
    """(dx, dw) of `_rms_norm` written out for the compiled kernel: n = x r in float32 with
    r = rsqrt(mean(x^2) + eps), dx = r (dn - n mean(dn n)); dn and dw from the products the forward
    made (in the input's dtype, or, float32_scale, in float32); dw in float32."""
    _width_of_the_kernel(x)
    xf = x.to(torch.float32)
    r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    n = xf * r
    if float32_scale:
        dyf = dy.to(torch.float32)
        dn, dw = dyf * weight, (dyf * n).reshape(-1, n.shape[-1]).sum(0)
    else:
        dn = (dy * weight).to(torch.float32)
        dw = (dy * n.to(x.dtype)).to(torch.float32).reshape(-1, n.shape[-1]).sum(0)
    dx = r * (dn - n * (dn * n).mean(-1, keepdim=True))
    return dx.to(x.dtype), dw


_compiled_forward = kernel_build.compiled(_rms_norm)
_compiled_backward = kernel_build.compiled(_backward)


class _LeanRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps: float, float32_scale: bool, compiled: bool):
        ctx.save_for_backward(x, weight)  # the engine's hooks turn the weight into a reference
        ctx.eps, ctx.float32_scale, ctx.compiled = eps, float32_scale, compiled
        norm = _compiled_forward if compiled else _rms_norm
        rows = x.reshape(-1, x.shape[-1])  # one rank whatever the caller's (a kernel is built per rank)
        if rows.shape[0] <= CHUNK:
            return norm(rows, weight, eps, float32_scale).view(x.shape)
        out = torch.empty_like(rows)
        for lo in range(0, rows.shape[0], CHUNK):
            out[lo: lo + CHUNK] = norm(rows[lo: lo + CHUNK], weight, eps, float32_scale)
        return out.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        grads = _compiled_backward if ctx.compiled else _grads
        rows, drows = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
        if rows.shape[0] <= CHUNK:
            dx, dw = grads(rows, weight, ctx.eps, ctx.float32_scale, drows)
            return dx.view(x.shape), dw.to(weight.dtype), None, None, None
        dx = torch.empty_like(rows)
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for lo in range(0, rows.shape[0], CHUNK):
            dx[lo: lo + CHUNK], dw_chunk = grads(rows[lo: lo + CHUNK], weight, ctx.eps, ctx.float32_scale,
                                                 drows[lo: lo + CHUNK])
            dw += dw_chunk
        return dx.view(x.shape), dw.to(weight.dtype), None, None, None


def make_lean(norm: nn.Module, float32_scale: bool = False, compiled: bool = False) -> None:
    """Make a decoder layer's RMSNorm keep only its input (its parameters and output unchanged);
    `float32_scale`: the family's norm multiplies by its weight before casting back (GPT-OSS);
    `compiled`: the fused kernels (engine.norm_kernel)."""
    norm.forward = lambda x: _LeanRMSNorm.apply(x, norm.weight, norm.variance_epsilon, float32_scale, compiled)

"""GPT-OSS's attention sinks after flex attention, their product compiled (engine.sinks_kernel: compiled).

Flex attention cannot put a sink into the scores' softmax, so the library's flex attention
(transformers.integrations.flex_attention) renormalises its output afterwards: from each query's
log-sum-exp l (rounded to the compute dtype) and its head's sink s, the factor
exp(l - logsumexp(l, s)), a (batch, heads, queries, 1) tensor, multiplies the (batch, heads,
queries, width) output, which is then returned with heads and queries transposed. The factor is
small; its product with the output is a broadcast, which torch runs in its unvectorised elementwise
kernel, in the forward, in the recompute, and in the backward for the output's gradient and again
for the factor's. Here the library's function runs without the sink, the factor is made by the
same ops from the log-sum-exp it returns, and the product, taken on the transposed output (the
same products), is one compiled kernel; its backward one compiled kernel for both gradients. The
output and the output's gradient are torch's to the bit (one product, rounded once, as torch
rounds it); the factor's gradient (each product rounded as torch rounds it, summed over the head's
width in float32) equal to rounding.

It takes the place of the library's flex attention only while the engine runs a layer (`applied`):
the library's stays for everything else in the process, a reference model beside the engine among
them.
"""
from __future__ import annotations

import contextlib

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from megatrain.kernel_build import compiled

FLEX = "flex_attention"


def _scaled(out: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    return out * factor


def _scaled_grad(out: torch.Tensor, factor: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Autograd's backward of `_scaled` with `factor` broadcast over the last dimension: the
    output's gradient, and the factor's, the products summed over that dimension. The output's
    gradient (batch, queries, heads, width) is written in (batch, heads, queries, width) memory:
    transposed back it is the contiguous gradient the compiled flex attention's backward asks for
    (it makes a contiguous copy of any other)."""
    through = (grad * factor).transpose(1, 2).contiguous().transpose(1, 2)
    return through, (grad * out).float().sum(dim=-1, keepdim=True).to(factor.dtype)


_compiled_scaled = compiled(_scaled)
_compiled_scaled_grad = compiled(_scaled_grad, emulate_precision_casts=True)


class _Scaled(torch.autograd.Function):
    """out (..., width) times factor (..., 1), compiled each way; keeps both."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(out, factor)
        return _compiled_scaled(out, factor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out, factor = ctx.saved_tensors
        return _compiled_scaled_grad(out, factor, grad)


def sink_factor(lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Each query's renormalisation by its head's sink, (batch, heads, queries, 1), from the
    log-sum-exp of its scores (batch, heads, queries), by the library's ops: its roundings."""
    lse = lse.unsqueeze(-1)
    with_sink = torch.cat([lse, sinks.view(1, -1, 1, 1).expand_as(lse)], dim=-1)
    return torch.exp(lse - torch.logsumexp(with_sink, dim=-1, keepdim=True))


def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask, s_aux: torch.Tensor | None = None, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """The library's flex attention with the sinks' product compiled: its output (batch, queries,
    heads, width) and the log-sum-exp (in the compute dtype) it returns."""
    out, lse = library(module, query, key, value, attention_mask, s_aux=None, **kwargs)
    if s_aux is None:
        return out, lse
    return _Scaled.apply(out, sink_factor(lse, s_aux).transpose(1, 2)), lse


def library(*args, **kwargs):
    """The library's flex attention (imported at the first call: it imports torch's flex attention)."""
    from transformers.integrations.flex_attention import flex_attention_forward
    return flex_attention_forward(*args, **kwargs)


@contextlib.contextmanager
def applied():
    """This module's attention in place of the library's flex attention while the block runs."""
    ALL_ATTENTION_FUNCTIONS[FLEX] = attention  # the shared interface's own entry, over the library's
    try:
        yield
    finally:
        del ALL_ATTENTION_FUNCTIONS[FLEX]

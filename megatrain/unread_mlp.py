"""A decoder layer's MLP whose output nothing reads: the engine's recompute of a block's last
layer, whose output is only the root its backward starts from (`output_unused`).

The MLP's backward needs the input of each projection, not the MLP's output. So there the down
projection's forward is left out: its input and weight are saved as autograd would save them and
its backward computes both gradients as a linear layer's would (same values), while its output is
left uncomputed. The chunked MLP (chunked_mlp.py), whose backward recomputes gate and up from the
MLP's input, leaves out all three projections there. This relies on the MLP's output feeding only
the layer's residual sum, as in every family of arch.FAMILIES (a post-MLP norm would read it).
"""
from __future__ import annotations

import contextlib
from contextvars import ContextVar
from functools import partial

import torch
from torch import nn

from megatrain.swiglu import swiglu

_OUTPUT_UNUSED = ContextVar("mlp_output_unused", default=False)


@contextlib.contextmanager
def output_unused():
    """Within it, MLPs may leave their output uncomputed (its values unspecified): for a layer
    whose output is only where a backward starts."""
    token = _OUTPUT_UNUSED.set(True)
    try:
        yield
    finally:
        _OUTPUT_UNUSED.reset(token)


def unread() -> bool:
    """Is the MLP running now inside `output_unused`?"""
    return _OUTPUT_UNUSED.get()


class _UnreadLinear(torch.autograd.Function):
    """x @ w.T for autograd, with the forward's values left out."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x.new_empty(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dx = dy @ w if ctx.needs_input_grad[0] else None
        dw = dy.reshape(-1, dy.shape[-1]).t() @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None
        return dx, dw


def _forward(mlp: nn.Module, whole, compiled: bool, x: torch.Tensor) -> torch.Tensor:
    if not unread() and not compiled:
        return whole(x)
    gated = swiglu(mlp.gate_proj(x), mlp.up_proj(x)) if compiled else mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x)
    if unread():
        return _UnreadLinear.apply(gated, mlp.down_proj.weight)
    return mlp.down_proj(gated)


def skip_unread_down(mlp: nn.Module, compiled: bool = False) -> None:
    """Make a bias-free SiLU-gated MLP module (chunked_mlp.chunkable) leave its down projection's
    forward out within `output_unused`; `compiled`: its silu(gate) * up by swiglu.py's kernels
    (engine.mlp_kernel)."""
    mlp.forward = partial(_forward, mlp, mlp.forward, compiled)

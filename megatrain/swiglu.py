"""The SiLU-gated MLP's elementwise part, silu(gate) * up, as one kernel each way
(engine.mlp_kernel: compiled).

In the library's MLP this is two kernels forward (the activation, the product) and three backward,
over the layer's largest elementwise tensors (tokens x FFN width: 5.3 times the hidden size at the
7B shape), and autograd keeps gate, silu(gate) and up for the backward. Here torch.compile builds
the forward into one kernel and the written-out backward (silu'(g) = s + g s (1 - s), as the chunked
MLP's: chunked_mlp.py) into another, and only gate and up are kept: one tensor of tokens x FFN width
less per layer. Inside a kernel the arithmetic stays in float32 where the library rounds silu(gate)
to the compute dtype before the product: equal to rounding, not bit for bit.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from megatrain.kernel_build import compiled


def _product(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def _grads(gate: torch.Tensor, up: torch.Tensor, dh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    g, u, d = gate.to(torch.float32), up.to(torch.float32), dh.to(torch.float32)
    sig = torch.sigmoid(g)
    return (d * u * sig * (1 + g * (1 - sig))).to(gate.dtype), (d * g * sig).to(up.dtype)


_compiled_product = compiled(_product)
_compiled_grads = compiled(_grads)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return _compiled_product(_rows(gate), _rows(up)).view(gate.shape)

    @staticmethod
    def backward(ctx, dh):
        gate, up = ctx.saved_tensors
        return tuple(g.view(gate.shape) for g in _compiled_grads(_rows(gate), _rows(up), _rows(dh)))


def _rows(t: torch.Tensor) -> torch.Tensor:
    """`t` as rows, so that one kernel serves every caller's rank (kernel_build: a build per form)."""
    return t.reshape(-1, t.shape[-1])


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, compiled, keeping gate and up for the backward."""
    return _SwiGLU.apply(gate, up)

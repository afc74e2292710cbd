"""The gated MLP (down(silu(gate(x)) * up(x)), as Llama, Qwen and Mistral layers have it) over
chunks of tokens, in the forward and the backward, for long sequences.

Unchunked, a layer's MLP keeps about four tensors of tokens x FFN width for its backward (at 512K
tokens and FFN 18944 in bf16: 20 GB each). Here the forward keeps only its input; the backward
recomputes each chunk's gate and up projections and accumulates the weight gradients in float32
chunk by chunk, so the MLP's memory is bounded by the chunk whatever the sequence. The cost is
the chunk's two projections computed again (hardware FLOPs, not model FLOPs). The weights are
saved as they are (the engine's saved-tensor hook turns views of the weight buffer into
references), so no weight is copied.

Since the backward needs only the input, an MLP whose output nothing reads computes none of it
(unread_mlp.output_unused): there the whole MLP forward (three projections) is left out, more than
the two projections the backward adds, so a chunked MLP then costs less than a whole one.
"""
from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from megatrain.unread_mlp import unread


class _ChunkedGatedMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w_gate, w_up, w_down, chunk: int):
        flat = x.reshape(-1, x.shape[-1])
        out = torch.empty(flat.shape[0], w_down.shape[0], dtype=x.dtype, device=x.device)
        for lo in range(0, 0 if unread() else flat.shape[0], chunk):
            xc = flat[lo: lo + chunk]
            out[lo: lo + chunk] = F.linear(F.silu(F.linear(xc, w_gate)) * F.linear(xc, w_up), w_down)
        ctx.save_for_backward(x, w_gate, w_up, w_down)
        ctx.chunk = chunk
        return out.view(*x.shape[:-1], w_down.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x, w_gate, w_up, w_down = ctx.saved_tensors
        flat, dflat = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
        dx = torch.empty_like(flat)
        acc = torch.promote_types(w_gate.dtype, torch.float32)  # bf16 weights: float32 sums over the chunks
        grads = [torch.zeros(w.shape, dtype=acc, device=w.device) for w in (w_gate, w_up, w_down)]
        for lo in range(0, flat.shape[0], ctx.chunk):
            xc, dyc = flat[lo: lo + ctx.chunk], dflat[lo: lo + ctx.chunk]
            gate, up = F.linear(xc, w_gate), F.linear(xc, w_up)
            act = F.silu(gate)
            dh = dyc @ w_down  # gradient of silu(gate) * up
            grads[2].add_((dyc.t() @ (act * up)).to(acc))
            sig = torch.sigmoid(gate)
            dgate = dh * up * sig * (1 + gate * (1 - sig))  # silu'(g) = s + g s (1 - s)
            dup = dh * act
            grads[0].add_((dgate.t() @ xc).to(acc))
            grads[1].add_((dup.t() @ xc).to(acc))
            dx[lo: lo + ctx.chunk] = dgate @ w_gate + dup @ w_up
        return (dx.view_as(x), *(g.to(w.dtype) for g, w in zip(grads, (w_gate, w_up, w_down))), None)


def _forward(mlp: nn.Module, chunk: int, x: torch.Tensor) -> torch.Tensor:
    return _ChunkedGatedMLP.apply(x, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight, chunk)


def chunkable(mlp: nn.Module, hidden_act: str) -> bool:
    """Is this decoder layer's MLP (its config's `hidden_act` given) the bias-free SiLU-gated one?"""
    parts = [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    return all(isinstance(p, nn.Linear) and p.bias is None for p in parts) and hidden_act in ("silu", "swish")


def chunk_tokens(mlp: nn.Module, chunk: int, hidden_act: str) -> None:
    """Make a decoder layer's MLP module run over `chunk` tokens at a time; refused, by name, for an
    MLP that is not the bias-free SiLU-gated one."""
    if not chunkable(mlp, hidden_act):
        raise ValueError(f"engine.mlp_chunk_tokens: {type(mlp).__name__} with hidden_act {hidden_act!r} is not a "
                         "bias-free SiLU-gated MLP; set engine.mlp_chunk_tokens: null for this model")
    mlp.forward = partial(_forward, mlp, chunk)

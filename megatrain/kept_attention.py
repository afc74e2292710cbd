"""A recomputed layer's attention taken from its forward (engine.keep_attention_layers).

A layer's recompute runs its forward again for the graph its backward needs. Of the attention
core, softmax(q k^T) v, that backward needs only q, k, v (which the recompute makes again: its
projections and rotary), the output and the log-sum-exp of each query's scores; the fused kernels
return the last two. So the forward of a layer whose policy keeps attention (schedule.py) calls the
kernel the library's SDPA call would run, keeps its output and what its backward reads (`Kept`,
per micro-batch: tokens x heads x head_dim of the compute dtype, heads x tokens of float32 and a
few scalars), and the recompute returns that output through an autograd function whose backward is
the kernel's backward on the recomputed q, k and v. The arithmetic is the library's: the kernel
SDPA picks for these inputs (`torch._fused_sdp_choice`, the same in the forward and in the
recompute, whose backward it is) with the arguments it passes, and q, k, v are the forward's bit
for bit. (cuDNN's forward is asked for the log-sum-exp, as the recompute's call asks; the library's
forward without grad does not ask: the GPU test holds the two outputs equal.)

Where the library's call is not one of those kernels on causal attention without a mask, the layer
runs the library's call and its recompute runs attention again: a micro-batch with padding or
packed rows (a mask), a backend other than flash attention or cuDNN (the memory-efficient one, the
math one; flash on a GPU at a head width it pads), found as the forward runs. Eager and flex
attention (GPT-OSS's sinks, Gemma 2's soft-capping) and sliding windows narrower than the sequence
(a mask always) are left out up front (`keepable_layers`).
"""
from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from torch.nn.attention import SDPBackend
from transformers import AttentionInterface, PretrainedConfig
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward, use_gqa_in_sdpa

from megatrain.shapes import ModelShape

NAME = "megatrain_kept_sdpa"  # the attention implementation of the templates of a run that keeps attention
aten = torch.ops.aten


def _flash(q, k, v, scale):
    if q.is_cuda:
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, True, False, scale=scale)
        return out, (lse, cum_q, cum_k, max_q, max_k, seed, offset)
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale)
    return out, (lse,)


def _flash_backward(dout, q, k, v, out, state, scale):
    if q.is_cuda:
        lse, cum_q, cum_k, max_q, max_k, seed, offset = state
        return aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, True, seed, offset, scale=scale)
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, state[0], 0.0, True,
                                                                     scale=scale)


def _cudnn(q, k, v, scale):
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, True, False, scale=scale)
    return out, (lse, cum_q, cum_k, max_q, max_k, seed, offset)


def _cudnn_backward(dout, q, k, v, out, state, scale):
    lse, cum_q, cum_k, max_q, max_k, seed, offset = state
    return aten._scaled_dot_product_cudnn_attention_backward(
        dout, q, k, v, out, lse, seed, offset, None, cum_q, cum_k, max_q, max_k, 0.0, True, scale=scale)


# SDPA's backend -> (forward: q, k, v, scale -> output and what the backward reads; backward),
# each called as torch's scaled_dot_product_attention calls it (aten/.../transformers/attention.cpp)
KERNELS: dict[int, tuple[Callable, Callable]] = {int(SDPBackend.FLASH_ATTENTION): (_flash, _flash_backward),
                                                int(SDPBackend.CUDNN_ATTENTION): (_cudnn, _cudnn_backward)}


@dataclass
class Kept:
    """One layer's attention for one micro-batch, from its forward to its recompute's backward."""
    out: torch.Tensor  # (batch, heads, tokens, head_dim), as the kernel returned it
    state: tuple  # the kernel's other outputs its backward reads, the log-sum-exp first
    backward: Callable
    scale: float | None


_KEEPING: ContextVar[list | None] = ContextVar("keeping_attention", default=None)
_REUSING: ContextVar[Kept | None] = ContextVar("reusing_attention", default=None)


@contextlib.contextmanager
def keeping():
    """Within it, a layer's attention keeps its output where it can: the list it yields holds the
    layer's `Kept`, or nothing where the library's call ran."""
    kept: list[Kept] = []
    token = _KEEPING.set(kept)
    try:
        yield kept
    finally:
        _KEEPING.reset(token)


@contextlib.contextmanager
def reusing(kept: Kept | None):
    """Within it, the layer's attention returns `kept` (None: the library's call, computed again)."""
    token = _REUSING.set(kept)
    try:
        yield
    finally:
        _REUSING.reset(token)


class _Reused(torch.autograd.Function):
    """The kept output for autograd; its backward the kernel's, on the recomputed q, k, v."""

    @staticmethod
    def forward(ctx, q, k, v, kept: Kept):
        ctx.save_for_backward(q, k, v)
        ctx.kept = kept
        return kept.out.detach()

    @staticmethod
    def backward(ctx, dout):
        q, k, v = ctx.saved_tensors
        kept = ctx.kept
        return (*kept.backward(dout, q, k, v, kept.out, kept.state, kept.scale), None)


def _arguments(module, key, value):
    """key and value as the library's SDPA call passes them without a mask (grouped queries repeated
    where it cannot pass them whole), and its enable_gqa."""
    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1 and not use_gqa_in_sdpa(None, key, value):
        return repeat_kv(key, groups), repeat_kv(value, groups), False
    return key, value, groups > 1


def _backend(query, key, value, scale: float | None, gqa: bool, grad: bool) -> int:
    """The kernel SDPA picks for these inputs without a mask, in a forward without grad (the first)
    or with it (the recompute's, whose backward the gradients come from)."""
    with torch.set_grad_enabled(grad):
        query = query.detach().requires_grad_(grad)
        return torch._fused_sdp_choice(query, key, value, None, 0.0, True, scale=scale, enable_gqa=gqa)


def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
              is_causal: bool | None = None, **kwargs):
    """The library's SDPA attention, keeping or reusing its output inside `keeping` or `reusing`."""
    kept, keep = _REUSING.get(), _KEEPING.get()
    if kept is not None:
        key, value, _ = _arguments(module, key, value)
        return _Reused.apply(query, key, value, kept).transpose(1, 2).contiguous(), None
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if (keep is not None and attention_mask is None and not dropout and causal and kwargs.get("position_bias") is None
            and query.shape[2] == key.shape[2] > 1):
        k, v, gqa = _arguments(module, key, value)
        choice = _backend(query, k, v, scaling, gqa, grad=False)
        padded = query.is_cuda and query.shape[-1] % 8  # flash on a GPU: the library pads the head width
        if (choice in KERNELS and choice == _backend(query, k, v, scaling, gqa, grad=True)
                and not (padded and choice == int(SDPBackend.FLASH_ATTENTION))):
            forward, backward = KERNELS[choice]
            out, state = forward(query, k, v, scaling)
            keep.append(Kept(out, state, backward, scaling))
            return out.transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)


AttentionInterface.register(NAME, attention)


def keepable_layers(shape: ModelShape, seq_len: int) -> list[int]:
    """The layers whose attention can be kept: with the library's SDPA, a window (if any) wider
    than the sequence, so that a micro-batch without padding or packed rows has no mask."""
    if shape.config._attn_implementation != "sdpa":
        return []
    return [i for i in range(shape.num_layers) if shape.window(i) is None or seq_len < shape.window(i)]


def config(shape: ModelShape) -> PretrainedConfig:
    """The model's config, its attention this module's (the templates' of a run that keeps attention)."""
    c = copy.copy(shape.config)
    c._attn_implementation = NAME
    return c


def kept_parts(shape: ModelShape, tokens: int, dtype_bytes: int) -> tuple[int, int]:
    """Bytes of the two tensors one layer's attention keeps for one micro-batch of `tokens`: its
    output (the values' width: MLA's v_head_dim) and the float32 log-sum-exp per head and token."""
    heads = shape.config.num_attention_heads
    return tokens * heads * shape.v_head_dim * dtype_bytes, heads * tokens * 4


def kept_bytes(shape: ModelShape, tokens: int, dtype_bytes: int) -> int:
    """Device bytes one layer's attention keeps for one micro-batch of `tokens` (kept_parts)."""
    return sum(kept_parts(shape, tokens, dtype_bytes))

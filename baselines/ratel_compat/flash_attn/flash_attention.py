"""flash-attn 1.0.4's `flash_attn.flash_attention.FlashAttention` on `torch.nn.functional.scaled_dot_product_attention`.

Ratel's gpt_model.py builds `FlashAttention()` and calls it as `out, _ = attention(qkv)` with qkv packed
[batch, seq, 3, heads, head_dim]; this module keeps 1.0.4's signature and semantics:

- `causal` defaults to False, as in 1.0.4: Ratel's call passes none, so its attention is bidirectional;
- dropout `attention_dropout` applies in training mode only; `softmax_scale` None is head_dim ** -0.5;
- `key_padding_mask` [batch, seq] bool, True = keep: padded queries come back as zeros, padded keys are
  never attended to; `cu_seqlens` + `max_s` take unpadded qkv [total, 3, heads, head_dim];
- the return value is (output [batch, seq, heads, head_dim], None) (`need_weights` must stay False).

Unlike 1.0.4 it takes any dtype and device (SDPA picks its kernel: flash or memory-efficient for fp16 on
the GPU, the math kernel elsewhere), so it runs on the CPU too; numerics differ from flash-attn 1.x's
kernel only by rounding.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _attend(qkv: torch.Tensor, dropout_p: float, softmax_scale, causal: bool,
            key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """qkv [b, s, 3, h, d] -> [b, s, h, d]; key_mask [b, s] True where a key may be attended to."""
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))  # each [b, h, s, d]
    mask = None
    if key_mask is not None:
        mask = key_mask[:, None, None, :]  # [b, 1, 1, s], broadcast over heads and queries
        if causal:
            s = qkv.shape[1]
            mask = mask & torch.ones(s, s, dtype=torch.bool, device=qkv.device).tril()
            causal = False  # SDPA takes a mask or is_causal, not both
    scale = {} if softmax_scale is None else {"scale": softmax_scale}  # torch 2.0's SDPA has no `scale`
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=causal, **scale)
    return out.transpose(1, 2).contiguous()


class FlashAttention(nn.Module):
    def __init__(self, softmax_scale=None, attention_dropout=0.0, device=None, dtype=None):
        super().__init__()
        self.softmax_scale = softmax_scale
        self.dropout_p = attention_dropout

    def forward(self, qkv, key_padding_mask=None, causal=False, cu_seqlens=None, max_s=None, need_weights=False):
        assert not need_weights, "FlashAttention returns no attention weights (flash-attn 1.0.4 neither)"
        dropout_p = self.dropout_p if self.training else 0.0
        if cu_seqlens is not None:  # unpadded: [total, 3, h, d], sequence i is rows cu_seqlens[i]:cu_seqlens[i+1]
            assert max_s is not None, "cu_seqlens needs max_s (flash-attn 1.0.4 asserts it too)"
            bounds = cu_seqlens.tolist()
            pieces = [_attend(qkv[a:b].unsqueeze(0), dropout_p, self.softmax_scale, causal).squeeze(0)
                      for a, b in zip(bounds[:-1], bounds[1:])]
            return torch.cat(pieces), None
        if key_padding_mask is None:
            return _attend(qkv, dropout_p, self.softmax_scale, causal), None
        keep = key_padding_mask.to(torch.bool)
        out = _attend(qkv, dropout_p, self.softmax_scale, causal, keep)
        # a fully padded row has no key to attend to (SDPA gives NaN there); flash-attn pads it with zeros
        return out.masked_fill(~keep[:, :, None, None], 0.0), None

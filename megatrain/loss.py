"""Final norm, LM head and cross-entropy in token chunks, forward and backward together.

Logits never exist for more than `chunk` tokens at once: each chunk runs norm -> head ->
float32 logits -> summed cross-entropy and is differentiated at once, so memory is bounded by
chunk x vocab whatever the batch. Head-weight gradients accumulate across chunks in float32.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from megatrain.templates import Template

IGNORE = -100


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """Position t predicts token t+1 (the `transformers` causal-LM convention): [B, S] -> [B*S]."""
    pad = torch.full_like(labels[:, :1], IGNORE)
    return torch.cat([labels[:, 1:], pad], dim=1).reshape(-1)


def head_loss_and_grads(x: torch.Tensor, targets: torch.Tensor, active: list[bool], norm: Template,
                        w_norm: torch.Tensor, w_head: torch.Tensor, chunk: int, scale: float,
                        d_norm: torch.Tensor, d_head: torch.Tensor):
    """Summed loss over `targets`, and gradients of (loss * scale).

    x: [T, H] last hidden states; targets: [T] shifted labels on x's device; active[c]: whether
    chunk c holds any target (known on the host, so empty chunks cost nothing). The weight
    gradients are added into the float32 tensors `d_norm` and `d_head` (so micro-batches sum there).
    Returns (loss_sum, dx [T, H]).
    """
    dx = torch.zeros_like(x)
    loss = torch.zeros((), dtype=torch.float32, device=x.device)
    wn = w_norm.detach().requires_grad_()
    wh = w_head.detach().requires_grad_()
    module = norm.bind([wn])
    for c, lo in enumerate(range(0, x.shape[0], chunk)):
        if not active[c]:
            continue
        hi = min(x.shape[0], lo + chunk)
        xc = x[lo:hi].detach().requires_grad_()
        with torch.enable_grad():
            logits = F.linear(module(xc), wh).float()
            part = F.cross_entropy(logits, targets[lo:hi], ignore_index=IGNORE, reduction="sum")
            gx, gn, gh = torch.autograd.grad(part * scale, [xc, wn, wh])
        dx[lo:hi] = gx
        d_norm += gn
        d_head += gh
        loss += part.detach()
    return loss, dx


@torch.no_grad()
def head_loss(x: torch.Tensor, targets: torch.Tensor, norm: Template, w_norm: torch.Tensor,
              w_head: torch.Tensor, chunk: int) -> torch.Tensor:
    """Summed loss over `targets`, forward only (an evaluation): the same chunks as the step's."""
    loss = torch.zeros((), dtype=torch.float32, device=x.device)
    module = norm.bind([w_norm])
    for lo in range(0, x.shape[0], chunk):
        hi = min(x.shape[0], lo + chunk)
        if bool((targets[lo:hi] != IGNORE).any()):
            logits = F.linear(module(x[lo:hi]), w_head).float()
            loss += F.cross_entropy(logits, targets[lo:hi], ignore_index=IGNORE, reduction="sum")
    return loss

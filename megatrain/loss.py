"""Final norm, LM head and cross-entropy in token chunks, forward and backward together.

Logits never exist for more than `chunk` tokens at once: each chunk runs norm -> head ->
float32 logits -> summed cross-entropy and is differentiated at once, so memory is bounded by
chunk x vocab whatever the batch. Head-weight gradients accumulate across chunks in float32.

The cross-entropy itself is the step's largest elementwise work: the library's (eager) casts the
chunk's logits to float32, takes their log-softmax and differentiates both, about eight passes
over chunk x vocab (7B, 4096 x 151936: 2.5 GB in float32 each). `compiled` (engine.loss_kernel)
computes the loss and its gradient from the logits as they are, in float32 inside, with
torch.compile: a row reduction and one pass that writes the gradient in the logits' dtype; the
linear layer's backward then starts from that gradient. The same arithmetic in another order:
equal to rounding.

Gemma 2 soft-caps its logits (final_logit_softcapping c): c * tanh(logits / c) before the loss,
the library's ops on each chunk's logits; the compiled kernel then starts from the capped ones.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from megatrain.kernel_build import compiled as _compile
from megatrain.templates import Template

IGNORE = -100


def _cross_entropy_and_grad(logits: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor):
    """Summed cross-entropy of `logits` [T, V] against `targets` (IGNORE left out), and the
    gradient of (loss * scale) with respect to the logits, in their dtype; float32 inside."""
    z = logits.float()
    lse = torch.logsumexp(z, dim=1, keepdim=True)
    valid = (targets != IGNORE).unsqueeze(1)
    t = torch.where(valid, targets.unsqueeze(1), 0)
    loss = torch.where(valid, lse - z.gather(1, t), 0.0).sum()
    onehot = torch.arange(z.shape[1], device=z.device).unsqueeze(0) == t
    grad = torch.where(valid, (torch.exp(z - lse) - onehot.float()) * scale, 0.0)
    return loss, grad.to(logits.dtype)


_compiled_cross_entropy = _compile(_cross_entropy_and_grad)


def _capped(logits: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """The library's soft-capping of the final logits (Gemma), or the logits as they are."""
    if softcap is None:
        return logits
    return torch.tanh(logits / softcap) * softcap


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """Position t predicts token t+1 (the `transformers` causal-LM convention): [B, S] -> [B*S]."""
    pad = torch.full_like(labels[:, :1], IGNORE)
    return torch.cat([labels[:, 1:], pad], dim=1).reshape(-1)


def head_loss_and_grads(x: torch.Tensor, targets: torch.Tensor, active: list[bool], norm: Template,
                        w_norm: torch.Tensor, w_head: torch.Tensor, chunk: int, scale: float,
                        d_norm: torch.Tensor, d_head: torch.Tensor, compiled: bool = False,
                        softcap: float | None = None):
    """Summed loss over `targets`, and gradients of (loss * scale).

    x: [T, H] last hidden states; targets: [T] shifted labels on x's device; active[c]: whether
    chunk c holds any target (known on the host, so empty chunks cost nothing). The weight
    gradients are added into the float32 tensors `d_norm` and `d_head` (so micro-batches sum there).
    `compiled`: the cross-entropy and its gradient by the compiled kernel (engine.loss_kernel);
    `softcap`: the final logits' soft-capping (Gemma), None for none.
    Returns (loss_sum, dx [T, H]).
    """
    dx = torch.zeros_like(x)
    loss = torch.zeros((), dtype=torch.float32, device=x.device)
    wn = w_norm.detach().requires_grad_()
    wh = w_head.detach().requires_grad_()
    module = norm.bind([wn])
    scale_t = torch.full((), scale, dtype=torch.float32, device=x.device)  # a fill: no copy the host waits for
    for c, lo in enumerate(range(0, x.shape[0], chunk)):
        if not active[c]:
            continue
        hi = min(x.shape[0], lo + chunk)
        xc = x[lo:hi].detach().requires_grad_()
        with torch.enable_grad():
            logits = _capped(F.linear(module(xc), wh), softcap)
            if compiled:
                part, dlogits = _compiled_cross_entropy(logits.detach(), targets[lo:hi], scale_t)
                gx, gn, gh = torch.autograd.grad(logits, [xc, wn, wh], dlogits)
            else:
                part = F.cross_entropy(logits.float(), targets[lo:hi], ignore_index=IGNORE, reduction="sum")
                gx, gn, gh = torch.autograd.grad(part * scale, [xc, wn, wh])
        dx[lo:hi] = gx
        d_norm += gn
        d_head += gh
        loss += part.detach()
    return loss, dx


@torch.no_grad()
def head_loss(x: torch.Tensor, targets: torch.Tensor, norm: Template, w_norm: torch.Tensor,
              w_head: torch.Tensor, chunk: int, softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed loss over `targets`, and how many of them are the logits' argmax (the token
    accuracy's count), forward only (an evaluation): the same chunks as the step's."""
    loss = torch.zeros((), dtype=torch.float32, device=x.device)
    correct = torch.zeros((), dtype=torch.int64, device=x.device)
    module = norm.bind([w_norm])
    for lo in range(0, x.shape[0], chunk):
        hi = min(x.shape[0], lo + chunk)
        if bool((targets[lo:hi] != IGNORE).any()):
            logits = _capped(F.linear(module(x[lo:hi]), w_head), softcap).float()
            loss += F.cross_entropy(logits, targets[lo:hi], ignore_index=IGNORE, reduction="sum")
            correct += (logits.argmax(dim=1) == targets[lo:hi]).sum()  # IGNORE is never an argmax
    return loss, correct

"""The chunked head equals one unchunked cross-entropy, in value and gradients; the compiled
cross-entropy (engine.loss_kernel) is the library's loss to rounding."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatrain.shapes import ModelShape, load_hf_config
from megatrain.templates import Architecture
from megatrain.config import ModelConfig
from megatrain.loss import head_loss_and_grads, shift_labels


def test_chunked_head_equals_full_logits():
    shape = ModelShape(load_hf_config(ModelConfig(preset="tiny-llama")))
    arch = Architecture(shape)
    gen = torch.Generator().manual_seed(0)
    T, H, V = 37, shape.hidden, shape.vocab
    x = torch.randn(T, H, generator=gen)
    targets = torch.randint(0, V, (T,), generator=gen)
    targets[5:9] = -100
    w_norm = 1 + 0.1 * torch.randn(H, generator=gen)
    w_head = 0.05 * torch.randn(V, H, generator=gen)
    # reference: the whole logits matrix at once
    xr, wn, wh = (t.clone().requires_grad_() for t in (x, w_norm, w_head))
    normed = xr * torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + shape.config.rms_norm_eps) * wn
    ref = F.cross_entropy(F.linear(normed, wh), targets, ignore_index=-100, reduction="sum")
    (ref / 3).backward()
    for chunk in (5, 16, 1000):
        active = [bool((targets[lo: lo + chunk] != -100).any()) for lo in range(0, T, chunk)]
        dn, dh = torch.ones(H), torch.full((V, H), 2.0)  # the gradients are added to what is there
        loss, dx = head_loss_and_grads(x, targets, active, arch.norm_template(), w_norm, w_head, chunk, 1 / 3, dn, dh)
        torch.testing.assert_close(loss, ref.detach(), rtol=1e-6, atol=0)
        torch.testing.assert_close(dx, xr.grad, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(dn - 1, wn.grad, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(dh - 2, wh.grad, rtol=1e-5, atol=1e-6)


def test_shift_labels():
    labels = torch.tensor([[1, 2, 3], [4, -100, 6]])
    assert shift_labels(labels).tolist() == [2, 3, -100, -100, 6, -100]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_cross_entropy_is_the_library_loss_to_rounding(dtype):
    """engine.loss_kernel: compiled, the summed cross-entropy and the gradient of (loss * scale)
    with respect to the logits from one torch.compile'd function: the library's (float32 logits,
    F.cross_entropy and autograd) to float32 rounding, ignored targets and a chunk without any
    target included; the gradient in the logits' dtype."""
    import torch.nn.functional as F
    from megatrain.loss import IGNORE, _compiled_cross_entropy
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(23, 300, generator=gen) * 4).to(dtype)
    targets = torch.randint(0, 300, (23,), generator=gen)
    targets[::4] = IGNORE
    for t in (targets, torch.full_like(targets, IGNORE)):
        z = logits.clone().requires_grad_()
        want = F.cross_entropy(z.float(), t, ignore_index=IGNORE, reduction="sum")
        (want * 0.3).backward()
        loss, grad = _compiled_cross_entropy(logits, t, torch.tensor(0.3))
        assert loss.dtype == torch.float32 and grad.dtype == dtype
        torch.testing.assert_close(loss, want.detach(), rtol=1e-6, atol=1e-5)
        tol = 1e-6 if dtype == torch.float32 else 8e-3  # bf16: one rounding of the gradient
        torch.testing.assert_close(grad, z.grad, rtol=tol, atol=tol * max(z.grad.abs().max().item(), 1e-3))
        assert not grad[t == IGNORE].any()

"""A padded sliding-window batch (window 6: rows of padding queries that attend to nothing) through
each SDPA backend on a GPU, forward and backward in bf16, with the library's mask and with
`megatrain.templates.attending`'s: which backend gives a NaN, and whether the mask's change removes it.

    python experiments/probes/masked_rows.py
"""
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from megatrain.templates import attending

torch.manual_seed(0)
B, H, S, D, W = 4, 4, 64, 16, 6
lengths = torch.tensor([64, 40, 20, 9])
pos = torch.arange(S)
mask = ((pos[None, :] <= pos[:, None]) & (pos[:, None] - pos[None, :] < W))[None, None] & (pos[None, :] < lengths[:, None])[:, None, None, :]
used = (pos[None, :] < lengths[:, None]).cuda()[:, None, :, None]
for name, m in [("library", mask), ("attending", attending(mask))]:
    for be in [None, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH]:
        q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        try:
            with sdpa_kernel([be]) if be else torch.enable_grad():
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=m.cuda())
            (o * used).float().sum().backward()
            print(name, be.name if be else "default", "out nan", o.isnan().any().item(),
                  "grad nan", [t.grad.isnan().any().item() for t in (q, k, v)], flush=True)
        except Exception as e:
            print(name, be.name if be else "default", "unavailable:", str(e)[:120], flush=True)

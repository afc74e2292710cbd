"""The first call's cost of SDPA with a packed rows' boolean mask at each new width, forward and
backward, Qwen2.5-3B's heads (4 rows, 16 heads of 128, bf16): the 12 widths of README's fine-tuning
example's batches and the first three again, with the default backends, then the memory-efficient
and cuDNN ones alone; last, `causal`, no mask but is_causal, the default backends (rows all of one
length, which the data leaves unpadded). Why padded batches are padded to `data.pad_to_multiple_of`.

    python experiments/probes/sdpa_widths.py OUT.json
"""
import json
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

WIDTHS = [2021, 2034, 2046, 1969, 2040, 1998, 2045, 2026, 2018, 2010, 2028, 2008]  # the example's 12 steps


def mask(s: int) -> torch.Tensor:
    """Causal within examples of 300 tokens, none across them."""
    doc = torch.arange(s, device="cuda") // 300
    causal = torch.ones(s, s, dtype=torch.bool, device="cuda").tril()
    return (causal & (doc[:, None] == doc[None, :]))[None, None].expand(4, 1, s, s)


def first_call(s: int, masked: bool = True) -> tuple[int, float, float]:
    """(width, forward seconds, backward seconds)."""
    q, k, v = (torch.randn(4, 16, s, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    m = mask(s) if masked else None
    torch.cuda.synchronize()
    t = time.perf_counter()
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=not masked)
    torch.cuda.synchronize()
    f = time.perf_counter() - t
    t = time.perf_counter()
    o.sum().backward()
    torch.cuda.synchronize()
    return s, round(f, 4), round(time.perf_counter() - t, 4)


out = {"torch": torch.__version__, "cudnn": torch.backends.cudnn.version()}
for name, backend in [("default", None), ("efficient", SDPBackend.EFFICIENT_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)]:
    with sdpa_kernel([backend]) if backend else torch.enable_grad():
        out[name] = [first_call(s) for s in WIDTHS + WIDTHS[:3]]
    print(name, out[name], flush=True)
out["causal"] = [first_call(s + 1, masked=False) for s in WIDTHS + WIDTHS[:3]]  # widths not seen above
print("causal", out["causal"], flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)

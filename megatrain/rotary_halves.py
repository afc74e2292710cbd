"""GPT-OSS's rotary (rotary.py's `halves` form) as one Triton program a block of tokens, each way.

Each half of a head's width rotated by the other with cos and sin of half the width:
cat(x1 cos - x2 sin, x2 cos + x1 sin), and back cat(g1 cos + g2 sin, g2 cos + (-g1) sin), each
product and sum rounded to the dtype where the library's ops round it, with Triton's fusing of a
product and a sum into one multiply-add off (as inductor's emulate_precision_casts has it): the
library's numbers to the bit, as the compiled kernel gives them. Inductor's build of that function
ran at about 1.2 TB/s on the H200 (GPT-OSS-20B's queries, 64 heads of 64, at 8 x 4096 tokens), the
Llama form's at 3.3: here a program reads a block of tokens' rows whole (every head's two halves)
and each token's cos and sin once for all its heads (docs/moe.md: 1.5 -> 0.95 ms a layer).

It takes rows as the engine's projections make them: (batch, tokens, heads, width) contiguous, cos
and sin (batch or 1, tokens, 1, width / 2) in any strides (the library's GPT-OSS rotary makes them
tokens-fastest: its frequencies are a transposed product); `runs` says whether a call can, else
rotary.py's compiled kernel runs.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU build of torch comes without Triton
    triton = None

TOKENS = 4  # tokens a program (every head of each)
# the dtypes it takes (the GPU test's); float32 layers take the compiled kernel
HALF_DTYPES = (torch.bfloat16, torch.float16)

if triton is not None:
    @triton.jit
    def _halves_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, tokens, seq, cos_batch, cos_token, cos_width,
                       HEADS: tl.constexpr, HALF: tl.constexpr, BACKWARD: tl.constexpr, BLOCK_T: tl.constexpr):
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        h = tl.arange(0, HEADS)
        j = tl.arange(0, HALF)
        tmask = t < tokens
        t64 = t.to(tl.int64)
        row = t64[:, None, None] * (HEADS * 2 * HALF) + h[None, :, None] * (2 * HALF) + j[None, None, :]
        mask = tmask[:, None, None] & (h < HEADS)[None, :, None] & (j < HALF)[None, None, :]
        trig = (t64 // seq * cos_batch + t64 % seq * cos_token)[:, None, None] + j[None, None, :] * cos_width
        tmask3 = tmask[:, None, None] & (j < HALF)[None, None, :]
        x1 = tl.load(x_ptr + row, mask=mask, other=0.0)
        x2 = tl.load(x_ptr + row + HALF, mask=mask, other=0.0)
        dtype = x1.dtype
        c = tl.load(cos_ptr + trig, mask=tmask3, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + trig, mask=tmask3, other=0.0).to(tl.float32)
        a, b = x1.to(tl.float32), x2.to(tl.float32)
        # each product, then the sum, rounded to the dtype: the library's ops
        if BACKWARD:  # cat(g1 cos + g2 sin, g2 cos + (-g1) sin)
            y1 = ((a * c).to(dtype).to(tl.float32) + (b * s).to(dtype).to(tl.float32)).to(dtype)
            y2 = ((b * c).to(dtype).to(tl.float32) + (-a * s).to(dtype).to(tl.float32)).to(dtype)
        else:  # cat(x1 cos - x2 sin, x2 cos + x1 sin)
            y1 = ((a * c).to(dtype).to(tl.float32) - (b * s).to(dtype).to(tl.float32)).to(dtype)
            y2 = ((b * c).to(dtype).to(tl.float32) + (a * s).to(dtype).to(tl.float32)).to(dtype)
        tl.store(out_ptr + row, y1, mask=mask)
        tl.store(out_ptr + row + HALF, y2, mask=mask)


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def runs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether the kernel takes x (batch, tokens, heads, width), contiguous on a GPU, bf16 or fp16,
    with cos and sin (batch or 1, tokens, 1, width / 2) of x's dtype (else the library's products
    widen) and the same strides, the heads and half the width powers of two."""
    if triton is None or not x.is_cuda or x.dim() != 4 or not x.is_contiguous() or x.dtype not in HALF_DTYPES:
        return False
    B, S, H, D = x.shape
    return (_power_of_two(H) and D % 2 == 0 and _power_of_two(D // 2) and cos.shape == sin.shape
            and cos.dim() == 4 and cos.shape[1:] == (S, 1, D // 2) and cos.shape[0] in (1, B)
            and cos.stride() == sin.stride() and cos.dtype == sin.dtype == x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool = False) -> torch.Tensor:
    """rotary._rotate_halves(x, cos, sin) (backward: _rotate_halves_grad, x the output's gradient),
    where `runs`."""
    B, S, H, D = x.shape
    out = torch.empty_like(x)
    batch_stride = cos.stride(0) if cos.shape[0] == B and B > 1 else 0
    _halves_kernel[(triton.cdiv(B * S, TOKENS),)](
        x, cos, sin, out, B * S, S, batch_stride, cos.stride(1), cos.stride(3), HEADS=H, HALF=D // 2, BACKWARD=backward,
        BLOCK_T=TOKENS, enable_fp_fusion=False)  # a product fused into a sum's multiply-add skips its rounding
    return out

"""Rows gathered by index, out[r] = x[index[r]]: the lean experts' tokens copied into expert order
(lean_experts._ToExperts), forward and recompute.

torch's advanced index copies element by element; here a Triton program copies a block of rows by a
block of columns, each row's source read once a row. A copy: the same bits as torch's. On the CPU
(and where Triton is not installed) torch's index.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU build of torch comes without Triton
    triton = None

ROWS, COLUMNS, WARPS = 16, 128, 4  # a program's block (experiments/probes/expert_rows.py)

if triton is not None:
    @triton.jit
    def _gather_kernel(x_ptr, index_ptr, out_ptr, rows, width, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        rmask = r < rows
        source = tl.load(index_ptr + r, mask=rmask, other=0).to(tl.int64)
        mask = rmask[:, None] & (c < width)[None, :]
        v = tl.load(x_ptr + source[:, None] * width + c[None, :], mask=mask)
        tl.store(out_ptr + r.to(tl.int64)[:, None] * width + c[None, :], v, mask=mask)


def gather(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x[index] for a 2-D x and a 1-D index."""
    if triton is None or not x.is_cuda or x.dim() != 2 or not x.is_contiguous():
        return x[index]
    rows, width = index.numel(), x.shape[1]
    out = x.new_empty(rows, width)
    _gather_kernel[(triton.cdiv(rows, ROWS), triton.cdiv(width, COLUMNS))](
        x, index, out, rows, width, BLOCK_R=ROWS, BLOCK_C=COLUMNS, num_warps=WARPS)
    return out

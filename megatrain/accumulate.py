"""A layer's weight gradient of one micro-batch added into its float32 step gradient.

    add_into(acc, grad)       acc += grad, acc float32, grad the layer's dtype (bf16 on a GPU)
    copy_into(acc, grad)      acc = grad: the first micro-batch's, where the sum starts
    add_rows(table, ids, rows)  table[ids[i]] += rows[i]: the embedding's gradient, in a fixed order

Each micro-batch's backward adds every weight gradient of the layer into the layer's float32
accumulator: 4 + 2 + 4 bytes a parameter read and written, on the device, once a micro-batch.
torch's add of a bf16 tensor into a float32 one takes its mixed-dtype path (each element cast as it
is loaded, not the vectorised loads of one dtype): on the H200, over GPT-OSS-120B's 3.2 B layer
parameters, 11.45 ms at 2.8 TB/s, where a float32 add of float32 moves 4.4 (docs/decisions.md,
"The step gradient's add by a Triton kernel"). On a GPU it is a Triton kernel of plain vector
loads (contiguous pairs; another layout takes torch's add): 7.60 ms there. The arithmetic is the
same, one float32 rounding of acc + float(grad), so the sum is the library's to the bit.
torch.compile's build of the same add ran at 1.1 TB/s. On the CPU (and where Triton is not
installed) torch's add. A step's first micro-batch copies its gradient in (copy_into, a kernel of
the same form: 6 bytes a parameter, 4.68 ms over that layer, where zeroing and adding took 2.78 and
7.59; torch's copy of bf16 into float32 takes the mixed-dtype path too, 8.96 ms): the add to zeros
but for a -0.0, which the copy keeps, as the library's first micro-batch's gradient keeps it.

The embedding's gradient adds each token's row into its id's row, ids repeating. torch's index_add_
on a GPU adds them with atomics, in whatever order the threads reach a row, so two runs of one step
can part by a rounding in a repeated token's row (the test's DeepSeek-V2 runs did, in some runs of
the GPU test file and not others: docs/log.md, 2026-11-30). On a GPU add_rows is index_put_'s
accumulation, which sorts the ids (stably) and adds each id's rows in their order, one after the
other; on the CPU index_add_, serial in the ids' order (its index_put_ orders them otherwise).
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU build of torch comes without Triton
    triton = None

BLOCK = 2048  # elements a program: eight a thread at 8 warps, one 16-byte load of bf16

if triton is not None:
    @triton.jit
    def _add_kernel(acc_ptr, grad_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # past 2**31 elements too
        mask = offs < n
        acc = tl.load(acc_ptr + offs, mask=mask)
        grad = tl.load(grad_ptr + offs, mask=mask)
        tl.store(acc_ptr + offs, acc + grad.to(tl.float32), mask=mask)

    @triton.jit
    def _copy_kernel(acc_ptr, grad_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(acc_ptr + offs, tl.load(grad_ptr + offs, mask=mask).to(tl.float32), mask=mask)


def _kernel_runs(acc: torch.Tensor, grad: torch.Tensor) -> bool:
    return triton is not None and acc.is_cuda and acc.is_contiguous() and grad.is_contiguous()


def add_into(acc: torch.Tensor, grad: torch.Tensor) -> None:
    """acc += grad (acc float32, of grad's shape): the Triton kernel on a GPU, torch's add elsewhere."""
    if not _kernel_runs(acc, grad):
        acc.add_(grad)
        return
    n = acc.numel()
    _add_kernel[(triton.cdiv(n, BLOCK),)](acc, grad, n, BLOCK=BLOCK, num_warps=8)


def copy_into(acc: torch.Tensor, grad: torch.Tensor) -> None:
    """acc = grad (acc float32, of grad's shape), a zeroed acc's add but for a -0.0 (kept, where 0 + -0
    is +0): the Triton kernel on a GPU, torch's copy elsewhere."""
    if not _kernel_runs(acc, grad):
        acc.copy_(grad)
        return
    n = acc.numel()
    _copy_kernel[(triton.cdiv(n, BLOCK),)](acc, grad, n, BLOCK=BLOCK, num_warps=8)


def add_rows(table: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor) -> None:
    """table[ids[i]] += rows[i] for each i in the ids' order, the same sum in every run."""
    if table.is_cuda:
        table.index_put_((ids,), rows, accumulate=True)
    else:
        table.index_add_(0, ids, rows)

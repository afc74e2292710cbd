"""GPT-OSS's experts' biases inside the kernels around them: one Triton kernel each way.

After the grouped GEMM of the gate-and-up projection, GPT-OSS adds each row's expert's bias and
applies its clamped gate, (clamp(up) + 1) * g sigmoid(1.702 g) with g = clamp(gate), over the
interleaved halves of the row; after the down projection's, it adds that projection's bias before
the router's weighting sums each token's rows. The lean experts' compiled path (lean_experts.py)
adds each bias by a pass of its own over the routed rows (rows x 2 x the expert's width for the up
projection: 1.5 GB at 8 x 4096 tokens of GPT-OSS-20B), which the next kernel reads back. Adding the
biases inside inductor's gate and weighting kernels was slower than those passes (docs/moe.md).
Here Triton kernels read the unbiased rows and the biases:
- `gate`: the gate's output, a block of rows by a block of columns a program, each row's expert
  read once a row, its bias row from the cache; `gate_backward`: the rows' gradient from the down
  projection's input gradient before the router's weight (`through`, lean_experts._DownCombine),
  that weight applied and rounded as the weighting's backward rounds it, each row's <through, h>
  (h the gate's output, computed again from the rows as the forward computes it), the router
  weight's gradient's term, h times the router's weight, which the down projection's weight's
  gradient takes in place of the weighted gradient (the gate's output gradient is never written,
  nor h kept from the forward), and the up projection's bias's gradient;
- `combine`: each token's rows, biased, weighted by the router and summed (its backward, which
  reads no row, is the lean experts': lean_experts._DownCombine); `rows_and_bias_dots`: that
  backward's rows, each its token's gradient, gathered with each one's <g, b> (the router weight's
  gradient's bias term) and the down projection's bias's gradient;
- `expert_sums`: each expert's rows summed, a bias's gradient by a pass of its own.
The backward's two kernels take the rows by an expert-aligned schedule (`_chunk`: each expert's
rows in chunks from its first, made on the device from the routing's counts, so no chunk holds two
experts' rows): a program, one chunk by a block of columns, loads its expert's bias once and sums
its chunk's rows as it writes them, and one small pass sums each expert's chunks, in the same order
on every run. The biases' gradients need no pass over the rows of their own (on the H200 at
GPT-OSS-20B's 8 x 4096 tokens, the two passes took about 0.6 ms: docs/moe.md).
The biased rows are never written. The arithmetic: each bias added and rounded to the rows' dtype
as the library's add rounds it, the rest in float32, rounded once, as the compiled passes do (equal
to rounding, not bit for bit, against the library's bf16 ops).

On the CPU (and where Triton is not installed) `runs` is False: the lean experts' own passes.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU build of torch comes without Triton
    triton = None

BLOCK_R, BLOCK_C = 16, 64  # rows (tokens) and output columns a program (the gate's input: 2 x BLOCK_C columns)
# the gate's backward and the backward's rows: rows a chunk, rows a step, columns a program, warps (expert_rows.py,
# GPT-OSS-20B's: the gate's 1.69-1.77 ms with its bias's sums, 2.09-2.15 with a pass of their own; the rows' 0.61-0.76)
BACKWARD = 512, 8, 64, 4
ROWS_DOTS = 512, 16, 128, 4
SUM_R, SUM_C = 128, 64  # the experts' sums: rows a step, columns a program (experiments/probes/expert_rows.py)

if triton is not None:
    @triton.jit
    def _tiles(pid_r, pid_c, rows, width, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
        c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
        c2 = pid_c * 2 * BLOCK_C + tl.arange(0, 2 * BLOCK_C)
        return r, c, c2, r < rows, c < width, c2 < 2 * width

    @triton.jit
    def _biased(y_ptr, b_ptr, ids_ptr, r, c2, rmask, c2mask, width, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        """The tile's gate and up halves, bias added and rounded to the rows' dtype, in float32."""
        mask = rmask[:, None] & c2mask[None, :]
        e = tl.load(ids_ptr + r, mask=rmask, other=0).to(tl.int64)
        y = tl.load(y_ptr + r.to(tl.int64)[:, None] * (2 * width) + c2[None, :], mask=mask, other=0.0)
        b = tl.load(b_ptr + e[:, None] * (2 * width) + c2[None, :], mask=mask, other=0.0)
        x = (y.to(tl.float32) + b.to(tl.float32)).to(y.dtype).to(tl.float32)
        return tl.split(tl.reshape(x, (BLOCK_R, BLOCK_C, 2)))

    @triton.jit
    def _forward_kernel(y_ptr, b_ptr, ids_ptr, h_ptr, rows, width, limit, alpha,
                        BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        r, c, c2, rmask, cmask, c2mask = _tiles(tl.program_id(0), tl.program_id(1), rows, width, BLOCK_R, BLOCK_C)
        gate, up = _biased(y_ptr, b_ptr, ids_ptr, r, c2, rmask, c2mask, width, BLOCK_R, BLOCK_C)
        g = tl.minimum(gate, limit)
        u = tl.minimum(tl.maximum(up, -limit), limit)
        h = (u + 1) * (g * tl.sigmoid(g * alpha))
        tl.store(h_ptr + r.to(tl.int64)[:, None] * width + c[None, :], h.to(h_ptr.dtype.element_ty),
                 mask=rmask[:, None] & cmask[None, :])

    @triton.jit
    def _chunk(ends_ptr, chunk_ends_ptr, p, experts, EXPERTS: tl.constexpr, CHUNK: tl.constexpr):
        """Chunk p of the rows' expert-aligned schedule: each expert's rows (sorted, `ends` the running
        counts) in chunks of CHUNK from its first, `chunk_ends` the running count of chunks. -> its
        expert and its rows [start, end); past the last chunk, the last expert and no rows."""
        k = tl.arange(0, EXPERTS)
        e = tl.sum((tl.load(chunk_ends_ptr + k, mask=k < experts, other=p + 1) <= p).to(tl.int32))
        inside = e < experts
        e = tl.minimum(e, experts - 1)
        first = tl.load(chunk_ends_ptr + e - 1, mask=e > 0, other=0)
        start = tl.load(ends_ptr + e - 1, mask=e > 0, other=0) + (p - first) * CHUNK
        end = tl.where(inside, tl.minimum(start + CHUNK, tl.load(ends_ptr + e)), 0)
        return e, start, end

    @triton.jit
    def _backward_kernel(y_ptr, b_ptr, t_ptr, w_ptr, dy_ptr, dots_ptr, hw_ptr, sums_ptr, ends_ptr, chunk_ends_ptr,
                         rows, width, experts, limit, alpha, EXPERTS: tl.constexpr, CHUNK: tl.constexpr,
                         STEP: tl.constexpr, BLOCK_C: tl.constexpr, SUMS: tl.constexpr):
        """A chunk of one expert's rows (_chunk) by a block of columns, STEP rows a step. From `through`
        (t) and each row's router weight (w): the gate's output gradient t w, rounded to the rows'
        dtype, taken back through the gate into dy; the block's part of each row's <t, h>, float32,
        into dots (column blocks, rows); h w, rounded, into hw; with SUMS, the chunk's dy rows summed
        (float32) into sums (chunks, columns), the bias's gradient's part."""
        p, pc = tl.program_id(0), tl.program_id(1)
        e, start, end = _chunk(ends_ptr, chunk_ends_ptr, p, experts, EXPERTS, CHUNK)
        c = pc * BLOCK_C + tl.arange(0, BLOCK_C)
        c2 = pc * 2 * BLOCK_C + tl.arange(0, 2 * BLOCK_C)
        cmask, c2mask = c < width, c2 < 2 * width
        b = tl.load(b_ptr + e.to(tl.int64) * (2 * width) + c2, mask=c2mask, other=0.0).to(tl.float32)
        total = tl.zeros((STEP, 2 * BLOCK_C), dtype=tl.float32)
        for r0 in range(start, end, STEP):
            r = r0 + tl.arange(0, STEP)
            rmask = r < end
            r64 = r.to(tl.int64)
            y = tl.load(y_ptr + r64[:, None] * (2 * width) + c2[None, :], mask=rmask[:, None] & c2mask[None, :],
                        other=0.0)
            x = (y.to(tl.float32) + b[None, :]).to(y.dtype).to(tl.float32)
            gate, up = tl.split(tl.reshape(x, (STEP, BLOCK_C, 2)))
            t = tl.load(t_ptr + r64[:, None] * width + c[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0)
            w = tl.load(w_ptr + r, mask=rmask, other=0.0).to(tl.float32)
            d = (t.to(tl.float32) * w[:, None]).to(t.dtype).to(tl.float32)
            g = tl.minimum(gate, limit)
            u = tl.minimum(tl.maximum(up, -limit), limit)
            sig = tl.sigmoid(g * alpha)
            h = ((u + 1) * (g * sig)).to(t.dtype).to(tl.float32)
            tl.store(dots_ptr + pc.to(tl.int64) * rows + r64, tl.sum(t.to(tl.float32) * h, axis=1), mask=rmask)
            tl.store(hw_ptr + r64[:, None] * width + c[None, :], (h * w[:, None]).to(hw_ptr.dtype.element_ty),
                     mask=rmask[:, None] & cmask[None, :])
            d_gate = tl.where(gate <= limit, d * (u + 1) * sig * (1 + alpha * g * (1 - sig)), 0.0)  # clamp passes where it did not clip
            d_up = tl.where((up >= -limit) & (up <= limit), d * g * sig, 0.0)
            dy = tl.reshape(tl.join(d_gate, d_up), (STEP, 2 * BLOCK_C)).to(dy_ptr.dtype.element_ty)
            tl.store(dy_ptr + r64[:, None] * (2 * width) + c2[None, :], dy, mask=rmask[:, None] & c2mask[None, :])
            if SUMS:
                total += dy.to(tl.float32)  # rows past the chunk's end: t 0, so d and dy 0
        if SUMS:
            tl.store(sums_ptr + p.to(tl.int64) * (2 * width) + c2, tl.sum(total, axis=0), mask=c2mask)

    @triton.jit
    def _rows_dots_kernel(g_ptr, tokens_ptr, b_ptr, w_ptr, out_ptr, dots_ptr, sums_ptr, ends_ptr, chunk_ends_ptr,
                          rows, width, experts, EXPERTS: tl.constexpr, CHUNK: tl.constexpr, STEP: tl.constexpr,
                          BLOCK_C: tl.constexpr, SUMS: tl.constexpr):
        """A chunk of one expert's rows (_chunk) by a block of columns, STEP rows a step: each row its
        token's gradient (g[tokens]), copied; the block's part of the row's <g, its expert's bias>,
        float32, into dots (column blocks, rows); with SUMS, the chunk's rows, each times its weight
        (w) rounded to the rows' dtype, summed (float32) into sums (chunks, columns)."""
        p, pc = tl.program_id(0), tl.program_id(1)
        e, start, end = _chunk(ends_ptr, chunk_ends_ptr, p, experts, EXPERTS, CHUNK)
        c = pc * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = c < width
        b = tl.load(b_ptr + e.to(tl.int64) * width + c, mask=cmask, other=0.0).to(tl.float32)
        total = tl.zeros((STEP, BLOCK_C), dtype=tl.float32)
        for r0 in range(start, end, STEP):
            r = r0 + tl.arange(0, STEP)
            rmask = r < end
            mask = rmask[:, None] & cmask[None, :]
            t = tl.load(tokens_ptr + r, mask=rmask, other=0).to(tl.int64)
            g = tl.load(g_ptr + t[:, None] * width + c[None, :], mask=mask, other=0.0)
            tl.store(out_ptr + r.to(tl.int64)[:, None] * width + c[None, :], g, mask=mask)
            tl.store(dots_ptr + pc.to(tl.int64) * rows + r, tl.sum(g.to(tl.float32) * b[None, :], axis=1), mask=rmask)
            if SUMS:
                w = tl.load(w_ptr + r, mask=rmask, other=0.0).to(tl.float32)
                total += (g.to(tl.float32) * w[:, None]).to(g.dtype).to(tl.float32)
        if SUMS:
            tl.store(sums_ptr + p.to(tl.int64) * width + c, tl.sum(total, axis=0), mask=cmask)

    @triton.jit
    def _row_bias(y_ptr, b_ptr, ids_ptr, p, c, mask, tmask, width):
        """Rows p (expert order) at columns c, their expert's bias added and rounded, in float32."""
        e = tl.load(ids_ptr + p, mask=tmask, other=0).to(tl.int64)
        y = tl.load(y_ptr + p.to(tl.int64)[:, None] * width + c[None, :], mask=mask, other=0.0)
        b = tl.load(b_ptr + e[:, None] * width + c[None, :], mask=mask, other=0.0)
        return (y.to(tl.float32) + b.to(tl.float32)).to(y.dtype).to(tl.float32)

    @triton.jit
    def _expert_sums_kernel(rows_ptr, ends_ptr, out_ptr, width, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        """Expert program_id(0)'s rows (between the previous expert's end and its own) summed over a
        block of columns, in float32, a block of rows a step: the same order on every run."""
        e = tl.program_id(0)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = c < width
        start = tl.load(ends_ptr + e - 1, mask=e > 0, other=0)
        end = tl.load(ends_ptr + e)
        total = tl.zeros((BLOCK_C,), dtype=tl.float32)
        for r0 in range(start, end, BLOCK_R):
            r = r0 + tl.arange(0, BLOCK_R)
            x = tl.load(rows_ptr + r.to(tl.int64)[:, None] * width + c[None, :],
                        mask=(r < end)[:, None] & cmask[None, :], other=0.0)
            total += tl.sum(x.to(tl.float32), axis=0)
        tl.store(out_ptr + e.to(tl.int64) * width + c, total.to(out_ptr.dtype.element_ty), mask=cmask)

    @triton.jit
    def _combine_kernel(y_ptr, b_ptr, ids_ptr, picks_ptr, w_ptr, out_ptr, tokens, width, K: tl.constexpr,
                        BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        t = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        tmask = t < tokens
        mask = tmask[:, None] & (c < width)[None, :]
        t64 = t.to(tl.int64)
        p = tl.load(picks_ptr + t64 * K, mask=tmask, other=0)
        w = tl.load(w_ptr + t64 * K, mask=tmask, other=0.0).to(tl.float32)
        total = _row_bias(y_ptr, b_ptr, ids_ptr, p, c, mask, tmask, width) * w[:, None]
        for j in tl.static_range(1, K):
            p = tl.load(picks_ptr + t64 * K + j, mask=tmask, other=0)
            w = tl.load(w_ptr + t64 * K + j, mask=tmask, other=0.0).to(tl.float32)
            total = total + _row_bias(y_ptr, b_ptr, ids_ptr, p, c, mask, tmask, width) * w[:, None]
        tl.store(out_ptr + t64[:, None] * width + c[None, :], total.to(out_ptr.dtype.element_ty), mask=mask)


def expert_sums(rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Each expert's rows summed (rows in expert order, `counts` of them each), float32 inside: a
    bias's gradient. Where the kernels run, a program per expert and block
    of columns adds its rows block by block (torch's segment sum took 0.6 ms for either of
    GPT-OSS-20B's at 8 x 4096 tokens on the H200, 2.4 and 1.3 TB/s); elsewhere torch's segment sum, told its lengths are valid (they
    are the routing's own counts: checking them reads two device values on the host, a wait for the
    device in every layer's backward), over float32 rows (it adds in the rows' dtype: bf16 sums of
    500 rows parted from the exact by 3%)."""
    if not runs(rows):
        return torch.segment_reduce(rows.float(), "sum", lengths=counts, axis=0, unsafe=True).to(rows.dtype)
    return _segment_sums(rows, counts.cumsum(0), rows.dtype)


def _segment_sums(rows: torch.Tensor, ends: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The rows of each segment (`ends` their running counts) summed in float32, block by block,
    into `dtype`: the same order on every run."""
    width = rows.shape[1]
    out = torch.empty(ends.numel(), width, dtype=dtype, device=rows.device)
    _expert_sums_kernel[(ends.numel(), triton.cdiv(width, SUM_C))](rows, ends, out, width, BLOCK_R=SUM_R,
                                                                   BLOCK_C=SUM_C)
    return out


def runs(rows: torch.Tensor) -> bool:
    """Whether the kernels take these rows (a GPU's, contiguous, with Triton)."""
    return triton is not None and rows.is_cuda and rows.is_contiguous()


def _grid(rows: int, width: int) -> tuple[int, int]:
    return triton.cdiv(rows, BLOCK_R), triton.cdiv(width, BLOCK_C)


def gate(y: torch.Tensor, bias: torch.Tensor, ids: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """y (rows in expert order, 2 w: gate and up interleaved, no bias yet), the up projection's bias
    (experts, 2 w) and each row's expert `ids` (sorted) -> the clamped gate of y + bias[ids] (rows, w)."""
    rows, width = y.shape[0], y.shape[1] // 2
    h = y.new_empty(rows, width)
    _forward_kernel[_grid(rows, width)](y, bias.contiguous(), ids, h, rows, width, limit, alpha,
                                        BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C)
    return h


def gate_backward(y: torch.Tensor, bias: torch.Tensor, counts: torch.Tensor, through: torch.Tensor,
                  row_weights: torch.Tensor, limit: float, alpha: float, sums: bool, shape: tuple | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`gate`'s inputs (the rows' experts by their `counts`) and, from the down projection, each row's
    gradient through it before the router's weight (`through`, rows x w) and that weight -> y's
    gradient, each row's <through, gate's output> in float32, the gate's output times the row's
    weight (rows x w, rounded once: the down projection's weight's gradient takes it, so the forward
    keeps no output) and, with `sums`, the bias's gradient (each expert's rows of y's gradient summed,
    float32 inside). `shape`: the launch's (CHUNK, STEP, BLOCK_C, warps) in place of BACKWARD's."""
    chunk, step, block_c, warps = shape or BACKWARD
    rows, width = y.shape[0], y.shape[1] // 2
    experts = counts.numel()
    d_y = torch.empty_like(y)
    h_w = through.new_empty(rows, width)
    grid = triton.cdiv(rows, chunk) + experts, triton.cdiv(width, block_c)
    dots = torch.empty(grid[1], rows, dtype=torch.float32, device=y.device)
    ends, chunk_ends = counts.cumsum(0), ((counts + chunk - 1) // chunk).cumsum(0)
    partial = torch.empty(grid[0], 2 * width, dtype=torch.float32, device=y.device) if sums else dots
    _backward_kernel[grid](y, bias.contiguous(), through.contiguous(), row_weights.contiguous(), d_y, dots, h_w,
                           partial, ends, chunk_ends, rows, width, experts, limit, alpha,
                           EXPERTS=triton.next_power_of_2(experts), CHUNK=chunk, STEP=step, BLOCK_C=block_c,
                           SUMS=sums, num_warps=warps)
    return d_y, dots.sum(dim=0), h_w, _segment_sums(partial, chunk_ends, y.dtype) if sums else None


def rows_and_bias_dots(grad: torch.Tensor, tokens: torch.Tensor, bias: torch.Tensor, counts: torch.Tensor,
                       row_weights: torch.Tensor, sums: bool, shape: tuple | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Each row's gradient, its token's (grad[tokens], rows in expert order, `counts` of them each
    expert's: a copy, torch's bits), that dotted with its expert's bias, float32 (the router
    weight's gradient's bias term) and, with `sums`, the bias's gradient (each expert's rows times
    their `row_weights`, each product rounded, summed in float32), in the pass that gathers the
    rows. `shape`: the launch's (CHUNK, STEP, BLOCK_C, warps) in place of ROWS_DOTS's."""
    chunk, step, block_c, warps = shape or ROWS_DOTS
    rows, width, experts = tokens.numel(), grad.shape[1], counts.numel()
    out = grad.new_empty(rows, width)
    grid = triton.cdiv(rows, chunk) + experts, triton.cdiv(width, block_c)
    dots = torch.empty(grid[1], rows, dtype=torch.float32, device=grad.device)
    ends, chunk_ends = counts.cumsum(0), ((counts + chunk - 1) // chunk).cumsum(0)
    partial = torch.empty(grid[0], width, dtype=torch.float32, device=grad.device) if sums else dots
    _rows_dots_kernel[grid](grad, tokens, bias.contiguous(), row_weights.contiguous(), out, dots, partial, ends,
                            chunk_ends, rows, width, experts, EXPERTS=triton.next_power_of_2(experts), CHUNK=chunk,
                            STEP=step, BLOCK_C=block_c, SUMS=sums, num_warps=warps)
    return out, dots.sum(dim=0), _segment_sums(partial, chunk_ends, grad.dtype) if sums else None


def combine(y: torch.Tensor, bias: torch.Tensor, ids: torch.Tensor, picks: torch.Tensor,
            weights: torch.Tensor) -> torch.Tensor:
    """Each token's k rows (y in expert order, `picks` (tokens, k) their rows, `ids` each row's
    expert), their expert's bias added, weighted by `weights` (tokens, k) and summed: (tokens, h)."""
    tokens, k = picks.shape
    width = y.shape[1]
    out = y.new_empty(tokens, width)
    _combine_kernel[(triton.cdiv(tokens, BLOCK_R), triton.cdiv(width, BLOCK_C))](
        y, bias.contiguous(), ids, picks.contiguous(), weights.contiguous(), out, tokens, width, K=k,
        BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C)
    return out


"""A mixture of experts' experts without expert parallelism's work (engine.experts_kernel: lean).

The library's grouped-GEMM experts (`grouped_mm_experts_forward` of transformers.integrations.moe)
sort the step's (token, pick) rows by expert, gather the tokens' hidden states into that order, run
the up projection, the gate and the down projection as grouped GEMMs over each expert's rows, weight
the rows by the router and put them back in token order, summing each token's picks. Around that it
does work this engine never needs, and autograd takes costly routes back:
- three masked fills and a comparison for expert parallelism's sentinel rows (picks of experts on
  another device), which a run without expert parallelism never has: the largest single kernel of a
  Qwen3-30B-A3B layer on the H200 (16% of its time, docs/decisions.md, "The lean experts");
- the tokens' gather `x[perm // k]`, whose backward is a scatter with accumulation (autograd's
  index backward: a sort and a serial add per duplicate);
- the experts' biases gathered per row (GPT-OSS), `b[expert]`, whose backward scatters every row
  into its expert's few rows with accumulation (10% of a GPT-OSS-20B layer's time with the gather's).
Here the same arithmetic, the library's grouped GEMMs (`_grouped_linear`) and gate, with those three
done as their adjoints are: the gather's backward gathers through the inverse permutation and sums
each token's k rows (the forward's own way back to token order), the bias's backward is a segment
sum over each expert's contiguous rows. The forward computes what the library's does, bit for bit;
the gradients of the hidden states and biases are the same sums in another order. With the gate
compiled (below), the biases are added by a compiled pass that reads each row's bias from the
experts' table, where the library's gather writes a rows x width copy of it that its add reads
back (on the H200 at 8 x 4096 tokens, GPT-OSS-20B's up projection's copy is 1.5 GB): one
addition, rounded once, bit for bit the library's still. On a GPU GPT-OSS's up projection's bias is
added inside its gate's kernels instead, and its down projection's inside the weighting's
(expert_bias.py): the biased rows are never written.

The gate between the two projections is a chain of elementwise passes over the routed rows' widest
tensor (rows x 2 x the expert's width): GPT-OSS's clamps, sigmoid and products are seven kernels
forward and more backward, and they run again in the recompute. With engine.mlp_kernel: compiled
(the GPU's default) it is one kernel each way (torch.compile), keeping only the projection's output
for the backward, as swiglu.py does for the dense MLP: GPT-OSS's clamped gate, (clamp(up) + 1) *
g sigmoid(1.702 g) with g = clamp(gate) over interleaved halves, and the SiLU gate of Qwen3-MoE
and Mixtral, silu(gate) * up over concatenated ones. With the gate compiled, the rest of the way
back is too: the router's weighting of the rows and their sum into token order is one kernel that
reads each row once (the library's product and gather write the rows twice more), and the tokens'
gather's backward one kernel. The weighting's backward never reads the down projection's output
(`_DownCombine`): each weight's gradient is taken through the projection's input, from the rows'
unweighted gradient through the projection (the GEMM its backward runs, the weight applied after),
so a recomputed block's last layer, whose output nothing reads, leaves that projection out
(unread_mlp.py), as the dense MLP does. Inside a
kernel the arithmetic stays in float32 where the library rounds each step to the compute dtype:
equal to rounding, not bit for bit.
"""
from __future__ import annotations

import functools
import types

import torch
import torch.nn.functional as F
from torch import nn
from transformers.integrations.moe import _grouped_linear, _grouped_mm

from megatrain import expert_bias, gather_rows
from megatrain.kernel_build import compiled
from megatrain.unread_mlp import unread


def _gather_sum(rows: torch.Tensor, inv: torch.Tensor, k: int) -> torch.Tensor:
    """Rows in expert order -> token order, each token's k rows summed (float32 inside torch's sum)."""
    return rows[inv].view(-1, k, rows.shape[-1]).sum(dim=1)


# The compiled kernels take each token's k picks as k columns of indices made before the call (a
# loop over the picks: pointwise passes that read each row once; a reduction over the picks, k
# elements a dynamic shape does not know, ran 10 to 20 times slower on the H200) and the rows'
# tokens and weights already gathered (an index's division left out of every element).

def _sum_picks(rows: torch.Tensor, picks: torch.Tensor) -> torch.Tensor:
    """Rows in expert order -> token order: sum over j of rows[picks[:, j]], float32 inside."""
    total = rows[picks[:, 0]].float()
    for j in range(1, picks.shape[1]):
        total = total + rows[picks[:, j]].float()
    return total.to(rows.dtype)


def _combine(y: torch.Tensor, picks: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The experts' rows weighted by the router and summed per token: sum over j of
    weights[:, j] y[picks[:, j]], float32 inside."""
    total = y[picks[:, 0]].float() * weights[:, :1].float()
    for j in range(1, picks.shape[1]):
        total = total + y[picks[:, j]].float() * weights[:, j:j + 1].float()
    return total.to(y.dtype)


def _grad_rows(grad: torch.Tensor, tokens: torch.Tensor, row_weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's gradient (expert order): its token's, as it is and times the row's weight."""
    rows = grad[tokens]
    return rows, (rows.float() * row_weights.float().unsqueeze(-1)).to(grad.dtype)


def _grad_inputs(through: torch.Tensor, h: torch.Tensor, row_weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """From each row's unweighted gradient through the down projection: the projection's input's
    gradient (times the row's weight) and each row's <through, h>, float32."""
    return ((through.float() * row_weights.float().unsqueeze(-1)).to(through.dtype),
            (through.float() * h.float()).sum(dim=-1))


def _grad_rows_biased(grad: torch.Tensor, tokens: torch.Tensor, row_weights: torch.Tensor, bias: torch.Tensor,
                      ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """_grad_rows, and each row's gradient dotted with its expert's bias (float32) in the same pass
    over the rows: <g, b>, a weight's gradient's bias term."""
    rows, weighted = _grad_rows(grad, tokens, row_weights)
    return rows, weighted, (rows.float() * bias[ids].float()).sum(dim=-1)


_compiled_sum_picks, _compiled_combine = compiled(_sum_picks), compiled(_combine)
_compiled_grad_rows, _compiled_grad_inputs = compiled(_grad_rows), compiled(_grad_inputs)
_compiled_grad_rows_biased = compiled(_grad_rows_biased)


class _ToExperts(torch.autograd.Function):
    """x (tokens, h) -> its rows in expert order, x[perm // k]; back: each token's k rows summed,
    read through the inverse permutation (one compiled pass where `fused`)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, perm: torch.Tensor, inv: torch.Tensor, k: int, fused: bool) -> torch.Tensor:
        ctx.save_for_backward(inv)
        ctx.k, ctx.fused = k, fused
        return gather_rows.gather(x, perm // k)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        inv, = ctx.saved_tensors
        summed = _compiled_sum_picks(grad, inv.view(-1, ctx.k)) if ctx.fused else _gather_sum(grad, inv, ctx.k)
        return summed, None, None, None, None


class _DownCombine(torch.autograd.Function):
    """The down projection's grouped GEMM over the rows h (expert order), its experts' bias where it
    has one, the router's weighting and the sum back to token order, one function whose backward
    never reads the projection's output: each weight's gradient, the token's gradient g dotted with
    its row's output W h + b, is taken as <u, h> + <g, b>, u = g W the row's unweighted gradient
    through the projection, whose product with the row's weight is h's gradient. So where nothing
    reads the output (a recomputed block's last layer: unread_mlp.py) the forward leaves it out, and
    the projection's GEMM with it. Keeps h and the routing, not the output.

    With `gate` (GPT-OSS's clamped gate's constants, where expert_bias's kernels run) the input is
    the up projection's rows before their bias (`up_bias`) and the gate, h made from them here, and
    the backward takes u back through the gate in one pass (expert_bias.gate_backward), which makes
    h again, times each row's weight, for the weight's gradient: h w g where the library takes
    h (g w), each product rounded once; that pass and the rows' gather (expert_bias.rows_and_bias_dots)
    sum the two biases' gradients as they go. Keeps those rows (the gate's own input), not h, and
    where nothing reads the output makes no h at all: the gate's forward pass is left out too."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, ids: torch.Tensor,
                counts: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor, perm: torch.Tensor,
                inv: torch.Tensor, transposed: bool, up_bias: torch.Tensor | None = None,
                gate: tuple[float, float] | None = None) -> torch.Tensor:
        ctx.save_for_backward(x if gate is None else None, weight, bias, ids, counts, offsets, weights, perm, inv,
                              *((None, None) if gate is None else (x, up_bias)))
        ctx.transposed, ctx.gate = transposed, gate
        if unread():
            return x.new_empty(weights.shape[0], weight.shape[2 if transposed else 1])
        h = x if gate is None else expert_bias.gate(x, up_bias, ids, *gate)
        y = _grouped_linear(h, weight, offsets, is_transposed=transposed)
        picks = inv.view(weights.shape)
        if bias is None:
            return _compiled_combine(y, picks, weights)
        if expert_bias.runs(y):
            return expert_bias.combine(y, bias, ids, picks, weights)
        return _compiled_combine(_compiled_add_bias(y, bias, ids), picks, weights)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        h, weight, bias, ids, counts, offsets, weights, perm, inv, x, up_bias = ctx.saved_tensors
        k = weights.shape[-1]
        row_weights = weights.reshape(-1)[perm]
        d_bias = None
        if ctx.gate is not None:  # the rows' gradient unweighted alone: the weight is h's (gate_backward)
            rows, bias_dots, d_bias = expert_bias.rows_and_bias_dots(grad.contiguous(), perm // k, bias, counts,
                                                                      row_weights, sums=ctx.needs_input_grad[2])
        elif bias is None:
            rows, weighted = _compiled_grad_rows(grad.contiguous(), perm // k, row_weights)
        else:
            rows, weighted, bias_dots = _compiled_grad_rows_biased(grad.contiguous(), perm // k, row_weights, bias, ids)
        through = _grouped_mm(rows, weight.transpose(-2, -1) if ctx.transposed else weight, offsets)
        if ctx.gate is None:
            d_x, dots = _compiled_grad_inputs(through, h, row_weights)
            d_up_bias = None
        else:  # h w from the gate's backward: the weight's gradient below as (h w)^T g
            d_x, dots, h, d_up_bias = expert_bias.gate_backward(x, up_bias, counts, through, row_weights, *ctx.gate,
                                                                sums=ctx.needs_input_grad[10])
            weighted = rows
        d_weight = None
        if ctx.needs_input_grad[1]:  # the weight's gradient, each expert's rows: h^T (g w) as autograd's, or (h w)^T g
            d_weight = F.grouped_mm(h.t(), weighted, offs=offsets) if ctx.transposed \
                else F.grouped_mm(weighted.t(), h, offs=offsets)
        if bias is not None:
            dots = dots + bias_dots
            if ctx.needs_input_grad[2] and ctx.gate is None:
                d_bias = expert_bias.expert_sums(weighted, counts)
        d_weights = dots[inv].view(weights.shape).to(weights.dtype)
        return d_x, d_weight, d_bias, None, None, None, d_weights, None, None, None, d_up_bias, None


class _FromExperts(torch.autograd.Function):
    """Rows in expert order -> token order, each token's k rows summed: y[inv].view(T, k, h).sum(1);
    back: the gradient of each token to its k rows, grad[perm // k]."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, perm: torch.Tensor, inv: torch.Tensor, k: int) -> torch.Tensor:
        ctx.save_for_backward(perm)
        ctx.k = k
        return _gather_sum(y, inv, k)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        perm, = ctx.saved_tensors
        return grad[perm // ctx.k], None, None, None


def _add_bias(out: torch.Tensor, bias: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Each row plus its expert's bias, rounded once to the rows' dtype (as the library's in-place
    add rounds it)."""
    return (out + bias[ids]).to(out.dtype)


_compiled_add_bias = compiled(_add_bias)


class _ExpertBias(torch.autograd.Function):
    """out (rows in expert order, d) plus b (experts, d) at each row's expert, out + b[ids] (ids
    sorted), where `fused` one compiled pass that reads b through ids (no rows x d copy of it);
    back: the rows' gradient as it comes, and b's each expert's rows summed, a segment sum over the
    `counts` rows each expert has."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, bias: torch.Tensor, ids: torch.Tensor, counts: torch.Tensor,
                fused: bool) -> torch.Tensor:
        ctx.save_for_backward(counts)
        return _compiled_add_bias(out, bias, ids) if fused else _add_bias(out, bias, ids)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        counts, = ctx.saved_tensors
        d_bias = expert_bias.expert_sums(grad, counts) if ctx.needs_input_grad[1] else None
        return grad, d_bias, None, None, None


def _silu_gate(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _silu_gate_grad(gate_up: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    gate, up = (t.to(torch.float32) for t in gate_up.chunk(2, dim=-1))
    d = grad.to(torch.float32)
    sig = torch.sigmoid(gate)
    return torch.cat([d * up * sig * (1 + gate * (1 - sig)), d * gate * sig], dim=-1).to(gate_up.dtype)


def _clamped_gate(gate_up: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    gate = gate_up[..., ::2].clamp(max=limit)
    up = gate_up[..., 1::2].clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def _clamped_gate_grad(gate_up: torch.Tensor, grad: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    gate, up, d = gate_up[..., ::2].to(torch.float32), gate_up[..., 1::2].to(torch.float32), grad.to(torch.float32)
    g, u = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    sig = torch.sigmoid(g * alpha)
    d_gate = d * (u + 1) * sig * (1 + alpha * g * (1 - sig)) * (gate <= limit)  # clamp passes where it did not clip
    d_up = d * g * sig * ((up >= -limit) & (up <= limit))
    return torch.stack([d_gate, d_up], dim=-1).view(gate_up.shape).to(gate_up.dtype)


_GATES = {"silu": (compiled(_silu_gate), compiled(_silu_gate_grad)),
          "clamped": (compiled(_clamped_gate), compiled(_clamped_gate_grad))}


class _Gate(torch.autograd.Function):
    """A gate's compiled forward, keeping only its input; its compiled backward."""

    @staticmethod
    def forward(ctx, gate_up: torch.Tensor, kind: str, *constants) -> torch.Tensor:
        ctx.save_for_backward(gate_up)
        ctx.kind, ctx.constants = kind, constants
        return _GATES[kind][0](gate_up, *constants)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate_up, = ctx.saved_tensors
        return (_GATES[ctx.kind][1](gate_up, grad, *ctx.constants), None, *(None for _ in ctx.constants))


def gate_kind(family: str, hidden_act: str | None) -> str | None:
    """The compiled gate for a family's experts: GPT-OSS's clamped one, Qwen3-MoE's and Mixtral's
    SiLU one; None where there is none (another activation)."""
    if family == "gpt_oss":
        return "clamped"
    return "silu" if family in ("qwen3_moe", "mixtral", "deepseek_v2", "deepseek_v3") and hidden_act == "silu" else None


def _forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
             top_k_weights: torch.Tensor) -> torch.Tensor:
    """The library's grouped-GEMM experts forward without sentinels (see the module's docstring)."""
    k = top_k_index.size(-1)
    expert_ids, perm = torch.sort(top_k_index.reshape(-1))
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    # the library's offsets: histc, as it counts (float input on the CPU, int on a GPU)
    counted = expert_ids.float() if expert_ids.device.type in ("cpu", "mps") else expert_ids.int()
    per_expert = torch.histc(counted, bins=self.num_experts, min=0, max=self.num_experts - 1)
    offsets = torch.cumsum(per_expert, dim=0, dtype=torch.int32)
    counts = per_expert.to(torch.int64)

    def linear(x, weight, bias):
        out = _grouped_linear(x, weight, offsets, is_transposed=self.is_transposed)
        return _ExpertBias.apply(out, bias, expert_ids, counts, self.megatrain_fused) if self.has_bias else out

    rows = _ToExperts.apply(hidden_states, perm, inv, k, self.megatrain_fused)
    up = self.gate_up_proj if self.has_gate else self.up_proj
    up_bias = (self.gate_up_proj_bias if self.has_gate else self.up_proj_bias) if self.has_bias else None
    if self.megatrain_bias_gate is not None and expert_bias.runs(rows) and k & (k - 1) == 0:
        # GPT-OSS's up projection's bias inside the gate's kernels, the gate inside the down
        # projection's function, its bias inside the weighting's kernel (expert_bias.py)
        out = _grouped_linear(rows, up, offsets, is_transposed=self.is_transposed)
        return _DownCombine.apply(out, self.down_proj, self.down_proj_bias, expert_ids, counts, offsets, top_k_weights,
                                  perm, inv, self.is_transposed, up_bias,
                                  self.megatrain_bias_gate).to(hidden_states.dtype)
    out = linear(rows, up, up_bias)
    out = self.megatrain_gate(out) if self.has_gate else self.act_fn(out)
    if self.megatrain_fused:
        return _DownCombine.apply(out, self.down_proj, self.down_proj_bias if self.has_bias else None, expert_ids,
                                  counts, offsets, top_k_weights, perm, inv, self.is_transposed).to(hidden_states.dtype)
    out = linear(out, self.down_proj, self.down_proj_bias if self.has_bias else None)
    out = out * top_k_weights.reshape(-1)[perm].unsqueeze(-1)
    return _FromExperts.apply(out, perm, inv, k).to(hidden_states.dtype)


def is_experts(module: nn.Module) -> bool:
    """The library's stacked experts of a mixture-of-experts layer (GptOssExperts, Qwen3MoeExperts,
    MixtralExperts)."""
    return type(module).__name__.endswith("Experts") and hasattr(module, "down_proj")


def make_lean(experts: nn.Module, gate: str | None = None) -> None:
    """Make this experts module (of a template: its weights bound later) run the lean forward, with
    the compiled `gate` (gate_kind) or the library's."""
    experts.forward = types.MethodType(_forward, experts)
    constants = (float(experts.limit), float(experts.alpha)) if gate == "clamped" else ()
    experts.megatrain_gate = functools.partial(_compiled_gate, gate, constants) if gate else experts._apply_gate
    experts.megatrain_fused = gate is not None  # the weighting and sum compiled with the gate
    # GPT-OSS's clamped gate and weighting with the projections' biases, Triton kernels (expert_bias.py)
    experts.megatrain_bias_gate = constants if gate == "clamped" and experts.has_bias else None


def _compiled_gate(kind: str, constants: tuple, gate_up: torch.Tensor) -> torch.Tensor:
    return _Gate.apply(gate_up, kind, *constants)

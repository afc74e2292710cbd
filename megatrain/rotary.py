"""The rotary position embedding of the queries and keys, one compiled kernel each way
(engine.rotary_kernel: compiled).

The library applies it as `(q * cos) + (rotate_half(q) * sin)`, rotate_half(x) being
cat(-x2, x1) of x's halves: a negation, a concatenation, two products with a broadcast (which run
torch's generic, unvectorised kernel) and a sum, each a pass over the queries and again over the
keys, in the forward, in the recompute and, mirrored, in the backward. On the H200 at 8 x 4096
tokens those passes took about 6 ms of the 7B layer's 106 (docs/decisions.md, "The compiled rotary and the
lean experts' compiled weighting").
Here each tensor is one pass each way: y = x cos + R(x) sin forward, and back, R being
x -> cat(-x2, x1), dx = g cos + R^T(g sin) with R^T(y) = cat(y2, -y1). The arithmetic stays in
float32 and is rounded once, where the library rounds each product and the sum to the compute
dtype: equal to rounding, not bit for bit (tests/engine/test_kernels.py).

GPT-OSS rotates each half by the other with cos and sin of half the head's width:
cat(x1 cos - x2 sin, x2 cos + x1 sin), four products with a broadcast over non-contiguous halves,
two sums and a concatenation each way, and the backward's two sums of products and its
concatenation (in the H200 layer probe of GPT-OSS-20B at 8 x 4096 tokens, 24 of the layer's 29
unvectorised bf16 products, 12 of its 29 bf16 sums and its 6 concatenations, by their call sites
on the CPU). Here that too is one kernel each way, the library's own ops
built with each result rounded to the dtype where the library rounds it (inductor's
emulate_precision_casts): the library's output and gradients to the bit; on a GPU, in bf16, a
Triton program a block of tokens with the same roundings (rotary_halves.py: inductor's build ran at
a third of the Llama form's bandwidth).

It takes the place of the library's `apply_rotary_pos_emb` only where that function is one of
those two forms (`form`: Phi-3's partial rotary is neither), and only while the engine runs a
layer (`applied`): the library's module keeps its own function for everything else in the
process, a reference model beside the engine among them.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
from types import ModuleType

import torch

from megatrain import rotary_halves
from megatrain.kernel_build import compiled


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return (x.float() * cos.float() + torch.cat((-x2, x1), dim=-1) * sin.float()).to(x.dtype)


def _rotate_grad(grad: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    g1, g2 = (grad.float() * sin.float()).chunk(2, dim=-1)
    return (grad.float() * cos.float() + torch.cat((g2, -g1), dim=-1)).to(grad.dtype)


def _rotate_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """GPT-OSS's `_apply_rotary_emb`, op for op."""
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _rotate_halves_grad(grad: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Autograd's backward of `_rotate_halves`, op for op: each half's two products summed (the
    order of two terms does not change a sum) and the halves concatenated."""
    g1, g2 = torch.chunk(grad, 2, dim=-1)
    return torch.cat((g1 * cos + g2 * sin, g2 * cos + -g1 * sin), dim=-1)


_compiled_rotate, _compiled_rotate_grad = compiled(_rotate), compiled(_rotate_grad)
_compiled_halves = compiled(_rotate_halves, emulate_precision_casts=True)
_compiled_halves_grad = compiled(_rotate_halves_grad, emulate_precision_casts=True)


def _halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """GPT-OSS's form forward: the Triton kernel where it runs (rotary_halves.py), else compiled."""
    return rotary_halves.rotate(x, cos, sin) if rotary_halves.runs(x, cos, sin) else _compiled_halves(x, cos, sin)


def _halves_grad(grad: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """GPT-OSS's form backward, likewise."""
    if rotary_halves.runs(grad, cos, sin):
        return rotary_halves.rotate(grad, cos, sin, backward=True)
    return _compiled_halves_grad(grad, cos, sin)


def _kernels(form: str):
    """The form's kernels, forward and backward."""
    return (_compiled_rotate, _compiled_rotate_grad) if form == "llama" else (_halves, _halves_grad)


def _in_layout(kernel, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """kernel(x, cos, sin) with the result in x's layout where x is (batch, heads, tokens, width)
    over (batch, tokens, heads, width) memory, as the library's projections make it: the kernel
    runs on the contiguous view and its result is transposed back (elementwise: the same numbers).
    Attention's output and gradients follow their query's layout, so the library's transposes
    around attention, and the projections' gradients' reshapes, are then views, not copies."""
    if x.dim() == 4 and not x.is_contiguous() and x.transpose(1, 2).is_contiguous():
        return kernel(x.transpose(1, 2), cos.transpose(1, 2), sin.transpose(1, 2)).transpose(1, 2)
    return kernel(x, cos, sin)


class _Rotary(torch.autograd.Function):
    """x (..., head_dim) rotated by cos and sin (broadcast to it) in the `form`'s kernel, in x's
    layout (`_in_layout`); cos and sin take no gradient (the engine makes them without one), and are
    all it keeps."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, form: str) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        ctx.form = form
        return _in_layout(_kernels(form)[0], x, cos, sin)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cos, sin = ctx.saved_tensors
        return _in_layout(_kernels(ctx.form)[1], grad, cos, sin), None, None, None


def _applying(form: str):
    def apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                             unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """The library's function of the same name and signature, by the compiled kernels."""
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        return _Rotary.apply(q, cos, sin, form), _Rotary.apply(k, cos, sin, form)
    return apply_rotary_pos_emb


apply_rotary_pos_emb, apply_rotary_halves = _applying("llama"), _applying("halves")


def _body(fn) -> str:
    """A function's code without its decorators, name and docstring."""
    code = inspect.getsource(inspect.unwrap(fn))
    return code[code.index('"""', code.index('"""') + 3) + 3:] if fn.__doc__ else code[code.index(":\n") + 2:]


# the library's forms the kernels compute: (a model whose functions are the form's, the functions)
_FORMS = {"llama": ("llama", ("apply_rotary_pos_emb", "rotate_half")),
          "halves": ("gpt_oss", ("apply_rotary_pos_emb", "_apply_rotary_emb"))}


@functools.cache
def form(modeling: ModuleType) -> str | None:
    """Which kernel computes a family's rotary: `llama` where its modeling module's functions are
    Llama's, line for line, `halves` where they are GPT-OSS's; None for any other (Phi-3's partial
    rotary)."""
    for name, (model, functions) in _FORMS.items():
        reference = importlib.import_module(f"transformers.models.{model}.modeling_{model}")
        try:
            if all(_body(getattr(modeling, f)) == _body(getattr(reference, f)) for f in functions):
                return name
        except (AttributeError, OSError, TypeError, ValueError):  # no such function, or no source to read
            continue
    return None


@contextlib.contextmanager
def applied(modeling: ModuleType):
    """The form's kernel in place of the modeling module's `apply_rotary_pos_emb`, while the block
    runs."""
    library = modeling.apply_rotary_pos_emb
    modeling.apply_rotary_pos_emb = {"llama": apply_rotary_pos_emb, "halves": apply_rotary_halves}[form(modeling)]
    try:
        yield
    finally:
        modeling.apply_rotary_pos_emb = library

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

It takes the place of the library's `apply_rotary_pos_emb` only where that function is the Llama
form above (`library_form`: Phi-3's partial rotary and GPT-OSS's are not), and only while the
engine runs a layer (`applied`): the library's module keeps its own function for everything else
in the process, a reference model beside the engine among them.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
from types import ModuleType

import torch

from megatrain.kernel_build import compiled


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return (x.float() * cos.float() + torch.cat((-x2, x1), dim=-1) * sin.float()).to(x.dtype)


def _rotate_grad(grad: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    g1, g2 = (grad.float() * sin.float()).chunk(2, dim=-1)
    return (grad.float() * cos.float() + torch.cat((g2, -g1), dim=-1)).to(grad.dtype)


_compiled_rotate, _compiled_rotate_grad = compiled(_rotate), compiled(_rotate_grad)


class _Rotary(torch.autograd.Function):
    """x (..., head_dim) rotated by cos and sin (broadcast to it); cos and sin take no gradient
    (the engine makes them without one), and are all it keeps."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return _compiled_rotate(x, cos, sin)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cos, sin = ctx.saved_tensors
        return _compiled_rotate_grad(grad, cos, sin), None, None


def apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The library's function of the same name and signature, by the compiled kernels."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return _Rotary.apply(q, cos, sin), _Rotary.apply(k, cos, sin)


def _body(fn) -> str:
    """A function's code without its decorators, name and docstring."""
    code = inspect.getsource(inspect.unwrap(fn))
    return code[code.index('"""', code.index('"""') + 3) + 3:] if fn.__doc__ else code[code.index(":\n") + 2:]


@functools.cache
def library_form(modeling: ModuleType) -> bool:
    """Whether a family's modeling module rotates as Llama's does (its `apply_rotary_pos_emb` and
    `rotate_half` are Llama's, line for line), which the kernel computes."""
    from transformers.models.llama import modeling_llama as llama
    try:
        return all(_body(getattr(modeling, name)) == _body(getattr(llama, name))
                   for name in ("apply_rotary_pos_emb", "rotate_half"))
    except (AttributeError, OSError, TypeError, ValueError):  # no such function, or no source to read
        return False


@contextlib.contextmanager
def applied(modeling: ModuleType):
    """The kernel in place of the modeling module's `apply_rotary_pos_emb`, while the block runs."""
    library = modeling.apply_rotary_pos_emb
    modeling.apply_rotary_pos_emb = apply_rotary_pos_emb
    try:
        yield
    finally:
        modeling.apply_rotary_pos_emb = library

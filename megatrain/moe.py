"""Mixtures of experts (GPT-OSS, Qwen3-MoE, Mixtral): the router's logits and its auxiliary loss.

The router and the stacked experts are the library's own modules, bound like every other weight of
a layer (templates.py): a layer's tile holds its attention, router and experts and streams whole
(docs/moe.md). What the engine adds is the router's load-balancing loss where the config asks for
it (`output_router_logits`, weighted by `router_aux_loss_coef`): the library's
`load_balancing_loss_func` over one forward,

    aux = E * sum_e f_e * P_e,   f = (top-k picks per expert) / R,   P = (router probabilities summed) / R,

where picks, probabilities and the row count R (padding rows left out) are summed over the rows of
every layer before the product. f is a count, without gradient, so aux reaches layer l only
through its own probabilities, along the same vector for every layer: d aux / d P_sum(l) = E f / R.
That vector is known once the forward has routed every layer, before any backward: the forward
collects each layer's picks and probability sums (`Routing`, no graph), and each layer's backward
adds the root <P_sum(l), coef * E f / R> beside its output (`Routing.root`).

The library's model adds coef * aux to each forward's mean cross-entropy; a step here is one
forward per micro-batch, so each micro-batch's aux enters with weight coef / M: the library's
loss of each micro-batch averaged over the step (equal to it with one micro-batch).

With data-parallel ranks each routes its own rows of a micro-batch. Picks, probability sums and
rows are sums over rows, so their sums over the ranks, taken once the forward is done and before
any backward (`Routing.summed`), are the whole micro-batch's: every rank then computes the same aux,
and each rank's probabilities get the same vector E f / R, with f and R the whole micro-batch's.
"""
from __future__ import annotations

import contextlib
from contextvars import ContextVar
from typing import Callable

import torch
from torch import nn

_CAPTURE: ContextVar[list | None] = ContextVar("router_logits", default=None)


def is_router(module: nn.Module) -> bool:
    """The library's top-k router of a mixture-of-experts layer (GptOssTopKRouter, Qwen3MoeTopKRouter,
    MixtralTopKRouter)."""
    return type(module).__name__.endswith("TopKRouter")


def capture_logits(router: nn.Module) -> None:
    """Make a router module hand its logits (rows x experts) to the `captured` list around it."""
    forward = router.forward

    def capturing(x: torch.Tensor):
        out = forward(x)
        sink = _CAPTURE.get()
        if sink is not None:
            sink.append(out[0])
        return out
    router.forward = capturing


@contextlib.contextmanager
def captured():
    """Within it, routers built by `capture_logits` append their logits to the yielded list."""
    sink: list[torch.Tensor] = []
    token = _CAPTURE.set(sink)
    try:
        yield sink
    finally:
        _CAPTURE.reset(token)


def probabilities(logits: torch.Tensor) -> torch.Tensor:
    """The router's probabilities as the library's auxiliary loss takes them: softmax in the logits' dtype."""
    return torch.nn.functional.softmax(logits, dim=-1)


class Routing:
    """One micro-batch's routing over the layers of a forward: picks and probabilities per expert."""

    def __init__(self, experts: int, top_k: int, weight: float, mask: torch.Tensor | None):
        """`weight`: what aux counts for in the step's loss (coef / micro-batches); `mask`: the
        micro-batch's tokens that are not padding (Batch.token_mask, packed rows' too), None when
        every row counts."""
        self.experts, self.top_k, self.weight = experts, top_k, weight
        self.mask = None if mask is None else mask.reshape(-1).to(torch.float32)
        self.picks: torch.Tensor | None = None  # float32 (experts,), summed over layers
        self.prob_sum: torch.Tensor | None = None
        self.rows: torch.Tensor | None = None  # float32 ()

    def add(self, logits: torch.Tensor) -> None:
        """A layer's routing, in the library's arithmetic and layer order."""
        with torch.no_grad():
            probs = probabilities(logits)
            _, selected = torch.topk(probs, self.top_k, dim=-1)
            def zeros(*size: int) -> torch.Tensor:
                return torch.zeros(size, dtype=torch.float32, device=logits.device)
            if self.picks is None:
                self.picks, self.prob_sum, self.rows = zeros(self.experts), zeros(self.experts), zeros()
            if self.mask is None:
                self.picks = self.picks + torch.bincount(selected.reshape(-1), minlength=self.experts).float()
                self.prob_sum = self.prob_sum + probs.float().sum(dim=0)
                self.rows = self.rows + probs.shape[0]
            else:
                self.mask = mask = self.mask.to(logits.device)  # moved once, at the first layer
                self.picks = self.picks + zeros(self.experts).scatter_add_(0, selected.reshape(-1), mask.repeat_interleave(self.top_k))
                self.prob_sum = self.prob_sum + (probs.float() * mask.unsqueeze(-1)).sum(dim=0)
                self.rows = self.rows + mask.sum()

    def summed(self, sum_: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Picks, probability sums and rows summed over the data-parallel ranks (`sum_`: an in-place
        all-reduce), in one collective: the whole micro-batch's routing on every rank."""
        flat = torch.cat([self.picks, self.prob_sum, self.rows.reshape(1)])
        sum_(flat)
        e = self.experts
        self.picks, self.prob_sum, self.rows = flat[:e], flat[e:2 * e], flat[2 * e]

    def loss(self) -> torch.Tensor:
        """weight * aux: this micro-batch's share of the step's loss."""
        return self.weight * torch.sum((self.picks / self.rows) * (self.prob_sum / self.rows).unsqueeze(0)) * self.experts

    def root(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(P_sum of a layer, with its graph; the gradient of the step's loss with respect to it)."""
        probs = probabilities(logits).float()
        if self.mask is not None:
            probs = probs * self.mask.unsqueeze(-1)
        grad = self.weight * self.experts * (self.picks / self.rows) / self.rows
        return probs.sum(dim=0), grad

"""The runtime side of a model family: stateless layer templates, Bind, masks and rotary.

A template is the library's own decoder-layer module with every parameter removed: it holds the
kernels (attention, MLP or router and experts, norms) and the per-layer behaviour that is not a
weight (layer type, sliding window), never a weight. `Template.bind` points its weight slots at zero-copy views into
a streaming buffer, so running layer i is: bind(views of buffer), call. A layer's persistent buffers
(DeepSeek-V3's router's e_score_correction_bias) are slots too, bound to the store's float32 copy.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from megatrain import flex_kernel, kept_attention, kernel_build, lean_experts, rotary, sinks
from megatrain.chunked_mlp import chunk_tokens
from megatrain.lean_norm import make_lean
from megatrain.moe import capture_logits, is_router
from megatrain.shapes import ModelShape
from megatrain.unread_mlp import skip_unread_down


class Template:
    """A decoder layer (or the final norm) with its parameters replaced by bindable slots."""

    def __init__(self, module: nn.Module):
        self.module = module
        self.slots = self._slots("_parameters", module.named_parameters())
        self.buffer_slots = self._slots("_buffers", module.named_buffers())

    def _slots(self, kind: str, named) -> list[tuple[nn.Module, str]]:
        slots = []
        for name, _ in list(named):
            owner_name, _, attr = name.rpartition(".")
            owner = self.module.get_submodule(owner_name)
            del getattr(owner, kind)[attr]
            owner.__dict__[attr] = None
            slots.append((owner, attr))
        return slots

    def bind(self, views: list[torch.Tensor], buffers: list[torch.Tensor] = ()) -> nn.Module:
        """Zero-copy Bind: each weight slot becomes the given view of the streaming buffer, each buffer
        slot the given tensor."""
        for (owner, attr), view in zip(self.slots + self.buffer_slots, [*views, *buffers], strict=True):
            owner.__dict__[attr] = view
        return self.module


class Architecture:
    """The templates of one model, built for the run's MLP chunking (None: the whole MLP at once;
    chunked_mlp.py) and its kernels (the norms': lean_norm.py; the whole gated MLP's: swiglu.py; a
    mixture of experts' experts and their gate: lean_experts.py; the queries' and keys' rotary and
    the attention sinks' product, while a layer runs: rotary.py, sinks.py), their attention the
    library's, or, where some layers keep it for their recompute, that attention able to
    (`keep_attention`: kept_attention.py)."""

    def __init__(self, shape: ModelShape, mlp_chunk: int | None = None, compiled_norms: bool = False,
                 compiled_mlp: bool = False, lean_moe: bool = False, keep_attention: bool = False,
                 compiled_rotary: bool = False, compiled_sinks: bool = False):
        self.shape = shape
        self.mlp_chunk = mlp_chunk
        self.compiled_norms, self.compiled_mlp, self.lean_moe = compiled_norms, compiled_mlp, lean_moe
        self.compiled_rotary, self.compiled_sinks = compiled_rotary, compiled_sinks
        self._config = kept_attention.config(shape) if keep_attention else shape.config
        self._norm_cls = getattr(shape.modeling, f"{shape.prefix}RMSNorm")
        self._rotary_cls = getattr(shape.modeling, f"{shape.prefix}RotaryEmbedding")
        if mlp_chunk:
            with torch.device("meta"):  # refuses a family it cannot chunk before anything runs
                chunk_tokens(shape.layer_class(shape.config, 0).mlp, mlp_chunk, shape.hidden_act)
        self._templates: dict[tuple[str, int], Template] = {}
        self._norm_template: Template | None = None
        if shape.config._attn_implementation == "flex_attention":  # the library's compiled masks and attention
            kernel_build.in_process()

    def template(self, index: int) -> Template:
        """The template for layer `index`: one per layer type and layout (DeepSeek's dense and MoE
        layers: ModelShape.layout_of), re-labelled with the layer's index."""
        s = self.shape
        kind = (s.layer_type(index), s.layout_of[index])
        if kind not in self._templates:
            with torch.device("meta"):
                module = s.layer_class(self._config, index)
            module.train()
            for sub in module.modules():
                if isinstance(sub, self._norm_cls):
                    make_lean(sub, s.norm_scale, compiled=self.compiled_norms)
                elif is_router(sub):  # its logits feed the auxiliary loss (moe.py)
                    capture_logits(sub)
                elif self.lean_moe and lean_experts.is_experts(sub):  # compiled_mlp: their gate compiled
                    gate = lean_experts.gate_kind(s.family, s.hidden_act) if self.compiled_mlp else None
                    lean_experts.make_lean(sub, gate)
            if self.mlp_chunk:
                chunk_tokens(module.mlp, self.mlp_chunk, s.hidden_act)
            elif s.gated_mlp:
                skip_unread_down(module.mlp, compiled=self.compiled_mlp)
            self._templates[kind] = Template(module)
        template = self._templates[kind]
        template.module.self_attn.layer_idx = index
        return template

    @contextlib.contextmanager
    def running(self):
        """What a layer's call runs under: the compiled rotary and sinks' product in place of the
        library's, where they run."""
        with contextlib.ExitStack() as stack:
            if self.compiled_rotary:
                stack.enter_context(rotary.applied(self.shape.modeling))
            if self.compiled_sinks:
                stack.enter_context(sinks.applied())
            yield

    def norm_template(self) -> Template:
        if self._norm_template is None:
            with torch.device("meta"):
                self._norm_template = Template(self._norm_cls(self.shape.hidden, eps=self.shape.config.rms_norm_eps))
        return self._norm_template

    # ---- per-batch context shared by all layers ----
    def rotary(self, device: torch.device) -> nn.Module:
        with torch.device(device):
            return self._rotary_cls(config=self.shape.config)

    def position_embeddings(self, rotary: nn.Module, embeds: torch.Tensor,
                            position_ids: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """(cos, sin) by layer type, as the library's model computes them: one rotary for every layer,
        or, where the rotary module holds one per layer type (Gemma 3: local and global bases), each
        layer type's own."""
        s = self.shape
        kinds = {s.layer_type(i) for i in range(s.num_layers)}
        if hasattr(rotary, "layer_types"):
            return {kind: rotary(embeds, position_ids, kind) for kind in kinds}
        return dict.fromkeys(kinds, rotary(embeds, position_ids))

    def attention_kwargs(self, plain: bool) -> dict[str, dict]:
        """What each layer type's call adds for its attention (flex_kernel.py); `plain`: the
        micro-batch has neither padding nor packing."""
        s = self.shape
        kinds = {s.layer_type(i) for i in range(s.num_layers)}
        return {kind: flex_kernel.attention_kwargs(self._config._attn_implementation, kind, plain) for kind in kinds}

    def masks(self, embeds: torch.Tensor, attention_mask: torch.Tensor | None,
              position_ids: torch.Tensor) -> dict[str, torch.Tensor | None]:
        """The masks the library itself would build, by layer type (None lets SDPA use is_causal)."""
        s = self.shape
        kwargs = dict(config=s.config, inputs_embeds=embeds, attention_mask=attention_mask,
                      past_key_values=None, position_ids=position_ids)
        kinds = {s.layer_type(i) for i in range(s.num_layers)}
        out = {}
        if "full_attention" in kinds:
            out["full_attention"] = attending(create_causal_mask(**kwargs))
        if "sliding_attention" in kinds:
            out["sliding_attention"] = attending(create_sliding_window_causal_mask(**kwargs))
        return out


def attending(mask):
    """A boolean (SDPA) mask whose rows that attend to nothing attend to every key instead. Such a row
    is a padding query whose window holds only padding: its output and gradient are read by nothing,
    but the attention's backward on the GPU computes exp(-inf - -inf) for it, a NaN that the zero
    gradient does not cancel (a padded Gemma 3 batch, sliding window 6, on an H200). The rows that
    attend to something are untouched, so every other token's output and gradient are the library's."""
    if isinstance(mask, torch.Tensor) and mask.dtype == torch.bool:
        return mask | ~mask.any(-1, keepdim=True)
    return mask

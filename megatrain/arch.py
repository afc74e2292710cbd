"""The architecture adapter: a `transformers` config becomes parameter layouts, stateless layer
templates and Bind.

A template is the library's own decoder-layer module with every parameter removed: it holds the
kernels (attention, MLP, norms) and the per-layer behaviour that is not a weight (layer type,
sliding window), never a weight. `Template.bind` points its weight slots at zero-copy views into
a streaming buffer, so running layer i is: bind(views of buffer), call.
"""
from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, PretrainedConfig
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from megatrain.chunked_mlp import chunk_tokens, chunkable
from megatrain.config import ModelConfig
from megatrain.lean_norm import make_lean
from megatrain.presets import preset
from megatrain.unread_mlp import skip_unread_down

# model_type -> class-name prefix in transformers.models.<type>.modeling_<type>; in each, a decoder
# layer's MLP output feeds only its residual sum (unread_mlp.output_unused relies on it)
FAMILIES = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral"}


@dataclass(frozen=True)
class ParamSpec:
    name: str  # the parameter's name inside its module (layer-relative for decoder layers)
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def decay(self) -> bool:
        """Weight decay applies to matrices, not to norm weights and biases (the common recipe)."""
        return len(self.shape) >= 2


def load_hf_config(cfg: ModelConfig) -> PretrainedConfig:
    """The `transformers` config of a run, from a preset, a config file, or a pretrained directory."""
    if cfg.preset:
        values = preset(cfg.preset)
    else:
        path = Path(cfg.config or cfg.pretrained)
        file = path / "config.json" if path.is_dir() else path
        if not file.is_file():
            raise ValueError(f"model: no config.json at {path}")
        try:
            values = json.loads(file.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"model: {file} is not valid JSON: {e}") from None
    values = {**values, **cfg.overrides}
    model_type = values.get("model_type")
    if model_type not in FAMILIES:
        raise ValueError(
            f"model: architecture {model_type!r} is not supported (no layer adapter for it); "
            f"supported model_type values: {sorted(FAMILIES)}")
    values.pop("model_type")
    for key in ("architectures", "transformers_version", "torch_dtype", "dtype"):
        values.pop(key, None)
    hf = AutoConfig.for_model(model_type, **values)
    hf._attn_implementation = cfg.attn_implementation
    return hf


class Template:
    """A decoder layer (or the final norm) with its parameters replaced by bindable slots."""

    def __init__(self, module: nn.Module):
        if list(module.buffers()):
            raise ValueError(f"{type(module).__name__} holds buffers; the template adapter does not support it")
        self.module = module
        self.slots: list[tuple[nn.Module, str]] = []
        for name, _ in list(module.named_parameters()):
            owner_name, _, attr = name.rpartition(".")
            owner = module.get_submodule(owner_name)
            del owner._parameters[attr]
            owner.__dict__[attr] = None
            self.slots.append((owner, attr))

    def bind(self, views: list[torch.Tensor]) -> nn.Module:
        """Zero-copy Bind: each weight slot becomes the given view of the streaming buffer."""
        for (owner, attr), view in zip(self.slots, views, strict=True):
            owner.__dict__[attr] = view
        return self.module


class Architecture:
    """Everything the engine needs to know about one `transformers` decoder family."""

    def __init__(self, hf_config: PretrainedConfig):
        self.config = c = hf_config
        prefix = FAMILIES[c.model_type]
        modeling = importlib.import_module(f"transformers.models.{c.model_type}.modeling_{c.model_type}")
        self._layer_cls = getattr(modeling, f"{prefix}DecoderLayer")
        self._norm_cls = getattr(modeling, f"{prefix}RMSNorm")
        self._rotary_cls = getattr(modeling, f"{prefix}RotaryEmbedding")
        if getattr(c, "attention_dropout", 0.0):
            raise ValueError("model: attention_dropout > 0 is not supported (set overrides.attention_dropout: 0)")
        self.num_layers = c.num_hidden_layers
        self.hidden = c.hidden_size
        self.vocab = c.vocab_size
        self.tied = bool(c.tie_word_embeddings)
        self.padding_idx = c.pad_token_id
        with torch.device("meta"):
            probe = self._layer_cls(c, 0)
        self.layer_specs = [ParamSpec(n, tuple(p.shape)) for n, p in probe.named_parameters()]
        self.embed_specs = [ParamSpec("weight", (self.vocab, self.hidden))]
        self.head_specs = [ParamSpec("norm.weight", (self.hidden,))]
        if not self.tied:
            self.head_specs.append(ParamSpec("lm_head.weight", (self.vocab, self.hidden)))
        self._templates: dict[str, Template] = {}
        self._norm_template: Template | None = None
        self.mlp_chunk: int | None = None  # set by chunk_mlp before the first template is made
        self._gated: bool | None = None  # mlp_chunkable(), once asked

    def mlp_chunkable(self) -> bool:
        with torch.device("meta"):
            return chunkable(self._layer_cls(self.config, 0).mlp, self.config.hidden_act)

    def chunk_mlp(self, tokens: int) -> None:
        """Every layer's MLP runs over `tokens` tokens at a time (megatrain/chunked_mlp.py)."""
        with torch.device("meta"):
            chunk_tokens(self._layer_cls(self.config, 0).mlp, tokens, self.config.hidden_act)  # refuses early
        self.mlp_chunk = tokens

    # ---- names in a `transformers` checkpoint ----
    def hf_names(self, tile: str) -> list[str]:
        """Checkpoint names of a tile's parameters, in spec order ('embed', 'head' or 'layer.N')."""
        if tile == "embed":
            return ["model.embed_tokens.weight"]
        if tile == "head":
            return ["model.norm.weight"] + ([] if self.tied else ["lm_head.weight"])
        index = int(tile.split(".")[1])
        return [f"model.layers.{index}.{s.name}" for s in self.layer_specs]

    # ---- per-layer behaviour that is not a weight ----
    def layer_type(self, index: int) -> str:
        """Which attention mask a layer uses: 'full_attention' or 'sliding_attention'."""
        types = getattr(self.config, "layer_types", None)
        if types:
            return types[index]
        if self.config.model_type == "mistral" and getattr(self.config, "sliding_window", None):
            return "sliding_attention"
        return "full_attention"

    def template(self, index: int) -> Template:
        """The template for layer `index`: one per layer type, re-labelled with the layer's index."""
        kind = self.layer_type(index)
        if kind not in self._templates:
            with torch.device("meta"):
                module = self._layer_cls(self.config, index)
            module.train()
            for sub in module.modules():
                if isinstance(sub, self._norm_cls):
                    make_lean(sub)
            if self.mlp_chunk:
                chunk_tokens(module.mlp, self.mlp_chunk, self.config.hidden_act)
            elif chunkable(module.mlp, self.config.hidden_act):
                skip_unread_down(module.mlp)
            self._templates[kind] = Template(module)
        template = self._templates[kind]
        template.module.self_attn.layer_idx = index
        return template

    def norm_template(self) -> Template:
        if self._norm_template is None:
            with torch.device("meta"):
                self._norm_template = Template(self._norm_cls(self.hidden, eps=self.config.rms_norm_eps))
        return self._norm_template

    # ---- per-batch context shared by all layers ----
    def rotary(self, device: torch.device) -> nn.Module:
        with torch.device(device):
            return self._rotary_cls(config=self.config)

    def masks(self, embeds: torch.Tensor, attention_mask: torch.Tensor | None,
              position_ids: torch.Tensor) -> dict[str, torch.Tensor | None]:
        """The masks the library itself would build, by layer type (None lets SDPA use is_causal)."""
        kwargs = dict(config=self.config, inputs_embeds=embeds, attention_mask=attention_mask,
                      past_key_values=None, position_ids=position_ids)
        kinds = {self.layer_type(i) for i in range(self.num_layers)}
        out = {}
        if "full_attention" in kinds:
            out["full_attention"] = create_causal_mask(**kwargs)
        if "sliding_attention" in kinds:
            out["sliding_attention"] = create_sliding_window_causal_mask(**kwargs)
        return out

    # ---- sizes ----
    def layer_matmul_params(self) -> int:
        """Matmul weights of one decoder layer."""
        return sum(s.numel for s in self.layer_specs if s.decay)

    def mlp_matmul_params(self) -> int:
        """Matmul weights of one decoder layer's gated MLP (gate, up and down projections)."""
        return 3 * self.hidden * getattr(self.config, "intermediate_size", 4 * self.hidden)

    def unread_mlp_params(self) -> int:
        """Matmul weights whose forward a layer's MLP leaves out when its output is unread
        (unread_mlp.py): chunked, all three projections; otherwise, if gated, the down projection."""
        if self.mlp_chunk:
            return self.mlp_matmul_params()
        if self._gated is None:
            self._gated = self.mlp_chunkable()
        return self.mlp_matmul_params() // 3 if self._gated else 0

    def matmul_params(self) -> int:
        """Matmul weights of the decoder layers plus the LM head (the FLOPs formula's N)."""
        return self.layer_matmul_params() * self.num_layers + self.vocab * self.hidden

    def total_params(self) -> int:
        per_layer = sum(s.numel for s in self.layer_specs)
        head = sum(s.numel for s in self.head_specs)
        return per_layer * self.num_layers + self.vocab * self.hidden + head

"""A model's shape: its `transformers` config, parameter layouts and counts.

What the host store, the memory plan, the FLOPs formula, the harness and the workflow need to
know about a model without running it. The runtime side (layer templates, Bind, masks, rotary)
is in templates.py.
"""
from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch
from transformers import AutoConfig, PretrainedConfig

from megatrain.chunked_mlp import chunkable
from megatrain.config import ModelConfig
from megatrain.presets import preset

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
    try:
        hf = AutoConfig.for_model(model_type, **values)
    except Exception as e:  # transformers validates the architecture: say which setting it refused
        cause = e.__cause__ or e
        raise ValueError(f"model: transformers refuses this {model_type} config: {cause}") from None
    hf._attn_implementation = cfg.attn_implementation
    return hf


class ModelShape:
    """Parameter layouts, counts and per-layer kinds of one `transformers` decoder model."""

    def __init__(self, hf_config: PretrainedConfig):
        self.config = c = hf_config
        self.family = c.model_type
        self.modeling: ModuleType = importlib.import_module(
            f"transformers.models.{c.model_type}.modeling_{c.model_type}")
        self.prefix = FAMILIES[c.model_type]
        if getattr(c, "attention_dropout", 0.0):
            raise ValueError("model: attention_dropout > 0 is not supported (set overrides.attention_dropout: 0)")
        self.num_layers = c.num_hidden_layers
        self.hidden = c.hidden_size
        self.vocab = c.vocab_size
        self.ffn = getattr(c, "intermediate_size", 4 * c.hidden_size)
        self.tied = bool(c.tie_word_embeddings)
        self.padding_idx = c.pad_token_id
        with torch.device("meta"):
            probe = self.layer_class(c, 0)
        self.layer_specs = [ParamSpec(n, tuple(p.shape)) for n, p in probe.named_parameters()]
        # a gated MLP (down(act(gate(x)) * up(x))) can run in chunks and skip its unread output
        self.gated_mlp = chunkable(probe.mlp, c.hidden_act)
        self.embed_specs = [ParamSpec("weight", (self.vocab, self.hidden))]
        self.head_specs = [ParamSpec("norm.weight", (self.hidden,))]
        if not self.tied:
            self.head_specs.append(ParamSpec("lm_head.weight", (self.vocab, self.hidden)))

    @property
    def layer_class(self) -> type:
        return getattr(self.modeling, f"{self.prefix}DecoderLayer")

    # ---- names in a `transformers` checkpoint ----
    def hf_names(self, tile: str) -> list[str]:
        """Checkpoint names of a tile's parameters, in spec order ('embed', 'head' or 'layer.N')."""
        if tile == "embed":
            return ["model.embed_tokens.weight"]
        if tile == "head":
            return ["model.norm.weight"] + ([] if self.tied else ["lm_head.weight"])
        index = int(tile.split(".")[1])
        return [f"model.layers.{index}.{s.name}" for s in self.layer_specs]

    def layer_type(self, index: int) -> str:
        """Which attention mask a layer uses: 'full_attention' or 'sliding_attention'."""
        types = getattr(self.config, "layer_types", None)
        if types:
            return types[index]
        if self.config.model_type == "mistral" and getattr(self.config, "sliding_window", None):
            return "sliding_attention"
        return "full_attention"

    # ---- sizes ----
    def layer_matmul_params(self) -> int:
        """Matmul weights of one decoder layer."""
        return sum(s.numel for s in self.layer_specs if s.decay)

    def mlp_matmul_params(self) -> int:
        """Matmul weights of one decoder layer's gated MLP (gate, up and down projections)."""
        return 3 * self.hidden * self.ffn

    def matmul_params(self) -> int:
        """Matmul weights of the decoder layers plus the LM head (the FLOPs formula's N)."""
        return self.layer_matmul_params() * self.num_layers + self.vocab * self.hidden

    def total_params(self) -> int:
        per_layer = sum(s.numel for s in self.layer_specs)
        head = sum(s.numel for s in self.head_specs)
        return per_layer * self.num_layers + self.vocab * self.hidden + head

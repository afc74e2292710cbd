"""A model's shape: its `transformers` config, parameter layouts and counts.

What the host store, the memory plan, the FLOPs formula, the harness and the workflow need to
know about a model without running it. The runtime side (layer templates, Bind, masks, rotary)
is in templates.py.
"""
from __future__ import annotations

import difflib
import importlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch
from transformers import AutoConfig, PretrainedConfig

from megatrain.chunked_mlp import chunkable
from megatrain.config import ModelConfig
from megatrain.presets import preset

# model_type -> class-name prefix in transformers.models.<type>.modeling_<type> (<type> as _MODULES
# names it where it differs); in each but Gemma's, a decoder layer's MLP output feeds only its
# residual sum (unread_mlp.output_unused relies on it: ModelShape.gated_mlp). The mixtures of
# experts (moe.py) replace the MLP by a router and stacked experts; DeepSeek's beside shared experts,
# its first layers dense (first_k_dense_replace: layers of two layouts), its attention latent (MLA).
# Phi-3 fuses q, k and v into one projection and gate and up into another: its modules stored as they are.
FAMILIES = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral", "phi3": "Phi3",
            "gemma2": "Gemma2", "gemma3_text": "Gemma3",
            "gpt_oss": "GptOss", "qwen3_moe": "Qwen3Moe", "mixtral": "Mixtral",
            "deepseek_v2": "DeepseekV2", "deepseek_v3": "DeepseekV3"}
_MODULES = {"gemma3_text": "gemma3"}  # Gemma 3's text model lives beside its multimodal one
# families whose every layer attends over the config's sliding_window when it is set (no layer_types)
_SLIDING_ALL = ("mistral", "qwen3_moe", "mixtral", "phi3")
# Gemma: the embedding's rows scaled by sqrt(hidden_size) (its TextScaledWordEmbedding, built with
# that scale by the model, not the config), norms that scale by (1 + weight) in float32
_GEMMA = ("gemma2", "gemma3_text")


def modeling(model_type: str) -> ModuleType:
    """The library's modeling module of a family."""
    name = _MODULES.get(model_type, model_type)
    return importlib.import_module(f"transformers.models.{name}.modeling_{name}")


# per-expert checkpoint names of the families whose checkpoints store each expert's projections apart
# (ModelShape.checkpoint_tensors): the MLP module's name there and each projection's
_QWEN_EXPERTS = {"mlp": ".mlp.", "gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
_EXPERT_NAMES = {
    "qwen3_moe": _QWEN_EXPERTS, "deepseek_v2": _QWEN_EXPERTS, "deepseek_v3": _QWEN_EXPERTS,
    "mixtral": {"mlp": ".block_sparse_moe.", "gate": "w1", "up": "w3", "down": "w2"},
}


@dataclass(frozen=True)
class ParamSpec:
    name: str  # the parameter's name inside its module (layer-relative for decoder layers)
    shape: tuple[int, ...]
    one_plus: bool = False  # a norm weight the library applies as (1 + weight): Gemma's, initialised zero

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def matmul(self) -> bool:
        """A matrix (or a stack of experts' matrices) that multiplies activations; expert biases,
        stacked to (experts, width), are biases still."""
        return len(self.shape) >= 2 and not self.name.endswith("bias")

    @property
    def decay(self) -> bool:
        """Weight decay applies to matrices, not to norm weights, biases and attention sinks (the
        common recipe)."""
        return self.matmul

    @property
    def expert(self) -> bool:
        """One slice per expert along the first dimension: a token's top-k experts use k of them."""
        return ".experts." in f".{self.name}"

    @property
    def init(self) -> str:
        """How `transformers` initialises it: 'normal' (N(0, initializer_range)), 'ones' or 'zeros'."""
        if self.matmul or self.name.endswith(("sinks", "router.bias")):  # GPT-OSS's sinks and router bias
            return "normal"
        return "zeros" if self.one_plus or self.name.endswith("bias") else "ones"


# fields a model reads where its config has them, though the config's defaults lack them (Qwen2's head_dim)
READ_WHERE_GIVEN = frozenset({"head_dim"})


def check_overrides(overrides: dict, model_type: str, given: dict) -> None:
    """Refuse an override that is no field of the config: transformers keeps any key as an
    attribute, so a misspelt one (num_hiden_layers) would change nothing without a word."""
    known = set(given) | set(AutoConfig.for_model(model_type).to_dict()) | READ_WHERE_GIVEN
    if unknown := sorted(set(overrides) - known):
        near = {k: difflib.get_close_matches(k, known, n=1) for k in unknown}
        hints = "; ".join(f"{k}: did you mean {m[0]}?" for k, m in near.items() if m)
        raise ValueError(f"model.overrides: {unknown} {'is' if len(unknown) == 1 else 'are'} no field of a {model_type} "
                         f"config" + (f" ({hints})" if hints else f"; its fields: {sorted(known)}"))


def load_hf_config(cfg: ModelConfig, cuda: bool | None = None) -> PretrainedConfig:
    """The `transformers` config of a run, from a preset, a config file, or a pretrained directory;
    `cuda`: whether the run has a GPU, for the attention `auto` picks (None: whether this machine has one)."""
    if cfg.preset:
        values = preset(cfg.preset)
    else:
        path = Path(cfg.config or cfg.pretrained)
        if cfg.pretrained and not path.is_dir():
            raise ValueError(f"model.pretrained: {path} {'is not a directory' if path.exists() else 'does not exist'} "
                             f"(a local checkpoint: config.json and safetensors; a config alone, for random "
                             f"weights, is model.config)")
        file = path / "config.json" if path.is_dir() else path
        if not file.is_file():
            raise ValueError(f"model: no config.json at {path}")
        try:
            values = json.loads(file.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"model: {file} is not valid JSON: {e}") from None
    given, values = values, {**values, **cfg.overrides}
    model_type = values.get("model_type")
    if model_type not in FAMILIES:
        raise ValueError(
            f"model: architecture {model_type!r} is not supported (no layer adapter for it); "
            f"supported model_type values: {sorted(FAMILIES)}")
    check_overrides(cfg.overrides, model_type, given)
    values.pop("model_type")
    for key in ("architectures", "transformers_version", "torch_dtype", "dtype", "quantization_config"):
        values.pop(key, None)  # a quantized checkpoint's settings: the store holds plain weights
    try:
        hf = AutoConfig.for_model(model_type, **values)
    except Exception as e:  # transformers validates the architecture: say which setting it refused
        cause = e.__cause__ or e
        raise ValueError(f"model: transformers refuses this {model_type} config: {cause}") from None
    check_sizes(hf)
    if getattr(hf, "use_bidirectional_attention", False):
        raise ValueError(f"model: {model_type} with use_bidirectional_attention (an embedding model's attention) "
                         f"is not a causal language model; set overrides.use_bidirectional_attention: false")
    pretrained = getattr(modeling(model_type), f"{FAMILIES[model_type]}PreTrainedModel")
    # the library's SDPA path drops Gemma's attention soft-capping without a word (a softcap that
    # only eager and flex attention apply): such a model has no SDPA attention here
    sdpa = pretrained._supports_sdpa and not getattr(hf, "attn_logit_softcapping", None)
    attn = cfg.attn_implementation
    cuda = torch.cuda.is_available() if cuda is None else cuda
    if attn == "auto":  # GPT-OSS's sinks and Gemma's soft-capping: eager or flex attention, flex on a GPU only
        attn = "sdpa" if sdpa else "flex_attention" if cuda else "eager"
    elif attn == "flex_attention" and not cuda:
        raise ValueError("model.attn_implementation: flex_attention trains on a GPU only (torch's FlexAttention has "
                         "no backward on the CPU); set it to eager or auto")
    elif attn == "sdpa" and not sdpa:
        raise ValueError(f"model.attn_implementation: {model_type} has no SDPA attention in transformers "
                         f"(GPT-OSS's attention sinks, Gemma's attn_logit_softcapping); set it to eager or auto")
    hf._attn_implementation = attn
    if getattr(hf, "num_local_experts", None) or getattr(hf, "num_experts", None):
        # the experts' kernel transformers picks by default (torch's grouped GEMM, on the CPU too):
        # the library's model trained as it is built and the templates compute the same sums
        hf._experts_implementation = "grouped_mm"
    return hf


def check_sizes(c: PretrainedConfig) -> None:
    """The sizes the layers are built from, where the library takes them as they are and fails deep in
    the model's construction or its first forward (a hand-written config.json, model.overrides)."""
    sizes = ["num_hidden_layers", "hidden_size", "vocab_size", "num_attention_heads"]
    sizes += [k for k in ("num_key_value_heads", "intermediate_size", "moe_intermediate_size", "head_dim")
              if getattr(c, k, None) is not None]
    if bad := [f"{k} {getattr(c, k)!r}" for k in sizes if not (isinstance(getattr(c, k), int) and getattr(c, k) >= 1)]:
        raise ValueError(f"model: sizes must be whole numbers of at least 1: {', '.join(bad)}")
    heads, kv_heads = c.num_attention_heads, getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    if heads % kv_heads:
        raise ValueError(f"model: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads} "
                         f"(each key-value head serves a whole group of query heads)")
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    if head_dim % 2:
        raise ValueError(f"model: the attention heads' width {head_dim} (head_dim, or hidden_size "
                         f"{c.hidden_size} // num_attention_heads {heads}) is odd: rotary embeddings turn pairs")
    experts = getattr(c, "num_local_experts", None) or getattr(c, "num_experts", None)
    if experts and not 1 <= getattr(c, "num_experts_per_tok", 0) <= experts:
        raise ValueError(f"model: num_experts_per_tok {getattr(c, 'num_experts_per_tok', None)!r} must be "
                         f"between 1 and the {experts} experts")


class ModelShape:
    """Parameter layouts, counts and per-layer kinds of one `transformers` decoder model."""

    def __init__(self, hf_config: PretrainedConfig):
        self.config = c = hf_config
        self.family = c.model_type
        self.modeling: ModuleType = modeling(c.model_type)
        self.prefix = FAMILIES[c.model_type]
        # dropout, and Mixtral's router jitter, draw random numbers in every forward: the recompute
        # would draw others than the forward did
        for key in ("attention_dropout", "resid_pdrop", "router_jitter_noise"):
            if getattr(c, key, None):
                raise ValueError(f"model: {key} > 0 is not supported (set overrides.{key}: 0)")
        self.num_layers = c.num_hidden_layers
        self.hidden = c.hidden_size
        self.vocab = c.vocab_size
        self.tied = bool(c.tie_word_embeddings)
        self.padding_idx = c.pad_token_id
        # the MLP's activation: Gemma's modules read hidden_activation (a stray hidden_act changes nothing)
        self.hidden_act = getattr(c, "hidden_activation", None) or getattr(c, "hidden_act", None)
        gemma = self.family in _GEMMA
        # how the norms apply their weight (lean_norm._rms_norm); the embedding's scale, None for 1;
        # the tanh soft-capping of the final logits (Gemma's final_logit_softcapping), None for none
        self.norm_scale = "one_plus" if gemma else "float32" if self.family == "gpt_oss" else "input"
        self.embed_scale = c.hidden_size ** 0.5 if gemma else None
        self.logit_softcap = getattr(c, "final_logit_softcapping", None)
        # experts per layer and per token (0 and 0: a dense MLP); the router's auxiliary loss joins
        # the training loss where the config asks for it, as in the library's model (moe.py)
        self.experts = getattr(c, "num_local_experts", None) or getattr(c, "num_experts", None) or 0
        self.top_k = getattr(c, "num_experts_per_tok", 0) if self.experts else 0
        self.router_aux_coef = (float(c.router_aux_loss_coef)
                                if self.experts and getattr(c, "output_router_logits", False) else 0.0)
        self.head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        # queries' and keys' width per head, and the values' and attention output's: head_dim both but
        # in DeepSeek's latent attention (MLA), whose head_dim is the rotary part alone; q k^T and the
        # product with v count a token (qk + v) / 2 of width each (the FLOPs formula's a_l)
        qk_head_dim = getattr(c, "qk_head_dim", None) or self.head_dim
        self.v_head_dim = getattr(c, "v_head_dim", None) or self.head_dim
        self.attn_width = c.num_attention_heads * (qk_head_dim + self.v_head_dim) // 2
        # every layer built on the meta device: DeepSeek's first first_k_dense_replace layers have a dense
        # MLP where the others have a router and experts. Each distinct layout once (`layer_layouts`, by
        # first layer), and which one each layer has (`layout_of`); a layer's persistent buffers (the
        # DeepSeek-V3 router's e_score_correction_bias) apart from its parameters: never trained
        with torch.device("meta"):
            probes = [self.layer_class(c, i) for i in range(self.num_layers)]
        layouts: dict[tuple, int] = {}
        kinds = []  # a layer of each layout
        self.layout_of: list[int] = []
        for probe in probes:
            norms = {n for n, m in probe.named_modules() if type(m).__name__.endswith("RMSNorm")}
            specs = tuple(ParamSpec(n, tuple(p.shape), gemma and n.rpartition(".")[0] in norms)
                          for n, p in probe.named_parameters())
            key = (specs, tuple(ParamSpec(n, tuple(b.shape)) for n, b in probe.named_buffers()))
            if key not in layouts:
                layouts[key] = len(layouts)
                kinds.append(probe)
            self.layout_of.append(layouts[key])
        self.layer_layouts = [list(specs) for specs, _ in layouts]
        self._buffer_layouts = [list(buffers) for _, buffers in layouts]
        # the largest layer's specs (every layer's where all have one layout): what holds any layer is sized by
        self.layer_specs = max(self.layer_layouts, key=lambda specs: sum(s.numel for s in specs))
        # a gated MLP (down(act(gate(x)) * up(x))) whose output feeds only the residual sum can run in
        # chunks and skip its unread output; Gemma's passes through post_feedforward_layernorm, whose
        # backward reads it
        self.gated_mlp = all(chunkable(probe.mlp, self.hidden_act) for probe in kinds) and not gemma
        # the MLP's width a token's activations have, and what it keeps per token for its backward, in
        # elements, of the widest layer, with the library's code and with the engine's compiled kernels
        # (engine.mlp_kernel): gate's and up's outputs, the activation and their product for a dense
        # one, the compiled product not the activation; a mixture of experts' grouped experts keep,
        # per pick, the gathered input and the output (2 h), about 7 of the expert's width and the
        # routing's indices (18 bf16 elements), the lean ones with their compiled gate (a GPU's
        # default) the gathered input, the gate's input and output (3 of the width; GPT-OSS's on a GPU
        # not the output, which their backward makes again: one width less than counted) and three
        # int64 indices (12 bf16 elements, 13 with the experts' counts and offsets): saved-tensor hooks
        # on GPT-OSS and Qwen3-MoE experts (tests/engine/test_lean_experts.py); DeepSeek's shared experts
        # (a dense MLP, the library's) beside them
        expert_ffn = getattr(c, "moe_intermediate_size", None) or getattr(c, "intermediate_size", None)
        shared = (getattr(c, "n_shared_experts", None) or 0) * expert_ffn if self.experts else 0

        def mlp(specs: list[ParamSpec]) -> tuple[int, int, int]:
            if not any(s.expert for s in specs):
                ffn = getattr(c, "intermediate_size", 4 * c.hidden_size)
                return ffn, 4 * ffn, 3 * ffn
            return (self.top_k * expert_ffn + shared, self.top_k * (2 * c.hidden_size + 7 * expert_ffn + 18) + 4 * shared,
                    self.top_k * (c.hidden_size + 3 * expert_ffn + 13) + 4 * shared)
        widths = [mlp(specs) for specs in self.layer_layouts]
        self.ffn, self.mlp_kept, self.mlp_kept_compiled = (max(w[i] for w in widths) for i in range(3))
        self.expert_ffn = expert_ffn if self.experts else 0
        self.embed_specs = [ParamSpec("weight", (self.vocab, self.hidden))]
        self.head_specs = [ParamSpec("norm.weight", (self.hidden,), gemma)]
        if not self.tied:
            self.head_specs.append(ParamSpec("lm_head.weight", (self.vocab, self.hidden)))

    @property
    def layer_class(self) -> type:
        return getattr(self.modeling, f"{self.prefix}DecoderLayer")

    def specs(self, index: int) -> list[ParamSpec]:
        """Layer `index`'s parameter specs."""
        return self.layer_layouts[self.layout_of[index]]

    def buffer_specs(self, index: int) -> list[ParamSpec]:
        """Layer `index`'s persistent buffers, in the module's order: none but DeepSeek-V3's router's
        e_score_correction_bias, which the library keeps in float32 and never trains (docs/moe.md)."""
        return self._buffer_layouts[self.layout_of[index]]

    def units(self) -> list[tuple[str, list[ParamSpec]]]:
        """The store's tiles in order, each by name ('embed', 'layer.N', 'head') with its parameter specs."""
        return [("embed", self.embed_specs), *((f"layer.{i}", self.specs(i)) for i in range(self.num_layers)),
                ("head", self.head_specs)]

    # ---- names in a `transformers` checkpoint ----
    def hf_names(self, tile: str) -> list[str]:
        """Names of a tile's parameters in the library's model, in spec order ('embed', 'head' or 'layer.N')."""
        if tile == "embed":
            return ["model.embed_tokens.weight"]
        if tile == "head":
            return ["model.norm.weight"] + ([] if self.tied else ["lm_head.weight"])
        index = int(tile.split(".")[1])
        return [f"model.layers.{index}.{s.name}" for s in self.specs(index)]

    def buffer_names(self, index: int) -> list[str]:
        """Names of layer `index`'s buffers in the library's model (and its checkpoints), in spec order."""
        return [f"model.layers.{index}.{s.name}" for s in self.buffer_specs(index)]

    def checkpoint_tensors(self, tile: str, views: list[torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        """The tensors a published checkpoint stores for a tile, each a view of the tile's parameter
        `views`. Qwen3-MoE and Mixtral store one tensor per expert and projection (the library fuses
        them on loading and splits them again on saving, transformers' conversion_mapping.py): the
        gate projection of expert E is the first half of the fused `experts.gate_up_proj[E]`, the up
        projection its second, the down projection `experts.down_proj[E]`; Qwen3-MoE names them
        `experts.E.gate_proj`, `up_proj`, `down_proj`, Mixtral `experts.E.w1`, `w3`, `w2`, under
        `block_sparse_moe` where the module is `mlp` (its router too: `block_sparse_moe.gate`)."""
        names = _EXPERT_NAMES.get(self.family)
        out = []
        for name, view in zip(self.hf_names(tile), views, strict=True):
            if names is None or ".mlp." not in name:
                out.append((name, view))
                continue
            name = name.replace(".mlp.", names["mlp"], 1)
            stem, _, leaf = name.rpartition(".experts.")
            if not stem:  # the router
                out.append((name, view))
            elif leaf == "gate_up_proj":
                half = view.shape[1] // 2
                for e in range(view.shape[0]):
                    out += [(f"{stem}.experts.{e}.{names['gate']}.weight", view[e, :half]),
                            (f"{stem}.experts.{e}.{names['up']}.weight", view[e, half:])]
            else:
                out += [(f"{stem}.experts.{e}.{names['down']}.weight", view[e]) for e in range(view.shape[0])]
        return out

    def layer_type(self, index: int) -> str:
        """Which attention mask a layer uses: 'full_attention' or 'sliding_attention'."""
        types = getattr(self.config, "layer_types", None)
        if types:
            return types[index]
        if self.config.model_type in _SLIDING_ALL and getattr(self.config, "sliding_window", None):
            return "sliding_attention"
        return "full_attention"

    def attention_scores(self, seq_len: int) -> int:
        """Elements of one score tensor that eager attention materialises for a sequence (every head,
        every query against every key and GPT-OSS's sink); 0 for SDPA and flex attention, whose
        memory is linear in the sequence."""
        if self.config._attn_implementation != "eager":
            return 0
        return self.config.num_attention_heads * seq_len * (seq_len + 1)

    def window(self, index: int) -> int | None:
        """The keys a layer's query sees at most: the sliding window, or None (the whole sequence)."""
        return self.config.sliding_window if self.layer_type(index) == "sliding_attention" else None

    # ---- sizes ----
    def layer_matmul_params(self, index: int = 0, active: bool = True) -> int:
        """Matmul weights of decoder layer `index`: all of them, or (`active`) those one token multiplies
        by: of stacked experts' matrices, top-k of the experts (DeepSeek's shared experts all)."""
        specs = self.specs(index)
        dense = sum(s.numel for s in specs if s.matmul and not s.expert)
        experts = sum(s.numel for s in specs if s.matmul and s.expert)
        return dense + (experts * self.top_k // self.experts if active and self.experts else experts)

    def unread_params(self, index: int, lean_experts: bool) -> int:
        """Matmul weights a token leaves out of the recompute of layer `index` where nothing reads its
        output (a recomputed block's last layer: unread_mlp.py): a gated MLP's down projection, or,
        with the lean experts' compiled gate (`lean_experts`: lean_experts._DownCombine), the down
        projections of a mixture's top-k experts."""
        if any(s.expert for s in self.specs(index)):
            return self.top_k * self.expert_ffn * self.hidden if lean_experts else 0
        return self.hidden * self.ffn if self.gated_mlp else 0

    def mlp_matmul_params(self) -> int:
        """Matmul weights of one decoder layer's gated MLP (gate, up and down projections)."""
        return 3 * self.hidden * self.ffn

    def matmul_params(self, active: bool = True) -> int:
        """Matmul weights of the decoder layers plus the LM head, all of them or (`active`) those a
        token multiplies by (the FLOPs formula's N; the same for a dense model)."""
        return sum(self.layer_matmul_params(i, active) for i in range(self.num_layers)) + self.vocab * self.hidden

    def attention(self, layers: Iterable[int] | None = None) -> list[tuple[int, int | None]]:
        """(attention width, window) of each decoder layer (of `layers`): the FLOPs formula's
        attention term (metrics.model_flops)."""
        return [(self.attn_width, self.window(i)) for i in (range(self.num_layers) if layers is None else layers)]

    def total_params(self) -> int:
        layers = sum(s.numel for i in range(self.num_layers) for s in self.specs(i))
        head = sum(s.numel for s in self.head_specs)
        return layers + self.vocab * self.hidden + head

"""Run settings: typed dataclasses, YAML loading with dotted overrides, validation up front.

Every combination that cannot work is rejected here, before anything is allocated or written,
with a ValueError that names the setting to change.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import re
from dataclasses import dataclass, field
from pathlib import Path
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import yaml

from megatrain import hub


def _convert(value: Any, hint: Any) -> Any:
    """`value` as the declared type `hint`, converted where that is unambiguous (a YAML string that
    spells a number); raises TypeError where it is not of that type."""
    origin, args = get_origin(hint), get_args(hint)
    if hint is Any:
        return value
    if origin in (Union, UnionType):
        for member in args:
            try:
                return _convert(value, member)
            except TypeError:
                pass
        raise TypeError
    if origin is Literal:
        if value in args and type(value) in {type(a) for a in args}:
            return value
        raise TypeError
    if (origin or hint) in (type(None), bool, str, dict):  # taken as they are, never converted
        if isinstance(value, origin or hint):
            return value
        raise TypeError
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lstrip("+-").isdigit():
            return int(value)
        raise TypeError
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise TypeError
    if origin is tuple:
        if isinstance(value, (list, tuple)) and len(value) == len(args):
            return tuple(_convert(v, a) for v, a in zip(value, args))
        raise TypeError
    if origin is list:
        if isinstance(value, list):
            return [_convert(v, args[0]) for v in value]
        raise TypeError
    raise AssertionError(f"no conversion for the declared type {hint}")


def _type_name(hint: Any) -> str:
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, UnionType):
        return " or ".join(_type_name(a) for a in args)
    if origin is Literal:
        return " or ".join(repr(a) for a in args)
    if hint is type(None):
        return "null"
    if origin is tuple:
        return f"a list of {len(args)} ({', '.join(_type_name(a) for a in args)})"
    if origin is dict:
        return "a mapping"
    if origin is list:
        return f"a list of {_type_name(args[0])}"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(hint, str(hint))


SEED_MAX = 2**32 - 1  # every generator a seed reaches takes it (numpy's bound), with room for offsets


def check_seed(value: int, name: str) -> None:
    if not 0 <= value <= SEED_MAX:
        raise ValueError(f"{name} must be a whole number from 0 to {SEED_MAX} (2^32 - 1), not {value}")


def check_types(settings: Any, section: str) -> None:
    """Convert or refuse every field of a settings dataclass by its declared type, naming the
    setting, the value and the type it needs."""
    hints = get_type_hints(type(settings))
    for f in dataclasses.fields(settings):
        if dataclasses.is_dataclass(hints[f.name]):
            continue
        value = getattr(settings, f.name)
        try:
            converted = _convert(value, hints[f.name])
        except TypeError:
            name = f"{section}.{f.name}" if section else f.name
            raise ValueError(f"{name} must be {_type_name(hints[f.name])}, not {value!r}") from None
        object.__setattr__(settings, f.name, converted)


@dataclass
class ModelConfig:
    preset: str | None = None  # a named shape from megatrain.presets
    config: str | None = None  # a local config.json (or a directory holding one)
    # a local directory with config.json and safetensors, or a Hub model id (org/name): its
    # snapshot in the Hugging Face cache, downloaded where it is missing (megatrain/hub.py)
    pretrained: str | None = None
    overrides: dict[str, Any] = field(default_factory=dict)  # config fields to change
    # auto: SDPA where transformers has it for the family; else (GPT-OSS: attention sinks, which
    # SDPA lacks) flex attention where a GPU is, eager attention (memory quadratic in the sequence) where not
    attn_implementation: Literal["auto", "sdpa", "eager", "flex_attention"] = "auto"

    def __post_init__(self):
        check_types(self, "model")
        given = [k for k in ("preset", "config", "pretrained") if getattr(self, k)]
        if len(given) != 1:
            raise ValueError(f"model: give exactly one of preset, config, pretrained (got {given or 'none'})")
        if self.pretrained and hub.is_hub_id(self.pretrained):
            self.pretrained = hub.model_dir("model.pretrained", self.pretrained)


@dataclass
class EngineConfig:
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    compute_dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # auto: bfloat16 on CUDA, float32 on CPU
    # the masters AdamW updates: float32, full precision, 12 B/param on the host (master 4, moments 8;
    # clipping keeps a float32 gradient besides: 16), whole (a load casts them to the compute dtype
    # on the device) or split (split_masters); bfloat16, not full precision, 10 B/param
    master_dtype: Literal["float32", "bfloat16"] = "float32"
    # float32 masters with bf16 compute held as their bf16 shadow plus their low 16 bits, exactly, 12
    # B/param as whole: a load moves the 2-byte shadow instead of the 4-byte master (the eager CPU
    # update is 2-4x slower split: docs/host-store.md); auto: wherever the compiled update runs
    # (optimizer_kernel)
    split_masters: bool | Literal["auto"] = "auto"
    checkpoint_every: int = 4  # K: keep one activation checkpoint every K layers
    weight_buffers: int = 2  # device weight buffers; 1 disables prefetch (ablation)
    offload_checkpoints: bool = False  # block checkpoints in pinned host memory: device memory flat in depth
    # pinned gradient slabs, each one layer's float32 gradient on its way to the host's AdamW: the
    # queue that lets the backward run ahead of the updates (without clipping: with it each tile's
    # gradient returns into the tile's own buffer, and no slab is allocated); 0 returns gradients
    # synchronously (ablation); auto: 8 where the host holds them beside the plan, else 4, else 2, at most
    # the pieces a step returns to the host (resolve.py)
    grad_slabs: int | Literal["auto"] = "auto"
    # tiles in forward order (embedding, layer 0, 1, ...) whose master and moments live in device
    # memory and update there: the updates that stay exposed on the CPU (see store.py); auto: as
    # many as the memory plan leaves device room for (resolve.py), none on the CPU, after the kept
    # attention where its recompute costs more than the host's update of the first two tiles (long
    # sequences); 0: every update on the host, as the paper's system does
    device_tiles: int | Literal["auto"] = "auto"
    loss_chunk_tokens: int = 4096  # tokens per LM-head/cross-entropy chunk
    # tokens per MLP chunk, forward and backward (long contexts); null: whole; auto: whole when the
    # memory plan fits the device, else the largest chunk that makes it fit (resolve.py)
    mlp_chunk_tokens: int | Literal["auto"] | None = "auto"
    # the last N layers keep their forward graph for the backward instead of recomputing it (their
    # activations stay on the device); auto: as many as the memory plan leaves device room for
    no_recompute_layers: int | Literal["auto"] = 0
    # the last N recomputed layers whose attention can be kept (the library's SDPA; a window, if any,
    # wider than the sequence) keep its output and log-sum-exp from the forward, so their recompute
    # runs no attention core (a 7B layer at 4096-token sequences: 11% of its recompute's FLOPs by the
    # FLOPs formula, more as sequences grow), for tokens x heads x head_dim x 2 (bf16) + heads x
    # tokens x 4 bytes of device memory per layer and micro-batch (kept_attention.py); the same
    # gradients as recomputing it, which a micro-batch with padding or packed rows does. auto: as
    # many as the memory plan leaves device room for after device_tiles and no_recompute_layers, or
    # before both where the attention's recompute costs more than the first two tiles' host update
    # (long sequences) (none on the CPU); 0: none; more than can keep it: all that can
    keep_attention_layers: int | Literal["auto"] = "auto"
    # the kept attention the device has no room for in pinned host memory from the forward to the
    # recompute, back one block ahead (activations.py): the device holds two blocks' of it at most,
    # so more layers keep their attention, for tokens x heads x (head_dim x 2 + 4) bytes per layer
    # and micro-batch of host memory and as many across the link each way; those the device holds
    # stay there; keep_attention_layers auto then keeps as many as the device and the host hold
    offload_attention: bool = False
    optimizer_threads: int | None = None  # CPU threads for AdamW; None: torch's default
    # the host AdamW of float32 masters, whole or split: compiled (a C++ kernel, one pass over memory:
    # fused_adamw.py; needs a C++ compiler) or eager (torch's fused AdamW, and passes around it for
    # the split), the same numbers;
    # auto: compiled where it builds, else eager
    optimizer_kernel: Literal["auto", "compiled", "eager"] = "auto"
    # the decoder layers' RMSNorms: eager (the library's ops, and autograd's backward through them)
    # or compiled (torch.compile: forward and backward each one fused kernel; equal to rounding:
    # lean_norm.py); auto: compiled on a GPU, eager on the CPU (where the tests hold the engine
    # exact against the library)
    norm_kernel: Literal["auto", "compiled", "eager"] = "auto"
    # the SiLU-gated MLP's silu(gate) * up: eager (the library's) or compiled (one fused kernel each
    # way, gate and up kept: swiglu.py); the whole MLP only (a chunked MLP runs its own), refused
    # for other MLPs; for a mixture of experts, the gate between the experts' projections
    # (GPT-OSS's clamped one, the SiLU one of the others) and the router's weighting and sum back
    # to tokens (lean_experts.py), with the lean experts only;
    # auto: compiled on a GPU where the MLP is SiLU-gated or the lean experts' gate compiles, else eager
    mlp_kernel: Literal["auto", "compiled", "eager"] = "auto"
    # the queries' and keys' rotary embedding: eager (the library's ops: five passes each way over
    # each) or compiled (one fused kernel each way: rotary.py), for the families whose rotary is
    # Llama's form (float32 inside; equal to rounding) or GPT-OSS's (the library's roundings; to the
    # bit), refused for the others; auto: compiled on a GPU where it applies, else eager
    rotary_kernel: Literal["auto", "compiled", "eager"] = "auto"
    # GPT-OSS's attention sinks after flex attention: eager (the library's: the output times each
    # query's factor, torch's broadcast product each way) or compiled (that product one compiled
    # kernel each way: sinks.py; the forward to the bit, the factor's gradient equal to rounding);
    # auto: compiled where the model's attention is flex attention with sinks (a GPU), else eager
    sinks_kernel: Literal["auto", "compiled", "eager"] = "auto"
    # the cross-entropy over each chunk's logits: eager (the library's: float32 logits, then its
    # log-softmax and backward, each a pass over chunk x vocab) or compiled (torch.compile: the loss
    # and its gradient from the logits in two passes, float32 inside; equal to rounding: loss.py);
    # auto: compiled on a GPU (7B on the H100: +1.5% at 4 x 4096, the head 523 -> 396 ms at
    # 16 x 4096; docs/decisions.md, "The compiled loss"), eager on the CPU; both track each other on the GPU
    # (tests/engine/test_gpu.py)
    loss_kernel: Literal["auto", "compiled", "eager"] = "auto"
    # a mixture of experts' experts: library (transformers' grouped-GEMM experts) or lean (the same
    # grouped GEMMs and gate without expert parallelism's sentinel masks, the routing's gathers undone
    # by gathers: lean_experts.py; the forward bit for bit the library's); auto: lean on a GPU, the
    # library's on the CPU (where the tests hold the engine exact against the library)
    experts_kernel: Literal["auto", "library", "lean"] = "auto"
    host_memory_gb: float | None = None  # host memory to admit against; None: read from the OS
    device_memory_gb: float | None = None  # device memory to admit against; None: read from the GPU
    timeline: bool = True  # time every op per stream (CUDA events) for the exposed-time breakdown

    def __post_init__(self):
        check_types(self, "engine")
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"engine.device must be auto, cpu, cuda or cuda:N, not {self.device!r}")
        for name, low in (("checkpoint_every", 1), ("weight_buffers", 1), ("loss_chunk_tokens", 1)):
            if getattr(self, name) < low:
                raise ValueError(f"engine.{name} must be at least {low}, not {getattr(self, name)}")
        if isinstance(self.mlp_chunk_tokens, int) and self.mlp_chunk_tokens < 1:
            raise ValueError(f"engine.mlp_chunk_tokens must be a positive integer, auto or null, not {self.mlp_chunk_tokens}")
        if self.optimizer_threads is not None and self.optimizer_threads < 1:
            raise ValueError(f"engine.optimizer_threads must be at least 1, or null, not {self.optimizer_threads}")
        for name in ("grad_slabs", "device_tiles", "no_recompute_layers", "keep_attention_layers"):
            n = getattr(self, name)
            if isinstance(n, int) and n < 0:
                raise ValueError(f"engine.{name} must be an integer >= 0 or auto, not {n}")
        if self.offload_attention and self.keep_attention_layers == 0:
            raise ValueError("engine.offload_attention: true offloads the attention of the layers that keep it, and "
                             "engine.keep_attention_layers is 0: set it to auto or a number, or offload_attention false")


@dataclass(frozen=True)
class EngineSettings:
    """The engine's settings as a run uses them: every `auto` decided (resolve.py), dtypes named.

    Built once per run from EngineConfig, the model's shape and the machine; the memory plan, the
    store and the engine read these, and a run's records say what ran."""
    device: str
    compute_dtype: Literal["float32", "bfloat16"]
    master_dtype: Literal["float32", "bfloat16"]
    split_masters: bool  # host tiles keep float32 masters as a bf16 shadow plus the low halves
    checkpoint_every: int
    weight_buffers: int
    offload_checkpoints: bool
    grad_slabs: int
    device_tiles: int
    loss_chunk_tokens: int
    mlp_chunk_tokens: int | None
    no_recompute_layers: int
    keep_attention_layers: int  # recomputed layers that keep their attention (schedule.layers_keeping_attention)
    # of those, the first this many keep it in pinned host memory between forward and recompute
    offloaded_attention_layers: int
    optimizer_threads: int | None
    optimizer_kernel: Literal["compiled", "eager"]  # compiled: the one pass, for the host tiles with float32 masters
    norm_kernel: Literal["compiled", "eager"]
    mlp_kernel: Literal["compiled", "eager"]
    rotary_kernel: Literal["compiled", "eager"]
    sinks_kernel: Literal["compiled", "eager"]
    loss_kernel: Literal["compiled", "eager"]
    experts_kernel: Literal["library", "lean"]
    timeline: bool
    tokens: int  # per micro-batch (batch_size x seq_len)
    seq_len: int  # tokens per sequence at most
    microbatches: int  # per step
    clipping: bool  # optim.max_grad_norm is set: the store keeps a float32 gradient per parameter
    pinned: bool  # the host buffers the device copies from are pinned (a GPU run)
    ranks: int = 1  # data-parallel ranks in all (tokens is one rank's micro-batch)
    local_ranks: int = 1  # ranks on this host, sharing one host store (distributed.py)

    @property
    def compute(self):
        """The compute dtype as a torch dtype (torch is imported only here, not to read a config)."""
        import torch
        return getattr(torch, self.compute_dtype)

    @property
    def master(self):
        import torch
        return getattr(torch, self.master_dtype)


# transformers.get_scheduler's schedules that are functions of the step (tests/engine/test_schedules.py
# holds this list to the library's)
SCHEDULES = Literal["linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
                    "inverse_sqrt", "cosine_with_min_lr", "cosine_warmup_with_min_lr", "warmup_stable_decay"]


@dataclass
class OptimConfig:
    lr: float = 1e-5  # the peak learning rate, reached at the end of the warm-up
    betas: tuple[float, float] = (0.9, 0.95)  # AdamW's decay rates of the two moments
    eps: float = 1e-8  # AdamW's epsilon
    weight_decay: float = 0.0  # decoupled (AdamW)
    # which parameters take weight_decay: matrices (no decay on norms and biases, as the HF Trainer),
    # or all (torch.optim.AdamW over model.parameters())
    decay: Literal["matrices", "all"] = "matrices"
    max_grad_norm: float | None = 1.0  # None disables clipping
    # steps of warm-up to lr, as transformers' schedules count them: update t (0-based) of the
    # warm-up takes lr x t / warmup_steps, so the first update's is 0 (as in the HF Trainer)
    warmup_steps: int = 0
    # the learning-rate schedule, transformers.get_scheduler's (the HF Trainer's lr_scheduler_type),
    # applied as the HF Trainer applies it: update t takes lr x the schedule's factor at t. Those
    # driven by a metric (reduce_lr_on_plateau, greedy) are not offered
    schedule: SCHEDULES = "cosine_with_min_lr"
    # the *_with_min_lr schedules' last learning rate as a fraction of lr (their min_lr_rate); null:
    # 0.1 for them; refused with the other schedules
    min_lr_ratio: float | None = None
    # the schedule's own further arguments (get_scheduler's scheduler_specific_kwargs, the HF Trainer's
    # lr_scheduler_kwargs): num_cycles of cosine_with_restarts, power and lr_end of polynomial,
    # timescale of inverse_sqrt, num_decay_steps and decay_type of warmup_stable_decay, ...
    schedule_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        check_types(self, "optim")
        if not self.lr > 0:
            raise ValueError(f"optim.lr must be positive, not {self.lr}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"optim.betas must be two numbers in [0, 1), not {self.betas}")
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            raise ValueError("optim.max_grad_norm must be positive, or null to disable clipping")
        for name in ("eps", "weight_decay"):  # as torch.optim.AdamW checks them
            if not getattr(self, name) >= 0:
                raise ValueError(f"optim.{name} must be at least 0, not {getattr(self, name)}")
        if self.warmup_steps < 0:
            raise ValueError(f"optim.warmup_steps must be at least 0, not {self.warmup_steps}")
        if self.min_lr_ratio is not None:
            if not self.schedule.endswith("_with_min_lr"):
                raise ValueError(f"optim.min_lr_ratio applies to the schedules cosine_with_min_lr and "
                                 f"cosine_warmup_with_min_lr, not {self.schedule}")
            if not 0 <= self.min_lr_ratio <= 1:
                raise ValueError(f"optim.min_lr_ratio must be in [0, 1], not {self.min_lr_ratio}")
        if self.schedule == "constant" and self.warmup_steps:  # transformers' constant has no warm-up
            raise ValueError("optim.schedule constant takes no warm-up: with optim.warmup_steps, use "
                             "constant_with_warmup")


@dataclass
class DataConfig:
    # file: data.path (or data.mix); synthetic: random tokens; auto: file where data.path or data.mix
    # is given, else synthetic
    source: Literal["auto", "synthetic", "file"] = "auto"
    # for source=file: a json, jsonl, parquet, csv or txt file, a folder of such shards (one
    # type), a folder written by datasets' save_to_disk, a dataset repository's folder (data files
    # and a README naming its subsets), or a Hub dataset id (org/name, read by datasets.load_dataset)
    path: str | None = None
    # or several datasets mixed by weight, {path or Hub id: weight}: each read and tokenised (and
    # cached) alone, its examples then drawn in proportion to the weights (pipeline.mix)
    mix: dict[str, Any] = field(default_factory=dict)
    # first_exhausted: no example repeated, a dataset with more than its weight's share subsampled;
    # all_exhausted: every example used, the others repeated to their share (datasets' names)
    mix_stopping: Literal["first_exhausted", "all_exhausted"] = "first_exhausted"
    subset: str | None = None  # the configuration of a Hub dataset (or repository folder) that has several
    # the split trained on, of a Hub dataset, a repository folder or a save_to_disk folder; None:
    # train (or a save_to_disk folder's only split)
    split: str | None = None
    # text: documents joined and cut into seq_len; instruction: prompt_field/response_field;
    # alpaca: instruction, input, output (and optional system, history); chat: messages_field of
    # {role, content} (tool_calls, reasoning_content and tool messages too, tools_field beside);
    # sharegpt: conversations of {from, value} (and optional system, tools) (megatrain/data/formats.py)
    format: Literal["text", "instruction", "alpaca", "chat", "sharegpt"] = "text"
    text_field: str = "text"  # format text: the column of the text
    prompt_field: str = "prompt"  # format instruction: the column of the prompt
    response_field: str = "response"  # format instruction: the column of the response
    messages_field: str = "messages"  # format chat: the column of the list of {role, content}
    # chat: the tools each conversation may call (a list of JSON schemas, or that list as a JSON
    # string), rendered into the prompt by the chat template; read where the data has this column
    tools_field: str = "tools"
    # instruction/alpaca: auto uses the tokenizer's chat template if it has one, else plain
    # (BOS prompt separator response EOS)
    template: Literal["auto", "chat", "plain"] = "auto"
    separator: str = "\n"  # between prompt and response in the plain template
    tokenizer: str | None = None  # a local tokenizer directory or a Hub model id; default: the pretrained model's
    # the chat template to render chats with (and to save with the model): a .jinja file, or a
    # tokenizer (a local directory or a Hub model id) whose template to take; default: the tokenizer's
    chat_template: str | None = None
    seq_len: int = 512  # the longest example (or packed row), in tokens
    overlong: Literal["truncate", "drop"] = "truncate"  # examples longer than seq_len
    unmaskable: Literal["error", "drop"] = "error"  # chat examples whose labels cannot be exact
    # what the loss learns of chat and instruction data: every assistant turn (its content, thinking,
    # tool calls and end of turn); last_turn: the last assistant turn only, the earlier ones context
    # (LlamaFactory's mask_history); all: every token of the rendered example, the prompt's too
    # (train_on_prompt)
    targets: Literal["assistant", "last_turn", "all"] = "assistant"
    packing: bool = False  # several examples per row, attention and positions kept apart
    # each padded batch (packed rows, rows of several lengths) padded to a multiple of this many
    # tokens (at most seq_len): a handful of widths, not one per batch; each new width costs the GPU's
    # masked attention a plan built anew (cuDNN's: 0.05-1 s a width on the H200, docs/architecture.md
    # "Data"); rows all of one length stay as they are; null: padded to the longest row only
    pad_to_multiple_of: int | None = 64
    batch_size: int = 1  # sequences (or packed rows) per micro-batch
    grad_accum: int = 1  # micro-batches per optimizer step
    seed: int = 0  # the examples' order each epoch, the eval_fraction split, synthetic data's tokens
    num_proc: int | None = None  # tokenising processes; None: one per core for large datasets
    eval_path: str | None = None  # held-out data in the same format (its train split, or a save_to_disk folder's only one)
    eval_split: str | None = None  # or this split of data.path held out (a Hub dataset's test split)
    eval_fraction: float | None = None  # or this fraction of the examples, held out (seeded)
    repeat_batch: bool = False  # synthetic only: the same batch every step (a memorisation check)

    def __post_init__(self):
        check_types(self, "data")
        if self.source == "auto":
            self.source = "file" if self.path or self.mix else "synthetic"
        elif self.source == "synthetic" and (self.path or self.mix):  # random tokens where a file was meant
            given = f"data.path {self.path!r}" if self.path else f"data.mix {self.mix!r}"
            raise ValueError(f"{given} is given but data.source is synthetic (random tokens): set data.source: file, "
                             f"or leave data.source out")
        if self.source == "file":
            if bool(self.path) == bool(self.mix):
                raise ValueError("data.source file reads data.path, or data.mix (several datasets by weight): give one")
            for path in [self.path] if self.path else self.mix:
                if not isinstance(path, str) or not Path(path).exists() and not hub.is_hub_id(path):
                    raise ValueError(f"data.{'path' if self.path else 'mix'} {path!r} does not exist")
            for path, weight in self.mix.items():
                if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
                    raise ValueError(f"data.mix: the weight of {path} must be a positive number, not {weight!r}")
            if self.mix and (self.subset or self.split or self.eval_split):
                raise ValueError("data.subset, data.split and data.eval_split name a part of one dataset, not of "
                                 "data.mix's; mix save_to_disk folders or files of those parts")
        elif self.eval_path or self.eval_fraction or self.eval_split or self.packing:
            raise ValueError("data.eval_path, data.eval_fraction, data.eval_split and data.packing need data.source: file")
        if self.repeat_batch and self.source != "synthetic":
            raise ValueError("data.repeat_batch applies to data.source synthetic only")
        instruction = self.format in ("instruction", "alpaca")
        if self.template != "auto" and not instruction:  # chat data always takes the chat template
            raise ValueError(f"data.template applies to format instruction or alpaca, not {self.format}")
        if self.targets != "assistant" and self.format == "text":
            raise ValueError("data.targets applies to chat, sharegpt, instruction and alpaca data; text learns every token")
        if self.chat_template and (self.format == "text" or (instruction and self.template == "plain")):
            raise ValueError(f"data.chat_template renders chats: format chat, sharegpt, instruction or alpaca (with "
                             f"data.template auto or chat), not format {self.format} with template {self.template}")
        if self.separator != "\n" and not (instruction and self.template != "chat"):
            raise ValueError("data.separator joins prompt and response in the plain template: format instruction or "
                             "alpaca, data.template plain (or auto without a chat template)")
        for name, low in (("seq_len", 2), ("batch_size", 1), ("grad_accum", 1)):  # a token predicts the next
            if getattr(self, name) < low:
                raise ValueError(f"data.{name} must be at least {low}, not {getattr(self, name)}")
        if self.pad_to_multiple_of is not None and self.pad_to_multiple_of < 1:
            raise ValueError(f"data.pad_to_multiple_of must be at least 1, or null (padded to the longest row), "
                             f"not {self.pad_to_multiple_of}")
        held = [f"data.{k}" for k in ("eval_path", "eval_fraction", "eval_split") if getattr(self, k)]
        if len(held) > 1:
            raise ValueError(f"data: give one of data.eval_path, data.eval_fraction, data.eval_split, not {' and '.join(held)}")
        if self.eval_path and not Path(self.eval_path).exists() and not hub.is_hub_id(self.eval_path):
            raise ValueError(f"data.eval_path {self.eval_path!r} does not exist")
        if self.eval_fraction is not None and not 0 < self.eval_fraction < 1:
            raise ValueError(f"data.eval_fraction must be above 0 and below 1 (the share held out; null for none), "
                             f"not {self.eval_fraction}")
        if self.num_proc is not None and self.num_proc < 1:
            raise ValueError(f"data.num_proc must be at least 1, or null, not {self.num_proc}")
        check_seed(self.seed, "data.seed")
        # last, after the checks that cost nothing: a Hub id may download
        for name in ("tokenizer", "chat_template"):
            value = getattr(self, name)
            if value and hub.is_hub_id(value):
                setattr(self, name, hub.model_dir(f"data.{name}", value, hub.TOKENIZER_FILES))
        if self.chat_template and not Path(self.chat_template).exists():
            raise ValueError(f"data.chat_template {self.chat_template!r} does not exist (a .jinja file, or a tokenizer's "
                             f"directory or Hub id)")


TRACKERS = Literal["tensorboard", "wandb", "mlflow"]  # each the name of its package and of its module


@dataclass
class TrainConfig:
    model: ModelConfig
    engine: EngineConfig = field(default_factory=EngineConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    steps: int | None = None  # optimizer steps; None: from epochs, or 10
    epochs: float | None = None  # passes over the data instead of steps (data.source file)
    seed: int = 0  # the random initialisation of the weights (model.preset or model.config)
    output_dir: str | None = None  # where checkpoints and metrics go; None writes nothing
    # steps between saves of the training state (output_dir/state) and of the model as a
    # `transformers` checkpoint, output_dir/checkpoint-N; None: both only at the end (state, model)
    save_every: int | None = None
    # checkpoint-N folders kept at most (the HF Trainer's save_total_limit): the oldest removed first,
    # never the best model's (metric_for_best_model; it then keeps one more); None: every one
    save_total_limit: int | None = None
    resume: bool = False  # continue from output_dir/state (refused if there is none)
    # resume although settings that change the run's meaning (steps, schedule, data, batch, seed)
    # differ from the saved run's; each difference is named either way
    resume_changes: bool = False
    # start afresh where output_dir holds an earlier run's outputs, which are removed first; without
    # it (or resume) such a run is refused, so that a rerun never replaces an earlier one unasked
    overwrite: bool = False
    eval_every: int | None = None  # steps between evaluations of the held-out data; None: at the end only
    eval_batches: int | None = None  # micro-batches of held-out data per evaluation; None: all of it
    # the evaluation's metric that picks the best model, written to output_dir/best at each
    # evaluation that improves it: loss or perplexity (lower is better) or accuracy (the token
    # accuracy, higher is better); None: no best model
    metric_for_best_model: Literal["loss", "perplexity", "accuracy"] | None = None
    # end the run after this many evaluations in a row that did not improve metric_for_best_model by
    # more than early_stopping_threshold (the HF Trainer's EarlyStoppingCallback); it then saves its
    # state and model as at its last step; None: no early stop
    early_stopping_patience: int | None = None
    early_stopping_threshold: float = 0.0  # the least improvement of the best that resets early stopping's count
    log_every: int = 10  # steps between the console's summary lines
    # where the metrics also go, besides output_dir/metrics.jsonl: tensorboard (events in
    # output_dir/tensorboard), wandb, mlflow; each needs its package: pip install 'megatrain[tensorboard]'
    report_to: list[TRACKERS] = field(default_factory=list)
    save_dtype: Literal["float32", "bfloat16"] = "float32"  # weights of the saved model (output_dir/model)
    # stop the run (exit 3) at a step whose loss is over this many times the median of the last 20
    # steps' losses, and over that median by a nat or more (a blip near zero loss
    # is no divergence): a run diverging without a NaN; the state saved before it is kept, nothing
    # of it saved (a save whose weights gave that loss is rolled back); null: no guard
    divergence_factor: float | None = 10.0

    def __post_init__(self):
        check_types(self, "")
        if self.steps is not None and self.epochs is not None:
            raise ValueError("give steps or epochs, not both")
        if self.epochs is not None and (self.epochs <= 0 or self.data.source != "file"):
            raise ValueError("epochs must be positive and needs data.source: file")
        if self.steps is None and self.epochs is None:
            self.steps = 10
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"steps must be at least 1, not {self.steps}")
        for name in ("save_every", "save_total_limit", "eval_every", "eval_batches", "early_stopping_patience"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, or null")
        if self.log_every < 1:
            raise ValueError(f"log_every must be at least 1, not {self.log_every}")
        check_seed(self.seed, "seed")
        if self.divergence_factor is not None and not self.divergence_factor > 1:
            raise ValueError(f"divergence_factor must be above 1 (a multiple of the recent losses' median), or null "
                             f"for no guard, not {self.divergence_factor}")
        if not self.output_dir and (given := [k for k in ("save_every", "save_total_limit", "resume", "overwrite",
                                                          "metric_for_best_model", "report_to") if getattr(self, k)]
                                    + (["save_dtype"] if self.save_dtype != "float32" else [])):
            raise ValueError(f"{', '.join(given)} need{'s' if len(given) == 1 else ''} output_dir (where the run saves)")
        if self.resume and self.overwrite:
            raise ValueError("resume and overwrite exclude each other: resume continues the earlier run in "
                             "output_dir, overwrite replaces it")
        if self.save_total_limit and not self.save_every:
            raise ValueError("save_total_limit limits the checkpoint-N folders that save_every writes: set save_every")
        if len(set(self.report_to)) < len(self.report_to):
            raise ValueError(f"report_to names a tracker twice: {self.report_to}")
        for name in self.report_to:  # before anything is written
            if importlib.util.find_spec(name) is None:
                raise ValueError(f"report_to: {name} needs the {name} package: pip install 'megatrain[{name}]' "
                                 f"(or pip install {name})")
        held_out = self.data.eval_path or self.data.eval_fraction or self.data.eval_split
        for name in ("eval_every", "metric_for_best_model"):
            if getattr(self, name) and not held_out:
                raise ValueError(f"{name} needs held-out data: data.eval_path, data.eval_fraction or data.eval_split")
        if self.early_stopping_patience and not (self.metric_for_best_model and self.eval_every):
            raise ValueError("early_stopping_patience counts evaluations (eval_every) that do not improve "
                             "metric_for_best_model: set both")
        if self.early_stopping_threshold < 0:
            raise ValueError(f"early_stopping_threshold must be at least 0, not {self.early_stopping_threshold}")


def _build(cls, values: Any, where: str):
    """Build dataclass `cls` from a mapping, refusing unknown keys by name."""
    if not isinstance(values, dict):
        raise ValueError(f"{where or 'config'}: expected a mapping, got {type(values).__name__}")
    hints = get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ValueError(f"{where or 'config'}: unknown key(s) {unknown}; known: {sorted(names)}")
    kwargs = {}
    for key, value in values.items():
        sub = hints[key]
        if dataclasses.is_dataclass(sub):
            value = _build(sub, value, f"{where}.{key}" if where else key)
        kwargs[key] = value
    try:
        return cls(**kwargs)
    except TypeError as e:  # a required key is missing
        raise ValueError(f"{where or 'config'}: {e}") from None


def set_dotted(tree: dict, dotted: str, value: Any) -> None:
    """tree[a][b][c] = value for `a.b.c`, the sections made where missing."""
    keys = dotted.split(".")
    node = tree
    for key in keys[:-1]:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise ValueError(f"override {dotted!r}: {key!r} is not a section")
    node[keys[-1]] = value


class _UniqueKeys(yaml.SafeLoader):
    """yaml.SafeLoader refusing a key given twice in one mapping, where PyYAML keeps the last one
    silently (a second `data:` section would drop the first's settings)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:  # before a merge (`<<`), whose keys a mapping may override
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                if key_node.value in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"the key {key_node.value!r} is given twice in one mapping", key_node.start_mark)
                seen.add(key_node.value)
        return super().construct_mapping(node, deep)


def load_yaml(text: str) -> Any:
    """YAML as yaml.safe_load reads it, a key given twice in one mapping refused (yaml.YAMLError)."""
    return yaml.load(text, Loader=_UniqueKeys)


def parse_overrides(items: list[str]) -> list[tuple[str, Any]]:
    """`key.sub=value` strings to (key, value) pairs; values parse as YAML scalars."""
    pairs = []
    for item in items:
        key, eq, raw = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"override {item!r} is not of the form key.sub=value")
        try:
            pairs.append((key.strip(), load_yaml(raw)))
        except yaml.YAMLError as e:
            raise ValueError(f"override {item!r}: its value is not valid YAML: {e}") from None
    return pairs


def load_config(path: str | Path | None = None, overrides: list[str] = (), base: dict | None = None) -> TrainConfig:
    """Read a YAML run file, apply `key.sub=value` overrides, and validate everything."""
    tree: dict = dict(base or {})
    if path is not None:
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise ValueError(f"cannot read config {path}: {e.strerror}") from None
        try:
            loaded = load_yaml(text)
        except yaml.YAMLError as e:
            raise ValueError(f"config {path} is not valid YAML: {e}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ValueError(f"config {path}: the top level must be a mapping")
        tree.update(loaded or {})
    for key, value in parse_overrides(list(overrides)):
        set_dotted(tree, key, value)
    if "model" not in tree:
        raise ValueError("config: the model section is required (preset, config or pretrained)")
    return _build(TrainConfig, tree, "")


SECTIONS = (("", "TrainConfig"), ("model", "ModelConfig"), ("engine", "EngineConfig"), ("optim", "OptimConfig"),
            ("data", "DataConfig"))


def settings_fields() -> list[tuple[str, str, str, Any, str]]:
    """(section, key, type, default, meaning) of every key of a run file, read from these dataclasses
    (the default dataclasses.MISSING where the key is required):
    the meaning is the field's comment in this file, so neither `--help` nor docs/config.md can
    drift from the code."""
    import inspect
    out = []
    for section, name in SECTIONS:
        cls = globals()[name]
        comments, above = {}, []
        for line in inspect.getsource(cls).splitlines():
            text = line.strip()
            if text.startswith("#"):
                above.append(text.lstrip("# "))
                continue
            m = re.match(r"(\w+): [^=]+?(?:=.*?)?(?:\s+#\s*(.*))?$", text)
            if m and not text.startswith(("def ", "@", "class ")):
                comments[m.group(1)] = " ".join(above + ([m.group(2)] if m.group(2) else []))
            above = []
        hints = get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(hints[f.name]):
                continue
            default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
            out.append((section, f"{section}.{f.name}" if section else f.name, _type_name(hints[f.name]), default,
                        comments.get(f.name, "")))
    return out


def settings_help() -> str:
    """Every key of a run file with its type, default and meaning (settings_fields), as `--help` prints it."""
    lines, last = [], None
    for section, key, type_name, default, meaning in settings_fields():
        if section != last:
            lines.append(f"[{section or 'top level'}]")
            last = section
        lines.append(f"  {key}: {type_name}; " + ("required" if default is dataclasses.MISSING else f"default {default!r}"))
        if meaning:
            lines.append(f"      {meaning}")
    return "\n".join(lines)

"""The engine's kernel choices, one registered object each: the setting that picks it, the value
that runs this repository's kernel and the one that runs the library's ops, where the kernel can
run (and, where it cannot, why, naming the setting to change), its name in the tables.

    KERNELS                                  in the order resolve decides them (the MLP's after the experts')
    kernel.choose(asked, shape, machine, chosen)   `auto` decided; the kernel asked for refused where it cannot run
    kernel.runs(settings)                    whether a run uses the kernel

The resolver decides every `auto` through them; the trainer, the engine, the memory plan, the step
model (suite/projection.py) and the tables (workflows/scripts/aggregate.py) ask them what a run
uses, so no other place reads a kernel setting's strings. The settings themselves are typed fields
of EngineConfig and EngineSettings (tests/suite/test_registries.py holds their values to these).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from megatrain.config import EngineSettings
    from megatrain.resolve import Machine
    from megatrain.shapes import ModelShape


@dataclass(frozen=True)
class Kernel:
    """A kernel of this repository's in place of the library's ops, chosen by one engine setting."""
    setting: str  # the field of EngineConfig and EngineSettings that picks it
    own: str  # the value that runs this repository's kernel
    library: str  # the value that runs the library's ops (torch's, for the host AdamW)
    label: str  # its name in the tables' kernels column
    # why the kernel cannot run for this model on this machine, given the kernels decided before
    # it (a refusal's whole message); None where it can
    why_not: Callable[[ModelShape, Machine, dict[str, str]], str | None]
    # auto takes the kernel on the CPU too; else on a GPU only, the CPU keeping the library's ops,
    # against which the tests hold the engine exact
    on_cpu: bool = False

    def choose(self, asked: str, shape: ModelShape, machine: Machine, chosen: dict[str, str]) -> str:
        """The setting decided: `auto` takes the kernel where it can run (on a GPU, unless on_cpu),
        else the library's ops; the kernel asked for where it cannot run is refused."""
        why = self.why_not(shape, machine, chosen)
        if asked == "auto":
            return self.own if why is None and (machine.is_cuda or self.on_cpu) else self.library
        if asked == self.own and why is not None:
            raise ValueError(why)
        return asked

    def runs(self, settings: EngineSettings | Mapping[str, Any]) -> bool:
        """Whether `settings` (EngineSettings, or a result's record of them) use the kernel."""
        value = settings.get(self.setting) if isinstance(settings, Mapping) else getattr(settings, self.setting)
        return value == self.own


def _anywhere(shape: ModelShape, machine: Machine, chosen: dict[str, str]) -> None:
    """Every model's, on every machine."""
    return None


def _host_adamw(shape: ModelShape, machine: Machine, chosen: dict[str, str]) -> str | None:
    why = machine.host_adamw_why_not
    if not why:
        return None
    return (f"engine.optimizer_kernel: compiled, but the host AdamW's C++ kernel cannot be built here ({why}); "
            f"install a C++ compiler, or set optimizer_kernel: eager")


def _experts(shape: ModelShape, machine: Machine, chosen: dict[str, str]) -> str | None:
    if shape.experts:
        return None
    return (f"engine.experts_kernel: lean is for a mixture of experts; this {shape.family} model has "
            f"no experts (set engine.experts_kernel: auto)")


def _mlp_product(shape: ModelShape, machine: Machine, chosen: dict[str, str]) -> str | None:
    """The product compiles in the whole bias-free SiLU-gated MLP, or as a mixture of experts' gate
    within the lean experts, for the gates lean_experts has."""
    if not shape.experts:
        return None if shape.gated_mlp else (
            f"engine.mlp_kernel: compiled is for the bias-free SiLU-gated MLP; this {shape.family} model's is not, "
            f"or its output is read by more than the residual sum (Gemma's post-feedforward norm): set "
            f"engine.mlp_kernel: eager")
    from megatrain import lean_experts  # the library's MoE integration: seconds to import, so here
    gate = "engine.mlp_kernel: compiled compiles a mixture of experts' gate within the lean experts"
    if chosen[EXPERTS.setting] != EXPERTS.own:
        return f"{gate} (set engine.experts_kernel: lean)"
    if lean_experts.gate_kind(shape.family, shape.hidden_act) is None:
        return f"{gate}; this {shape.family} model's activation has no compiled gate (set engine.mlp_kernel: eager)"
    return None


def _rotary(shape: ModelShape, machine: Machine, chosen: dict[str, str]) -> str | None:
    from megatrain import rotary
    if rotary.form(shape.modeling):
        return None
    return (f"engine.rotary_kernel: compiled computes the Llama and GPT-OSS forms of the rotary embedding; this "
            f"{shape.family} model's differs (a partial or interleaved rotary): set engine.rotary_kernel: eager")


def _sinks(shape: ModelShape, machine: Machine, chosen: dict[str, str]) -> str | None:
    if shape.family == "gpt_oss" and shape.config._attn_implementation == "flex_attention":
        return None
    return (f"engine.sinks_kernel: compiled is for attention sinks after flex attention (GPT-OSS on a GPU); this "
            f"{shape.family} model's attention is {shape.config._attn_implementation}: set engine.sinks_kernel: eager")


# the host AdamW of float32 masters: one compiled pass (fused_adamw.py) or torch's fused AdamW and
# passes around it
OPTIMIZER = Kernel("optimizer_kernel", "compiled", "eager", "optimizer", _host_adamw, on_cpu=True)
NORM = Kernel("norm_kernel", "compiled", "eager", "norm", _anywhere)  # the decoder layers' RMSNorms (lean_norm.py)
EXPERTS = Kernel("experts_kernel", "lean", "library", "experts", _experts)  # a mixture's experts (lean_experts.py)
# the gated MLP's product (swiglu.py), or a mixture of experts' gate
MLP = Kernel("mlp_kernel", "compiled", "eager", "mlp", _mlp_product)
ROTARY = Kernel("rotary_kernel", "compiled", "eager", "rotary", _rotary)  # the queries' and keys' rotary (rotary.py)
SINKS = Kernel("sinks_kernel", "compiled", "eager", "sinks", _sinks)  # attention sinks' product (sinks.py)
LOSS = Kernel("loss_kernel", "compiled", "eager", "loss", _anywhere)  # the cross-entropy over each chunk (loss.py)
KERNELS = (NORM, EXPERTS, MLP, ROTARY, SINKS, LOSS, OPTIMIZER)

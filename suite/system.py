"""The interface every benchmarked system implements, and the registry of systems by name.

    system = load(name)(spec, device)    # build the model and the optimizer
    row = system.step(microbatches)      # one optimizer step, device synchronised: {"loss": ..., ...}
    system.info()                        # what the system wants recorded once (settings, versions)
    system.save(path)                    # the trained weights as a `transformers` checkpoint (float32)
    system.close()

Each system is registered once, as data, in `SYSTEMS`: its class, its colour in the figures, its
name in the paper's tables and what the harness must know before importing it (data-parallel runs,
a shared host store, a fixed step count).

A constructor that finds the system cannot run here raises `Unsupported(reason)`; one that finds
the point cannot fit raises `megatrain.memory.DoesNotFit` (which memory, needed and available
bytes) before allocating anything. The systems themselves live in `baselines/`, MegaTrain's
adapter among them.
"""
from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from megatrain.batch import Batch
    from suite.spec import RunSpec


class Unsupported(Exception):
    """This system cannot run on this machine or in this environment (the reason says why)."""


def check_options(system: str, options: dict, known) -> None:
    """Refuse, by name, the options of a point that its system does not know."""
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ValueError(f"{system} options: unknown {unknown}; known: {sorted(known)}")


def check_spec_options(system: str, options: dict) -> None:
    """`options` against what `system` takes (System.OPTIONS), from its class alone: nothing of the
    system's own dependencies is imported and nothing is built."""
    check_options(system, options, load(system).OPTIONS)


class System(ABC):
    """One system under comparison, built for one run spec on one device.

    `step` returns the step's metrics; the harness reads `loss` (a float, or None where the system
    prints none) and, where present, `step_time_s` (see `own_step_time`) and `hardware_flops`
    (the FLOPs the system really executed in the step, recomputation included; the harness turns
    them into `hardware_tflops` on its own clock). Any other entry is recorded as it is.
    """

    # FLOPs of one step of the model the system really runs, where that is not the spec's model
    # (Ratel trains its own GPT); None: the spec's model is counted
    model_flops_per_step: float | None = None
    # True: each step's `step_time_s` is the system's own time of the step, taken instead of the
    # wall clock around step() (a system run as one external script, whose steps are not calls)
    own_step_time: bool = False
    # options its host admission does not read: a refusal for host memory stands for a point whose
    # options changed only in these (workflows/scripts/grid.stale)
    host_blind_options: frozenset[str] = frozenset()
    # the spec.options it takes (their top-level keys); any other is refused before a worker starts
    # (check_spec_options) and again where the system is built
    OPTIONS: frozenset[str] = frozenset()

    @classmethod
    def device_need(cls, spec: RunSpec) -> tuple[int, str] | None:
        """A rank's device bytes for `spec`, counted from the spec alone as the system's device
        admission counts them, and what they are made of; None where its admission counts at run
        time (FSDP2's `auto` on the free memory) or by a plan of its own. A planner (the
        workflow's estimate) foresees a refusal with it."""
        return None

    @classmethod
    def summing(cls, spec: RunSpec, device_free: int | None) -> str | None:
        """Where a rank will sum the micro-batches' gradients of `spec` with `device_free` bytes of its
        GPU free (None: unknown), where that sets the step's time and `info()["accumulate"]` records
        it (FSDP2: on the device or on the host); None where it does not, or is not known before the
        run. A planner (the workflow's estimate) times a point from a result that summed alike."""
        return None

    @abstractmethod
    def __init__(self, spec: RunSpec, device: torch.device) -> None:
        """Build the model and the optimizer; refuse (Unsupported, DoesNotFit) before allocating."""

    @abstractmethod
    def step(self, microbatches: list[Batch]) -> dict:
        """One optimizer step over the micro-batches, the device synchronised before returning."""

    @abstractmethod
    def info(self) -> dict:
        """What the result records once: settings, versions, plans."""

    @abstractmethod
    def save(self, path: str) -> None:
        """The trained weights as a `transformers` checkpoint (float32); Unsupported where not done."""

    def close(self) -> None:
        """Release what the system holds (process groups, swap files, scratch folders)."""


@dataclass(frozen=True)
class Registration:
    """A compared system, registered once: the harness, the grids' check, the figures and the
    paper's tables read it."""
    cls: str  # "module:Class"; the module is imported only when its system is asked for (each has its own deps)
    color: str  # its colour in every figure
    paper: str | None = None  # its name in the paper's comparisons; None where the paper states no ratio of it
    # it runs a point on several GPUs of one host (RunSpec.gpus, under torchrun)
    data_parallel: bool = False
    # its ranks map one host store (MegaTrain's shared-memory file), so the harness counts shared
    # pages once over the process tree; a baseline's ranks each hold their own shard of the
    # offloaded state (pinned or not), so every process's resident memory counts in full
    shared_host_store: bool = False
    # its steps are a script's fixed count (Ratel's main.py runs the iterations it was started
    # for), so a point takes no steps beyond its spec's `steps` (suite/timing.py)
    fixed_steps: bool = False


SYSTEMS: dict[str, Registration] = {
    "megatrain": Registration("baselines.megatrain:MegaTrain", "C1", "MegaTrain", data_parallel=True,
                              shared_host_store=True),
    "native": Registration("baselines.native:Native", "C2", "PyTorch Native"),
    "fsdp2": Registration("baselines.fsdp2:FSDP2", "C0", "FSDP Offload", data_parallel=True),
    "zero3": Registration("baselines.deepspeed_zero:ZeRO3Offload", "C5", "ZeRO-3 Offload", data_parallel=True),
    "zero_infinity": Registration("baselines.deepspeed_zero:ZeROInfinity", "C4", "ZeRO-Infinity", data_parallel=True),
    "gemini": Registration("baselines.gemini:Gemini", "C8", "ColossalAI Gemini"),
    "ratel": Registration("baselines.ratel:Ratel", "C6", fixed_steps=True),
}


def load(name: str) -> type[System]:
    """The System class of a named system."""
    if name not in SYSTEMS:
        raise ValueError(f"system: unknown {name!r}; known: {list(SYSTEMS)}")
    module, _, cls = SYSTEMS[name].cls.partition(":")
    return getattr(importlib.import_module(module), cls)

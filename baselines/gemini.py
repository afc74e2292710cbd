"""ColossalAI Gemini on one GPU: `GeminiPlugin` (chunked ZeRO-3 with heterogeneous placement; by
default the static policy with all parameters and all optimizer state on pinned host memory), bf16,
ColossalAI's `HybridAdam` (its CPU-Adam kernel for host-resident state), activation checkpointing,
driven through `Booster` in a one-process "distributed" run (`colossalai.launch`, rank 0 of 1).

ColossalAI's releases pin old stacks (0.5.0: torch>=2.2.0,<=2.5.1, transformers==4.51.3) and
JIT-compile their kernels with nvcc at first use. Where it cannot be imported, where there is no
CUDA device, or where its kernels cannot be built, the constructor raises `Unsupported` with the
exception and the versions involved. baselines/gemini.md says what was tried and the routes.

Options:
  placement_policy    "static" (default) or "auto" (Gemini places chunks from a warm-up trace)
  offload_optim_frac  static policy: share of optimizer state on the host (default 1.0)
  offload_param_frac  static policy: share of parameters on the host (default 1.0)
  enable_async_reduce  Gemini's gradient reduce and move on a stream of its own (default false: on
                      the compute stream; ColossalAI's default, true, races on one rank and its loss
                      goes NaN: baselines/gemini.md)
Run the point's worker in an environment where colossalai imports with `python -m suite run --python`.
"""
from __future__ import annotations

import importlib.metadata
import re

import torch
import torch.distributed as dist

from baselines import hf
from suite.system import System, Unsupported, check_options

# the latest colossalai release baselines/gemini.md describes, named when colossalai is not installed at all
LATEST_CHECKED = "0.5.0, which requires torch>=2.2.0,<=2.5.1, transformers==4.51.3"
_PLACEMENTS = ("static", "auto")


def versions() -> str:
    """colossalai's version and its torch/transformers pins, beside what is installed here."""
    try:
        cai = importlib.metadata.distribution("colossalai")
    except importlib.metadata.PackageNotFoundError:
        ours = f"colossalai is not installed (latest release checked: {LATEST_CHECKED})"
    else:
        pins = [r.split(";")[0].replace(" ", "") for r in cai.requires or []
                if re.match(r"(torch|transformers)\s*[<>=!~]", r)]
        ours = f"colossalai {cai.version} requires {', '.join(pins) or 'no torch/transformers pin'}"
    try:
        transformers = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        transformers = "not installed"
    return f"{ours}; installed: torch {torch.__version__}, transformers {transformers}"


def _import():
    try:
        import colossalai
        from colossalai.booster import Booster
        from colossalai.booster.plugin import GeminiPlugin
        from colossalai.nn.optimizer import HybridAdam
    except Exception as e:  # a missing dependency, or a newer torch/transformers API that breaks its import
        raise Unsupported(f"colossalai cannot be imported: {type(e).__name__}: {e} [{versions()}]; "
                          f"see baselines/gemini.md") from None
    return colossalai, Booster, GeminiPlugin, HybridAdam


def _settings(options: dict) -> dict:
    check_options("gemini", options, Gemini.OPTIONS)
    policy = options.get("placement_policy", "static")
    if policy not in _PLACEMENTS:
        raise ValueError(f"gemini options.placement_policy: {policy!r}; known: {list(_PLACEMENTS)}")
    fracs = {k: options[k] for k in ("offload_optim_frac", "offload_param_frac") if k in options}
    if policy != "static" and fracs:
        raise ValueError(f"gemini options {sorted(fracs)}: only for placement_policy 'static'")
    for key, value in fracs.items():
        if not (isinstance(value, (int, float)) and 0.0 <= value <= 1.0):
            raise ValueError(f"gemini options.{key}: a fraction in [0, 1], got {value!r}")
    async_reduce = options.get("enable_async_reduce", False)
    if not isinstance(async_reduce, bool):
        raise ValueError(f"gemini options.enable_async_reduce: true or false, got {async_reduce!r}")
    if policy == "static":
        return {"placement_policy": "static", "offload_optim_frac": float(fracs.get("offload_optim_frac", 1.0)),
                "offload_param_frac": float(fracs.get("offload_param_frac", 1.0)), "enable_async_reduce": async_reduce}
    return {"placement_policy": policy, "enable_async_reduce": async_reduce}


class Gemini(System):
    OPTIONS = frozenset({"placement_policy", "offload_optim_frac", "offload_param_frac", "enable_async_reduce"})
    # host RSS measured on the H100 machine at the 3B shape, everything offloaded: 17.8-17.9 B/param
    # (bf16 parameter chunks 2 + fp32 master 4 + Adam moments 8, gradient chunks and pinned buffers)
    HOST_BYTES_PER_PARAM = 18

    def __init__(self, spec, device: torch.device):
        self.settings = _settings(spec.options)
        colossalai, Booster, GeminiPlugin, HybridAdam = _import()
        self.version = colossalai.__version__
        if device.type != "cuda":
            raise Unsupported(f"ColossalAI Gemini needs a CUDA device (its chunk placement, streams and "
                              f"HybridAdam kernels are CUDA-only); got {device} [{versions()}]")
        hf.require_host(spec, self.HOST_BYTES_PER_PARAM, "ColossalAI Gemini with host offload")
        self.device = device
        colossalai.launch(rank=0, world_size=1, host="127.0.0.1", port=hf.free_port(),
                          local_rank=device.index or 0, seed=spec.seed, verbose=False)
        # HybridAdam JIT-compiles its CPU-Adam and fused-Adam kernels (nvcc, ninja, CUDA_HOME; cached
        # in ~/.cache/colossalai): build them on a one-element parameter before the model is built
        try:
            HybridAdam([torch.nn.Parameter(torch.zeros(1))])
        except Exception as e:  # colossalai raises AssertionError, RuntimeError, or a bare Exception here
            raise Unsupported(f"colossalai HybridAdam's kernels cannot be built or loaded: "
                              f"{type(e).__name__}: {e} [{versions()}]") from None
        model = hf.build_model(spec, "cpu")
        hf.enable_checkpointing(model)
        model.train()
        opt = HybridAdam(hf.adamw_params(model, spec.weight_decay), **hf.adamw_kwargs(spec))
        plugin = GeminiPlugin(**self.settings, precision="bf16", pin_memory=True,
                              enable_gradient_accumulation=spec.grad_accum > 1)
        self.booster = Booster(plugin=plugin)
        self.model, self.opt, *_ = self.booster.boost(model, opt)

    def step(self, microbatches) -> dict:
        total = torch.zeros((), device=self.device)
        for batch in microbatches:
            loss = hf.loss_of(self.model, batch, self.device, autocast=False)  # Gemini computes in bf16 itself
            self.booster.backward(loss / len(microbatches), self.opt)
            total += loss.detach()
        self.opt.step()
        self.opt.zero_grad()
        hf.synchronize(self.device)
        return {"loss": total.item() / len(microbatches)}

    def save(self, path: str) -> None:
        raise Unsupported("saving Gemini's trained weights as a transformers checkpoint is not implemented "
                          "in this suite (its steps and losses are recorded)")

    def info(self) -> dict:
        return {"colossalai": self.version, **self.settings, "precision": "bf16", "master_dtype": "float32",
                "pin_memory": True, "optimizer": "colossalai HybridAdam (CPU Adam for host-resident state)",
                "activation_checkpointing": True}

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

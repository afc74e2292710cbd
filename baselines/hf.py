"""What the baselines share: the `transformers` model of a spec, its loss, its memory need."""
from __future__ import annotations

import contextlib
import socket

import torch

from megatrain.memory import DoesNotFit, Shortage
from megatrain.resolve import host_available_bytes
from megatrain.shapes import ModelShape


def build_model(spec, device: torch.device | str | None = None):
    """The spec's model in float32: random init from spec.seed, or a local pretrained checkpoint.
    With no `device` it is built where torch's defaults put it and never moved (a ZeRO-3 model,
    partitioned as it is built, must not be moved)."""
    from transformers import AutoModelForCausalLM
    mc = spec.model_config()
    if mc.pretrained:
        model = AutoModelForCausalLM.from_pretrained(mc.pretrained, dtype=torch.float32,
                                                     attn_implementation=spec.hf_config()._attn_implementation)
        return model.to(device) if device is not None else model
    torch.manual_seed(spec.seed)
    with torch.device(device) if device is not None else contextlib.nullcontext():
        return AutoModelForCausalLM.from_config(spec.hf_config(), dtype=torch.float32)


def enable_checkpointing(model) -> None:
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def params(spec) -> int:
    return ModelShape(spec.hf_config()).total_params()


def require_host(spec, bytes_per_param: float, what: str) -> None:
    """Refuse before allocating when the host cannot hold `bytes_per_param` per parameter
    (a measured figure of that system); `options.admission: false` tries anyway."""
    if not spec.options.get("admission", True):
        return
    need = params(spec) * bytes_per_param
    have = host_available_bytes()  # as stated (MEGATRAIN_HOST_MEMORY_GB) where the OS under-reports
    if need > have:
        raise DoesNotFit(what, [Shortage("host", int(need), have,
                                         f"{bytes_per_param} B/param x {params(spec) / 1e9:.2f} B params")])


def require_device(spec, device: torch.device, bytes_per_param: float, what: str) -> None:
    if device.type != "cuda" or not spec.options.get("admission", True):
        return
    need = params(spec) * bytes_per_param
    free, _ = torch.cuda.mem_get_info(device)
    if need > free:
        raise DoesNotFit(what, [Shortage("device", int(need), free,
                                         f"{bytes_per_param} B/param x {params(spec) / 1e9:.2f} B params, "
                                         f"before activations")])


def adamw_params(model, weight_decay: float) -> list:
    """The model's parameters for AdamW. With weight decay, two groups: decay on matrices only, as
    MegaTrain applies it (megatrain.shapes.ParamSpec.decay); without, the plain list."""
    params = list(model.parameters())
    if not weight_decay:
        return params
    # a ZeRO-3 parameter is a flat shard by now; DeepSpeed keeps its own shape as ds_shape
    matrix = [len(getattr(p, "ds_shape", p.shape)) >= 2 for p in params]
    return [{"params": [p for p, m in zip(params, matrix) if m], "weight_decay": weight_decay},
            {"params": [p for p, m in zip(params, matrix) if not m], "weight_decay": 0.0}]


def adamw_kwargs(spec) -> dict:
    """The spec's AdamW settings, for torch.optim.AdamW and the optimizers that take its arguments."""
    return dict(lr=spec.lr, betas=spec.betas, eps=spec.eps, weight_decay=spec.weight_decay)


def loss_of(model, batch, device: torch.device, autocast: bool):
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
        return model(input_ids=batch.input_ids.to(device, non_blocking=True),
                     labels=batch.labels.to(device, non_blocking=True)).loss


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_step(model, opt, microbatches, device: torch.device, autocast: bool) -> dict:
    """One optimizer step of a plain torch model over the micro-batches; the mean loss."""
    total = torch.zeros((), device=device)
    for batch in microbatches:
        loss = loss_of(model, batch, device, autocast)
        (loss / len(microbatches)).backward()
        total += loss.detach()
    opt.step()
    opt.zero_grad(set_to_none=True)
    synchronize(device)
    return {"loss": total.item() / len(microbatches)}


def free_port() -> int:
    """A free TCP port on this host, for a one-process 'distributed' group."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]

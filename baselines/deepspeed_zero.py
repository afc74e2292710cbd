"""DeepSpeed ZeRO stage 3, two systems: ZeRO-3 Offload (`zero3`: parameters and optimizer
state in pinned host memory, CPU Adam) and ZeRO-Infinity (`zero_infinity`: both swapped to NVMe
through DeepSpeed's async_io op, which needs libaio: baselines/libaio.sh provides it without root).

The model is built under `deepspeed.zero.Init` by the `transformers` integration: an
`HfDeepSpeedConfig` that is alive during `from_config` makes `transformers` partition each module as
it is built and then initialise the weights gathered (a bare `zero.Init` leaves them uninitialised:
loss 1314 instead of 9.35). DeepSpeed's CPU Adam (its "AdamW" with an offloaded optimizer), bf16,
no gradient clipping, the model's own activation checkpointing.

On one GPU, a one-process group; on spec.gpus = N (under torchrun, baselines/hf.py) ZeRO-3 runs with
its data-parallel world of N ranks: parameters, gradients and optimizer state partitioned over them,
each rank computing on its rows of every global micro-batch (spec.batch_size / N per GPU), the
gradients averaged over the ranks.

spec.options (anything else is refused):
  ds_config  a dict deep-merged over the built config, e.g.
             {"zero_optimization": {"offload_param": {"buffer_count": 8}}}
  nvme_path  (zero_infinity only) the swap directory; default a fresh one under /tmp, removed at close
"""
from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import shutil
import tempfile
import time
import weakref
from abc import abstractmethod
from typing import Any

import torch
import torch.distributed as dist

from baselines import hf
from megatrain.distributed import Ranks, shard_batch
from megatrain.shapes import ModelShape
from suite.system import System, Unsupported, check_options

OFFLOADS = ("cpu", "nvme")


def import_deepspeed():
    try:
        import deepspeed
    except ImportError:
        raise Unsupported("deepspeed is not installed (pip install -e '.[baselines]')") from None
    return deepspeed


# DeepSpeed builds its ops (CPU Adam; async_io for ZeRO-Infinity) on first use through torch's JIT
# loader, which serialises builds on a lock file and waits on it forever: a build killed half way (a
# point's timeout, Ctrl-C, the OOM killer) leaves it, and every later point hangs silently
# (pytorch/pytorch#189245). A build takes a minute or two; a lock far older than that is stale.
JIT_OPS = ("cpu_adam", "async_io")
STALE_LOCK_S = 300


def stale_build_locks(ops=JIT_OPS) -> list[str]:
    """The lock files of DeepSpeed ops' JIT builds older than STALE_LOCK_S, with their age."""
    from torch.utils.cpp_extension import _get_build_directory
    stale = []
    for op in ops:
        lock = os.path.join(_get_build_directory(op, verbose=False), "lock")
        try:
            age = time.time() - os.path.getmtime(lock)
        except OSError:  # no lock: no build under way
            continue
        if age > STALE_LOCK_S:
            stale.append(f"{lock} ({age / 60:.0f} min old)")
    return stale


def largest_tensor_numel(spec) -> int:
    """Elements of the model's largest parameter: the embedding, unless a layer matrix is larger."""
    shape = ModelShape(spec.hf_config())
    return max([shape.vocab * shape.hidden] + [s.numel for s in shape.layer_specs])


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`base` with `over` laid on top: dicts merge key by key, anything else replaces."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def ds_config(spec, offload: str, nvme_path: str | None = None) -> dict[str, Any]:
    """The DeepSpeed config of a point: ZeRO-3, parameters and optimizer offloaded to `offload`."""
    if offload not in OFFLOADS:
        raise ValueError(f"offload must be one of {OFFLOADS}, not {offload!r}")
    check_options(spec.system, spec.options, (ZeROInfinity if offload == "nvme" else ZeRO3Offload).OPTIONS)
    if not isinstance(spec.options.get("ds_config", {}), dict):
        raise ValueError("options.ds_config must be a dict of DeepSpeed config entries")
    offload_param = {"device": offload, "pin_memory": True}
    offload_optimizer = {"device": offload, "pin_memory": True}
    config: dict[str, Any] = {
        # spec.batch_size is the global micro-batch, split over spec.gpus ranks (RunSpec refuses a
        # remainder); DeepSpeed checks train_batch_size = per GPU x accumulation x world size
        "train_micro_batch_size_per_gpu": spec.batch_size // spec.gpus,
        "gradient_accumulation_steps": spec.grad_accum,
        "train_batch_size": spec.batch_size * spec.grad_accum,
        "gradient_clipping": 0.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {**hf.adamw_kwargs(spec), "betas": list(spec.betas)}},
        "zero_optimization": {"stage": 3, "offload_param": offload_param, "offload_optimizer": offload_optimizer},
        "steps_per_print": 2**31 - 1,  # DeepSpeed's own step log would interleave with the harness's
        "wall_clock_breakdown": False,
    }
    if offload == "nvme":
        if not nvme_path:
            raise ValueError("NVMe offload needs an nvme_path")
        # Every swapped parameter takes a whole buffer, so a buffer must hold the largest one, and
        # a layer's tensors plus the next layer's prefetch must find one each: DeepSpeed's default
        # of 5 failed on the 3B shape ("Not enough buffers 0 for swapping 1", 12 tensors a layer).
        per_layer = len(ModelShape(spec.hf_config()).layer_specs)
        offload_param.update(nvme_path=nvme_path, buffer_count=2 * per_layer + 4,
                             buffer_size=max(10**8, largest_tensor_numel(spec)), max_in_cpu=10**9)
        offload_optimizer.update(nvme_path=nvme_path, buffer_count=4, fast_init=False)
        # The values of DeepSpeed's ZeRO-Infinity tutorial (thread_count is now intra_op_parallelism).
        config["aio"] = {"block_size": 262144, "queue_depth": 32, "intra_op_parallelism": 1,
                         "single_submit": False, "overlap_events": True}
    return merge(config, spec.options.get("ds_config", {}))


def aio_problem() -> str | None:
    """Why DeepSpeed cannot build its async_io op here, in DeepSpeed's words; None when it can."""
    from deepspeed.accelerator import get_accelerator
    builder = get_accelerator().create_op_builder("AsyncIOBuilder")
    report = io.StringIO()
    with contextlib.redirect_stdout(report):  # DeepSpeed prints its reasons as coloured warnings
        if builder.is_compatible(verbose=True):
            return None
    text = re.sub(r"\x1b\[[0-9;]*m|\[WARNING\]", "", report.getvalue())
    return " ".join(line.strip() for line in text.splitlines() if line.strip()) or "is_compatible() is False"


def _plain_arch_list() -> None:
    """DeepSpeed 0.19.8 parses TORCH_CUDA_ARCH_LIST entries as numbers and fails on an
    arch-specific one such as "9.0a" (as set in the GPU machine's image) when it JIT-builds a CUDA
    op (async_io): keep the same architectures without the suffix."""
    value = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if value:
        os.environ["TORCH_CUDA_ARCH_LIST"] = re.sub(r"(\d+\.\d+)[a-z]+", r"\1", value)


def _init_distributed(deepspeed, device: torch.device) -> tuple[Ranks, dict[str, str | None]]:
    """torchrun's ranks (DeepSpeed reads RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT and LOCAL_RANK
    from its environment), or a one-process group given the same variables for the run, and their
    values before it, which `close` puts back (a later run in this process, or a process started from
    it, would inherit a port that another process may hold by then)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    torch.cuda.set_device(index)
    ranks = Ranks.from_env()
    before = {}
    if not ranks.distributed:  # DeepSpeed picks its device from LOCAL_RANK
        single = dict(RANK="0", LOCAL_RANK=str(index), WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(hf.free_port()))
        before = {k: os.environ.get(k) for k in single}
        os.environ.update(single)
    deepspeed.init_distributed(verbose=False)
    return ranks, before


class ZeroSystem(System):
    """The shared system; a subclass names itself and says where the states go and what it needs."""
    NAME: str

    def __init__(self, spec, device: torch.device):
        deepspeed = import_deepspeed()
        self.config = self.build_config(spec)
        if device.type != "cuda":
            raise Unsupported(f"{self.NAME} runs on a CUDA device, not on {device}")
        _plain_arch_list()
        if stale := stale_build_locks():
            raise Unsupported(f"{self.NAME}: torch's lock on building DeepSpeed's ops is left from an interrupted "
                              f"build, and torch would wait on it forever: delete {' and '.join(stale)}")
        self.ranks, self._environ_before = _init_distributed(deepspeed, device)
        self.admit(spec)  # after joining: the ranks decide on one reading of the host (hf.agreed)
        from transformers.integrations import HfDeepSpeedConfig
        deepspeed.utils.logger.setLevel(logging.WARNING)
        self.device = device
        self.grad_accum = spec.grad_accum
        self.version = deepspeed.__version__
        # transformers holds only a weak reference to this: it must outlive the model's construction
        self._hf_ds_config = HfDeepSpeedConfig(self.config)
        model = hf.build_model(spec)  # not moved: zero.Init partitions it as it is built
        hf.enable_checkpointing(model)
        model.train()
        self.engine, *_ = deepspeed.initialize(model=model, config=self.config,
                                               model_parameters=hf.adamw_params(model, spec.weight_decay))

    @abstractmethod
    def build_config(self, spec) -> dict[str, Any]:
        """The point's DeepSpeed config (ds_config with this system's offload)."""

    @abstractmethod
    def admit(self, spec) -> None:
        """Raise Unsupported or DoesNotFit before anything is allocated, alike on every rank."""

    def step(self, microbatches) -> dict:
        # DeepSpeed counts micro-batches itself and steps the optimizer on the last of each group
        assert len(microbatches) == self.grad_accum, (len(microbatches), self.grad_accum)
        losses = []
        for batch in microbatches:
            rows = shard_batch(batch, self.ranks)  # this rank's rows; the engine averages gradients over the ranks
            loss = hf.loss_of(self.engine, rows, self.device, autocast=False)  # the engine runs in bf16
            self.engine.backward(loss)  # scales by 1/grad_accum
            self.engine.step()
            losses.append(loss.detach())
        hf.synchronize(self.device)
        return {"loss": hf.mean_over_ranks(torch.stack(losses).float().mean(), self.ranks)}

    def save(self, path: str) -> None:
        """The partitioned float32 masters, gathered from the optimizer (what DeepSpeed's own
        zero_to_fp32 recovers from a checkpoint), saved under the model's names: gathered by every
        rank (a collective), written by the first."""
        from deepspeed.utils import safe_get_full_fp32_param
        module = self.engine.module
        masters = {name: safe_get_full_fp32_param(p).detach().cpu() for name, p in module.named_parameters()}
        if self.ranks.rank == 0:
            module.save_pretrained(path, state_dict=masters)
        if self.ranks.distributed:
            dist.barrier()

    def info(self) -> dict:
        return {"master_dtype": "float32", "compute_dtype": "bfloat16", "optimizer": "DeepSpeedCPUAdam (AdamW)",
                "activation_checkpointing": True, "deepspeed_version": self.version, "ds_config": self.config}

    def close(self) -> None:
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config
        self.engine.destroy()
        # while transformers sees this config, every model built in this process is built under
        # zero.Init (a next FSDP2 run here would be, and fail on the LOCAL_RANK put back below)
        self._hf_ds_config = None
        unset_hf_deepspeed_config()
        if dist.is_initialized():
            from deepspeed import comm
            # torch's group and DeepSpeed's references to it (a later run's optimizer would take the closed one)
            comm.destroy_process_group()
        for k, v in self._environ_before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class ZeRO3Offload(ZeroSystem):
    NAME = "ZeRO-3 Offload"
    OPTIONS = frozenset({"ds_config"})
    # host RSS (fp32 master, moments and gradients, bf16 parameters, pinned buffers) measured on the
    # H100 machine: 25.9 B/param at the 3B shape, 27.7 and 29.2 at the 7B width on 7 and 14 layers
    # (results/h100/points/depth); admission takes the largest
    HOST_BYTES_PER_PARAM = 29
    # each rank beyond the first: zero.Init partitions the model as it is built, so no rank holds
    # the whole of it; only the rank's runtime (hf.RANK_HOST_BYTES). Not yet measured on several GPUs
    RANK_BYTES_PER_PARAM = 0

    def build_config(self, spec) -> dict:
        return ds_config(spec, "cpu")

    def admit(self, spec) -> None:
        hf.require_host(spec, self.HOST_BYTES_PER_PARAM, self.NAME, self.RANK_BYTES_PER_PARAM, self.ranks)

    def info(self) -> dict:
        return {**super().info(), "offload": "cpu"}


class ZeROInfinity(ZeroSystem):
    NAME = "ZeRO-Infinity"
    OPTIONS = frozenset({"ds_config", "nvme_path"})
    # an upper bound, not a measurement: bf16 parameters 2, fp32 master and moments 12, fp32 gradients 4
    SWAP_BYTES_PER_PARAM = 18

    def build_config(self, spec) -> dict:
        self.owns_swap = "nvme_path" not in spec.options
        self.swap = spec.options.get("nvme_path") or os.path.join(tempfile.gettempdir(),
                                                                   f"megatrain-zero-infinity-{os.getpid()}")
        return ds_config(spec, "nvme", self.swap)

    def admit(self, spec) -> None:
        problem = aio_problem()
        if problem:
            raise Unsupported(f"{self.NAME}: DeepSpeed cannot build its async_io op: {problem} -- install libaio-dev, "
                              f"or without root: baselines/libaio.sh fetch .libaio (where apt works), then "
                              f"eval \"$(baselines/libaio.sh env .libaio)\" before python starts")
        # partitioned over the ranks: the total stays
        hf.require_disk(self.NAME, hf.params(spec), self.SWAP_BYTES_PER_PARAM, self.swap, self.ranks)
        os.makedirs(self.swap, exist_ok=True)
        # removed at close, or at exit when the construction fails after this point
        self._remove_swap = weakref.finalize(self, shutil.rmtree, self.swap, True) if self.owns_swap else None

    def info(self) -> dict:
        return {**super().info(), "offload": "nvme", "nvme_path": self.swap}

    def close(self) -> None:
        super().close()
        if self._remove_swap:
            self._remove_swap()

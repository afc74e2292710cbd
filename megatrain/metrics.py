"""Throughput and memory measurements shared by the engine and every baseline.

The one FLOPs formula (this project's choice, the common 6N + 12*L*h*s form; the paper states none;
docs/harness.md), per token of a sequence of s tokens: 6*N + 12 * sum over layers of (a_l * k_l), with
  N    the matmul weights a token multiplies by: the decoder layers' (attention, MLP; for a mixture
       of experts the router and the top-k experts' matrices, not all of them) plus the LM head; the
       embedding lookup, norms, biases and attention sinks excluded;
  a_l  layer l's attention width (heads x head_dim: the hidden size in the paper's models; DeepSeek's
       latent attention heads x (qk_head_dim + v_head_dim) / 2, its q k^T and v widths apart);
  k_l  the keys a query of layer l is counted against: s, or min(s, window) for a sliding-window
       layer (12*L*h*s when every layer is full and heads x head_dim = h).
Causal masking is not halved: causal attention counts as the whole square, twice what its kernels
compute (at long sequences results/summary.md sets beside it the executed rate, causal attention
halved: suite/projection.py). Padding tokens are never counted.
"""
from __future__ import annotations

import os
import platform
import subprocess
import time
import threading
from collections.abc import Sequence

import psutil
import torch

# (attention width, window or None for full attention) of each decoder layer
Attention = Sequence[tuple[int, int | None]]


def _attention_keys(attention: Attention, n: int) -> int:
    return sum(width * (n if window is None else min(n, window)) for width, window in attention)


def model_flops(matmul_params: int, attention: Attention, seq_lengths: list[int]) -> float:
    """Model FLOPs of one step over sequences of the given non-padding lengths (ModelShape gives the
    arguments: `matmul_params()` and `attention()`)."""
    return float(sum(n * (6 * matmul_params + 12 * _attention_keys(attention, n)) for n in seq_lengths))


def recompute_flops(decoder_matmul_params: int, attention: Attention, seq_lengths: list[int]) -> float:
    """The extra forward of the given decoder layers that recomputation costs (one third of the formula)."""
    return float(sum(n * (2 * decoder_matmul_params + 4 * _attention_keys(attention, n)) for n in seq_lengths))


def attention_flops(attention: Attention, seq_lengths: list[int]) -> float:
    """The forward of the given layers' attention core (q k^T and its product with v: 4 a_l k_l a token)."""
    return float(sum(n * 4 * _attention_keys(attention, n) for n in seq_lengths))


def tree_rss_bytes(pid: int | None = None, shared_once: bool = False) -> int:
    """Resident memory of a process and all its descendants. `shared_once`: shared pages (file
    and shared-memory mappings) counted once, as the largest process's, not once per process: the
    data-parallel ranks' one host store (a single process's number is the same either way)."""
    return tree_rss(pid, shared_once)[0]


def tree_rss(pid: int | None = None, shared_once: bool = False) -> tuple[int, int, int]:
    """(tree_rss_bytes, the processes of the tree, the largest one's resident bytes)."""
    try:
        root = psutil.Process(pid or os.getpid())
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0, 0, 0
    total = shared = largest = counted = 0
    for p in procs:
        try:
            info = p.memory_info()
        except psutil.NoSuchProcess:
            continue
        counted += 1
        largest = max(largest, info.rss)
        if shared_once:
            total += info.rss - info.shared
            shared = max(shared, info.shared)
        else:
            total += info.rss
    return total + shared, counted, largest


class PeakSampler:
    """Samples host RSS of a process tree (and NVML device memory, where there is a GPU) in a
    background thread: the maxima since start or the last reset, and at the host's peak how many
    processes the tree had and the largest one's share (what else held memory then: inductor's
    compile workers, a library's helpers)."""

    def __init__(self, pid: int | None = None, interval_s: float = 0.2, gpu_index: int | None = None,
                 shared_once: bool = False):
        self.pid = pid
        self.shared_once = shared_once  # tree_rss_bytes's
        self.interval_s = interval_s
        self._nvml = None
        if gpu_index is not None:
            try:
                import pynvml
                pynvml.nvmlInit()
                self._nvml = (pynvml, pynvml.nvmlDeviceGetHandleByIndex(gpu_index))
            except Exception:  # no NVML here: device memory comes from the allocator alone
                self._nvml = None
        self.reset()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="megatrain-sampler", daemon=True)
        self._thread.start()

    def reset(self) -> None:
        self.peak_host_bytes = self.peak_host_processes = self.peak_host_largest_bytes = 0
        self.peak_nvml_bytes = 0
        self.sample()

    def sample(self) -> None:
        host, processes, largest = tree_rss(self.pid, self.shared_once)
        if host > self.peak_host_bytes:
            self.peak_host_bytes, self.peak_host_processes, self.peak_host_largest_bytes = host, processes, largest
        if self._nvml is not None:
            nvml, handle = self._nvml
            self.peak_nvml_bytes = max(self.peak_nvml_bytes, nvml.nvmlDeviceGetMemoryInfo(handle).used)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def device_peak_allocated(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def environment(device: torch.device | None = None) -> dict:
    """Where a result was measured: GPU, link, CPU, host memory, library versions, git commit."""
    import transformers
    changed = git("status", "--porcelain", "--untracked-files=no")  # tracked files that differ from the commit
    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.version.cuda,
        "cpu": _cpu_model(),
        "cpu_cores": os.cpu_count(),
        "host_memory_bytes": psutil.virtual_memory().total,  # some VMs grow this as memory is used
        "host_memory_stated_gb": float(os.environ["MEGATRAIN_HOST_MEMORY_GB"]) if os.environ.get("MEGATRAIN_HOST_MEMORY_GB") else None,
        # a copy of the tree without .git (a remote machine) passes the commit in the environment
        "git_commit": os.environ.get("MEGATRAIN_GIT_COMMIT") or git("rev-parse", "HEAD"),
        "git_dirty": bool(changed),
        "git_dirty_paths": [line.split(maxsplit=1)[-1] for line in changed.splitlines()][:20] if changed else [],  # which ones
    }
    if device is not None and device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, gpu_memory_bytes=props.total_memory, gpu_count=torch.cuda.device_count())
        try:
            import pynvml
            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
            env.update(driver=pynvml.nvmlSystemGetDriverVersion(),
                       pcie_generation=pynvml.nvmlDeviceGetCurrPcieLinkGeneration(handle),
                       pcie_max_generation=pynvml.nvmlDeviceGetMaxPcieLinkGeneration(handle),
                       pcie_width=pynvml.nvmlDeviceGetCurrPcieLinkWidth(handle))
        except Exception as e:  # NVML absent or refused: say so rather than guess
            env["nvml_error"] = str(e)
    return env


def matmul_tflops(device: torch.device) -> float:
    """The machine's dense matmul rate as this process sees it: the compute dtype's square GEMM
    (bf16 8192 on a GPU, float32 1024 on the CPU), the best of a few timed runs after one untimed.
    A result's speed over this rate is comparable across machines of other GPUs or CPUs."""
    cuda = device.type == "cuda"
    n, dtype, runs = (8192, torch.bfloat16, 10) if cuda else (1024, torch.float32, 5)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    best = float("inf")
    for i in range(runs + 1):
        if cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        a @ b
        if cuda:
            torch.cuda.synchronize(device)
        if i:
            best = min(best, time.perf_counter() - start)
    return 2 * n ** 3 / best / 1e12


def link_gbps(device: torch.device, nbytes: int = 256 << 20, runs: int = 5) -> dict[str, float | str] | None:
    """The host-device link's rate each way as this process sees it, GB/s: `nbytes` between a
    page-locked host buffer and the device, the best of a few timed copies after one untimed. The
    buffer is registered with CUDA at its size and released after (torch's pinned allocator would
    keep it, rounded up, for the rest of the run). None on the CPU, which has no link; `link_error`
    where the buffer could not be page-locked (the point is still measured, without this yardstick)."""
    if device.type != "cuda":
        return None
    from megatrain.store import page_aligned  # the store's blocks are registered as this one is

    host = page_aligned(nbytes)
    cudart = torch.cuda.cudart()
    if (err := int(cudart.cudaHostRegister(host.data_ptr(), nbytes, 0))) != 0:
        return {"link_error": f"cudaHostRegister of {nbytes} bytes failed: {err}"}
    try:
        return _copy_rates(host, device, runs)
    finally:
        torch.cuda.synchronize(device)
        cudart.cudaHostUnregister(host.data_ptr())
        torch.cuda.empty_cache()  # the device buffer not left cached beside the point's own memory


def _copy_rates(host: torch.Tensor, device: torch.device, runs: int) -> dict[str, float]:
    """GB/s of the best of `runs` timed copies each way (after one untimed) between `host` and a
    device buffer of its size, which is dropped on return."""
    dev = torch.empty(host.numel(), dtype=torch.uint8, device=device)
    rates = {}
    for name, dst, src in (("h2d_gbps", dev, host), ("d2h_gbps", host, dev)):
        best = float("inf")
        for i in range(runs + 1):
            torch.cuda.synchronize(device)
            start = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize(device)
            if i:
                best = min(best, time.perf_counter() - start)
        rates[name] = host.numel() / best / 1e9
    return rates


def _cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def git(*args: str, cwd: str | None = None) -> str | None:
    """git's output in `cwd` (default: this repository), None where git fails. Writes nothing into
    the repository: `git status` would refresh the index file as a side effect, under a copy of the
    tree another process may be making (experiments/workflow_gpu.sh --detach tars it)."""
    try:
        out = subprocess.run(["git", *args], capture_output=True, text=True, timeout=10,
                             cwd=cwd or os.path.dirname(os.path.abspath(__file__)),
                             env={**os.environ, "GIT_OPTIONAL_LOCKS": "0"})
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None

"""Run one point in its own process, watched from outside: timeout, memory peaks, final status.

The worker (suite.worker, started by suite.launch) runs in a new session so that the whole process
tree it starts (DeepSpeed and FSDP spawn helpers; compilers run in children) can be killed as one.
While it runs, a background sampler here reads the tree's resident memory (psutil) and the GPU's
used memory (NVML). The parent waits on the worker with a timeout. Whatever happens, one JSON
result is written atomically to `out`, with the worker's steps so far: an interrupted runner
(SIGTERM, Ctrl-C) kills the worker's tree and records the point as `interrupted`; a runner killed
outright takes the worker with it (the kernel signals a worker whose parent dies), though no result
can then be written.
A point past its timeout is first asked for its Python stacks (SIGUSR1, which suite.worker hands to
faulthandler) and then killed: the result says where it was (`stacks`, with each thread's wait in the
kernel), a hang as well as a slow step. The host's disk traffic over the point is recorded (`disk_io`):
a system that swaps to the disk shows there how much it moved; and so is this runner's own start
before the worker's (`launch_s`: its interpreter, imports and the spec's checks). The worker's
temporary files live in the run's own folder, removed however the worker ends (worker_env).
An interrupt while a worker is being killed (its exit can take tens of seconds where it pinned much
host memory) waits until the result is written, and is raised then.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from megatrain.io import write_json
from megatrain.lifetime import die_with_parent
from megatrain.metrics import PeakSampler, environment
from megatrain.units import GiB
from suite import launch
from suite.spec import RunSpec
from suite.system import SYSTEMS
from suite.worker import since_start, summarize

STATUSES = ("ok", "oom_device", "oom_host", "timeout", "unsupported", "error", "interrupted")
_DEVICE_OOM = ("CUDA out of memory", "OutOfMemoryError", "CUBLAS_STATUS_ALLOC_FAILED")


def _timeout_reason(spec: RunSpec, steps: list[dict], wall: float) -> str:
    """How far a point got before its time limit: steps done and where the time went."""
    done = len(steps)
    spent = sum(step.get("step_time_s", 0) for step in steps)
    return (f"no result within the timeout of {spec.timeout_s:.0f} s: {done} of at least {spec.warmup + spec.steps} steps "
            f"done ({spent:.0f} s in steps, {wall - spent:.0f} s before and between them)")


def classify(returncode: int | None, timed_out: bool, worker_status: str | None, log_tail: str,
             peak_host: int, host_total: int, interrupted: bool = False) -> tuple[str, str | None]:
    """The final status of a point, and the reason when the worker could not give one itself."""
    if interrupted:
        return "interrupted", "the runner was interrupted (SIGTERM or Ctrl-C) and killed the worker's tree"
    if timed_out:
        return "timeout", None
    if worker_status in STATUSES:
        return worker_status, None
    if any(s in log_tail for s in _DEVICE_OOM):
        return "oom_device", "the worker died on a device out-of-memory error (see log_tail)"
    if returncode is not None and returncode < 0 and -returncode == signal.SIGKILL:
        if peak_host >= 0.9 * host_total:
            return "oom_host", (f"killed by SIGKILL with the process tree at {peak_host / GiB:.1f} GiB of "
                                f"{host_total / GiB:.1f} GiB host memory (the kernel's OOM killer)")
        return "error", "killed by SIGKILL"
    return "error", f"the worker exited with code {returncode} without a result (see log_tail)"


def worker_env(spec: RunSpec, scratch: str | Path | None = None) -> dict:
    """The worker's environment. Several ranks each get their share of the host's cores for their
    CPU work (a baseline's CPU Adam, OpenMP): unless told, torchrun gives each worker one thread,
    and a baseline's optimizer then runs serially (docs/decisions.md, "Each rank's share of the cores"). The
    engine's ranks take the same share themselves (trainer.py).
    `scratch`: the worker tree's temporary directory (TMPDIR), which the runner removes however the
    worker ends: a baseline's swap files (ZeRO-Infinity's, Ratel's: tens of GiB) made under the temp
    dir would otherwise outlive a worker killed at its timeout and fill the next point's disk.
    Compiled kernels stay cached where torch keeps them without it, across points."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if scratch is not None:
        if "TORCHINDUCTOR_CACHE_DIR" not in env:  # (asked only then: importing inductor takes a second)
            from torch._inductor.runtime import cache_dir_utils
            env["TORCHINDUCTOR_CACHE_DIR"] = cache_dir_utils.default_cache_dir()
        env["TMPDIR"] = str(scratch)
    env.setdefault("MEGATRAIN_GIT_COMMIT", environment()["git_commit"] or "")
    if spec.gpus > 1:
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // spec.gpus)))
    return env


def run_point(spec: RunSpec, out: str | Path, log: str | Path | None = None,
              python: str = sys.executable, gpu_index: int | None = 0, fork: bool = False) -> dict:
    """Run `spec` in a process of its own; write and return its result. `log` keeps the worker's
    output. `fork`: a caller that ran no tensor work has its imports reused, the worker forked
    from it where it can be (suite.launch); else, and for another `python`, a fresh interpreter."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    log = Path(log) if log else out.with_suffix(".log")
    with tempfile.TemporaryDirectory(prefix="suite-") as tmp:
        spec_file, partial, scratch = Path(tmp) / "spec.json", Path(tmp) / "result.json", Path(tmp) / "tmp"
        spec_file.write_text(json.dumps(spec.to_dict()))
        scratch.mkdir()
        start, disk_before, launched = time.perf_counter(), _disk_io(), since_start()
        with open(log, "w") as log_file:
            # several GPUs: torchrun starts one worker per GPU (in the same session, killed with it)
            torchrun = [python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={spec.gpus}"]
            command = [*(torchrun if spec.gpus > 1 else [python]), "-m", "suite.worker", str(spec_file), str(partial)]
            # a SIGTERM or Ctrl-C while the worker starts (git is asked for the commit first) waits
            # for the `try` below, which records it
            signal.pthread_sigmask(signal.SIG_BLOCK, _INTERRUPTS)
            try:
                proc = launch.start(command, log_file, worker_env(spec, scratch), Path(__file__).resolve().parent.parent,
                                    _dies_with(os.getpid()), fork=fork and spec.gpus == 1 and python == sys.executable)
            except BaseException:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, _INTERRUPTS)
                raise
            timed_out, interrupted, sampler, nvml_before, stacks = False, None, None, None, None
            try:  # from the worker's first instant: a SIGTERM while the sampler starts must kill it too
                signal.pthread_sigmask(signal.SIG_UNBLOCK, _INTERRUPTS)
                # the ranks' shared host store counted once, not once per rank
                sampler = PeakSampler(pid=proc.pid, gpu_index=gpu_index if _has_gpu() else None,
                                      shared_once=_shares_host_store(spec))
                nvml_before = sampler.peak_nvml_bytes
                proc.wait(timeout=spec.timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                stacks, interrupted = _reap(proc, log)
            except BaseException as e:  # interrupted (Ctrl-C, SIGTERM): the worker's tree goes too
                interrupted = e
                _reap(proc)
            finally:
                if sampler is not None:
                    sampler.close()
        wall, disk_after = time.perf_counter() - start, _disk_io()
        result = json.loads(partial.read_text()) if partial.exists() else {
            "system": spec.system, "spec": spec.to_dict(), "env": environment(), "steps": []}
    tail = _tail(log)
    peak_host = sampler.peak_host_bytes if sampler is not None else 0
    status, reason = classify(proc.returncode, timed_out, result.get("status"), tail,
                              peak_host, psutil.virtual_memory().total, interrupted is not None and not timed_out)
    if status != result.get("status"):
        result["status"] = status
        result["reason"] = reason or _timeout_reason(spec, result["steps"], wall)
    if status != "ok":
        result["log_tail"] = tail
    if stacks:
        result["stacks"] = stacks
    measured = result["steps"][spec.warmup:]
    if status == "timeout" and measured:  # a slow system: what it measured before the limit, flagged
        summarize(result, spec)
        result["partial_samples"] = len(measured)
    result["peak"] = {
        "device_allocated_bytes": max((r.get("peak_device_allocated_bytes") or 0 for r in result["steps"]), default=0) or None,
        "device_nvml_bytes": (sampler.peak_nvml_bytes if sampler is not None else None) or None,
        "device_nvml_before_bytes": nvml_before or None,
        "host_rss_bytes": peak_host,
        # at the host's peak: the worker's process tree and its largest process (the rest: helpers)
        "host_processes": sampler.peak_host_processes if sampler is not None else None,
        "host_rss_largest_bytes": sampler.peak_host_largest_bytes if sampler is not None else None,
    }
    if disk_before and disk_after:  # every process's, the point's own among them (it runs alone)
        result["disk_io"] = {"read_bytes": disk_after[0] - disk_before[0], "written_bytes": disk_after[1] - disk_before[1]}
    result["wall_s"] = wall
    result["launch_s"] = launched  # this process's own start before the worker's: its imports, the spec's checks
    write_json(out, result)
    if interrupted is not None:
        raise interrupted
    return result


def _disk_io() -> tuple[int, int] | None:
    """Bytes read from and written to the host's disks so far (psutil; None where the OS says not)."""
    counters = psutil.disk_io_counters()
    return (counters.read_bytes, counters.write_bytes) if counters else None


_INTERRUPTS = {signal.SIGTERM, signal.SIGINT}


def _dies_with(parent: int):
    """A preexec_fn: the worker gets SIGKILL when the runner dies, so no worker trains on as an
    orphan holding the GPU; and it takes the signals the runner holds back while starting it."""
    def preexec() -> None:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _INTERRUPTS)
        die_with_parent(signal.SIGKILL, parent)
    return preexec


def _reap(proc: subprocess.Popen | launch.Forked, log: Path | None = None) -> tuple[str | None, BaseException | None]:
    """Kill the worker's tree, first asking for its stacks where `log` is given, and wait until it
    has gone. Returns the stacks and an interrupt (`timeout`'s SIGTERM, a Ctrl-C) that came
    meanwhile, which the runner raises once the result is written: a worker holding tens of GiB of
    pinned host memory can take tens of seconds to exit, and the point's result is not lost for that."""
    stacks, pending = None, None
    try:
        stacks = _stacks(proc, log) if log is not None else None
    except BaseException as e:  # held until the result is written
        pending = e
    os.killpg(proc.pid, signal.SIGKILL)
    while True:
        try:
            proc.wait()
            return stacks, pending
        except BaseException as e:  # the tree has its SIGKILL: the wait ends
            pending = pending or e


def _stacks(proc: subprocess.Popen | launch.Forked, log: Path, wait_s: float = 2.0, limit: int = 20000) -> str:
    """Where the worker tree's processes were: the Python stacks faulthandler writes to the log on
    SIGUSR1 (suite.worker registers it, and Ratel's run-time layer for Ratel's processes; a helper
    without it just ends early), then each thread as the kernel saw it just before the signal (a
    thread blocked inside the kernel, on a disk or a lock, runs no handler until it returns, and
    its wait channel says where it is)."""
    start = log.stat().st_size
    states = _thread_states(proc.pid)  # before the signal ends the helpers that do not take it
    os.killpg(proc.pid, signal.SIGUSR1)
    time.sleep(wait_s)
    with open(log, errors="replace") as f:
        f.seek(start)
        stacks = f.read()[-limit:] or "no Python stacks came back within the wait"
    return f"{stacks}\n\n{states[:limit]}".strip()


def _thread_states(pid: int, limit: int = 64) -> str:
    """Each thread of the process tree at `pid`: its state and the kernel function it waits in (/proc)."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return ""
    lines = ["each thread of the worker's tree as the kernel saw it before the signal:"]
    for p in procs:
        try:
            name, threads = p.name(), p.threads()
        except psutil.Error:
            continue
        lines.append(f"pid {p.pid} ({name}), {len(threads)} threads")
        for t in threads[:limit]:
            task = Path(f"/proc/{p.pid}/task/{t.id}")
            try:  # stat: "tid (comm) state ..."; comm may hold spaces, the state follows its ")"
                state = (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
                comm, wchan = (task / "comm").read_text().strip(), (task / "wchan").read_text().strip()
            except (OSError, IndexError):
                continue
            lines.append(f"  tid {t.id} {comm}: state {state}, waiting in {wchan or '-'}")
    return "\n".join(lines)


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _shares_host_store(spec: RunSpec) -> bool:
    """Whether the point's ranks map one host store (MegaTrain's), whose shared pages the sampler
    counts once; a baseline's ranks each hold their own shard of the offloaded state, pinned or not,
    so every rank's resident memory counts in full (suite.system.Registration.shared_host_store)."""
    return spec.gpus > 1 and SYSTEMS[spec.system].shared_host_store


def _has_gpu() -> bool:
    try:
        import pynvml
        pynvml.nvmlInit()
        return pynvml.nvmlDeviceGetCount() > 0
    except Exception:
        return False

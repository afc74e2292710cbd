"""Probe: the measured bandwidth of each memory tier of this machine, the workflow's Table 1.

Tiers as in the paper's Table 1: host memory, device memory (HBM), the PCIe link between them, and
the disk (the NVMe tier where present). Every figure is the median of `repeats` timed repetitions
after untimed warm-ups (reported apart, never averaged in), in GB/s = 1e9 bytes/s of the row's
`bytes`, whose meaning the row's `counts` states (a copy counts the bytes read plus those written).
Tiers this machine lacks are rows with status "absent" and the reason; a tier that fails is a row
with status "error" and the reason.

    python -m experiments.probes.bandwidth --out results/<machine>/probes/bandwidth.json \
        [--quick] [--size-gib N] [--disk-gib N] [--disk-dir D]
"""
from __future__ import annotations

import argparse
import errno
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil
import torch

from megatrain.io import write_json
from megatrain.metrics import environment

GIB = 1 << 30
MIB = 1 << 20
DISK_CHUNK = 64 * MIB  # bytes per write/read call; a multiple of any block size O_DIRECT asks for
DISK_HEADROOM = 256 * MIB  # never fill the disk to the last byte
# full run / --quick: buffer size, disk file size, timed repetitions (memory tiers, disk)
FULL = {"size_gib": 1.0, "disk_gib": 1.0, "repeats": 10, "disk_repeats": 3}
QUICK = {"size_gib": 1 / 64, "disk_gib": 1 / 64, "repeats": 3, "disk_repeats": 2}


@dataclass
class ProbeConfig:
    size_bytes: int  # one buffer of the memory tiers (a copy moves it once each way)
    disk_bytes: int  # the disk test file
    disk_dir: str
    repeats: int
    disk_repeats: int
    warmup: int = 1
    quick: bool = False


def build_config(args: argparse.Namespace) -> ProbeConfig:
    """Sizes from the flags or the mode's defaults; every bad value is a ValueError naming its flag."""
    base = QUICK if args.quick else FULL
    size_gib = base["size_gib"] if args.size_gib is None else args.size_gib
    disk_gib = base["disk_gib"] if args.disk_gib is None else args.disk_gib
    disk_dir = tempfile.gettempdir() if args.disk_dir is None else args.disk_dir
    return ProbeConfig(_bytes("--size-gib", size_gib), _bytes("--disk-gib", disk_gib), disk_dir,
                       base["repeats"], base["disk_repeats"], quick=args.quick)


def _bytes(flag: str, gib: float) -> int:
    # whole MiB: the disk file is then a whole number of O_DIRECT blocks
    if not gib > 0:  # also catches NaN
        raise ValueError(f"{flag} must be positive, got {gib}")
    nbytes = int(gib * GIB) // MIB * MIB
    if nbytes < MIB:
        raise ValueError(f"{flag} must be at least 1 MiB ({1 / 1024:.6f} GiB), got {gib}")
    return nbytes


def check_resources(cfg: ProbeConfig, cuda: bool) -> None:
    """Refuse, before anything is measured or written, what this machine cannot hold."""
    d = Path(cfg.disk_dir)
    if not d.is_dir():
        raise ValueError(f"--disk-dir {d} does not exist or is not a directory")
    if not os.access(d, os.W_OK | os.X_OK):
        raise ValueError(f"--disk-dir {d} is not writable")
    free = shutil.disk_usage(d).free
    if free < cfg.disk_bytes + DISK_HEADROOM:
        raise ValueError(f"--disk-dir {d} has {free / GIB:.2f} GiB free; the test file of --disk-gib "
                         f"{cfg.disk_bytes / GIB:.3f} needs that plus {DISK_HEADROOM // MIB} MiB headroom")
    # at most at once: two host buffers (host copy), or two pinned plus one pageable (CUDA tiers)
    host_need = (3 if cuda else 2) * cfg.size_bytes
    available = psutil.virtual_memory().available
    if available < host_need:
        raise ValueError(f"--size-gib {cfg.size_bytes / GIB:.3f} needs {host_need / GIB:.2f} GiB of host memory, "
                         f"{available / GIB:.2f} GiB available")
    if cuda:
        gpu_free, _ = torch.cuda.mem_get_info()
        if gpu_free < 2 * cfg.size_bytes:
            raise ValueError(f"--size-gib {cfg.size_bytes / GIB:.3f} needs {2 * cfg.size_bytes / GIB:.2f} GiB "
                             f"of GPU memory, {gpu_free / GIB:.2f} GiB free")


# ---- rows -------------------------------------------------------------------------------------

def _repeat(rep: Callable[[], float], repeats: int, warmup: int) -> tuple[list[float], list[float]]:
    """Seconds of each warm-up and of each timed repetition; `rep` times itself."""
    warm = [rep() for _ in range(warmup)]
    return [rep() for _ in range(repeats)], warm


def _row(tier: str, direction: str, counts: str, nbytes: int, samples: list[float], warm: list[float],
         method: str, **extra) -> dict:
    median = statistics.median(samples)
    return {"tier": tier, "direction": direction, "status": "ok", "gbps": nbytes / median / 1e9,
            "bytes": nbytes, "counts": counts, "repeats": len(samples), "method": method,
            "median_s": median, "samples_s": samples, "warmup_s": warm, **extra}


def _not_measured(tier: str, direction: str, status: str, reason: str) -> dict:
    return {"tier": tier, "direction": direction, "status": status, "reason": reason,
            "gbps": None, "bytes": None, "repeats": 0, "method": None}


CUDA_ROWS = [("hbm", "device-to-device"), ("pcie", "h2d-pinned"), ("pcie", "d2h-pinned"),
             ("pcie", "h2d+d2h-pinned"), ("pcie", "h2d-pageable")]


# ---- host memory ------------------------------------------------------------------------------

def host_copy(cfg: ProbeConfig) -> dict:
    n = cfg.size_bytes
    src = torch.ones(n, dtype=torch.uint8)  # ones, not empty: the pages are touched before timing
    dst = torch.empty_like(src)

    def rep() -> float:
        start = time.perf_counter()
        dst.copy_(src)
        return time.perf_counter() - start

    samples, warm = _repeat(rep, cfg.repeats, cfg.warmup)
    threads = torch.get_num_threads()
    return _row("host", "copy", "read+write", 2 * n, samples, warm,
                f"one Tensor.copy_ between two {n}-byte uint8 CPU tensors, {threads} threads (torch default), "
                "perf_counter; bytes = read + written", buffer_bytes=n, threads=threads)


# ---- device memory and the PCIe link ----------------------------------------------------------

def _event_seconds(run: Callable[[], None]) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def cuda_tiers(cfg: ProbeConfig, device: torch.device) -> list[dict]:
    n = cfg.size_bytes
    try:
        dev_a = torch.empty(n, dtype=torch.uint8, device=device)
        dev_b = torch.empty(n, dtype=torch.uint8, device=device)
        pin_a = torch.ones(n, dtype=torch.uint8, pin_memory=True)
        pin_b = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    except torch.OutOfMemoryError as e:
        return [_not_measured(t, d, "error", f"out of memory allocating the buffers: {e}") for t, d in CUDA_ROWS]
    current = torch.cuda.current_stream(device)
    up, down = torch.cuda.Stream(device), torch.cuda.Stream(device)

    def both_ways() -> None:
        up.wait_stream(current)
        down.wait_stream(current)
        with torch.cuda.stream(up):
            dev_a.copy_(pin_a, non_blocking=True)
        with torch.cuda.stream(down):
            pin_b.copy_(dev_b, non_blocking=True)
        current.wait_stream(up)  # the end event on `current` then waits for both copies
        current.wait_stream(down)

    events = "CUDA events on the current stream"
    cases = [
        ("hbm", "device-to-device", "read+write", 2 * n, lambda: dev_b.copy_(dev_a),
         f"Tensor.copy_ between two {n}-byte device tensors, {events}; bytes = read + written"),
        ("pcie", "h2d-pinned", "transferred", n, lambda: dev_a.copy_(pin_a, non_blocking=True),
         f"Tensor.copy_ of {n} bytes from pinned host memory, {events}"),
        ("pcie", "d2h-pinned", "transferred", n, lambda: pin_b.copy_(dev_b, non_blocking=True),
         f"Tensor.copy_ of {n} bytes into pinned host memory, {events}"),
        ("pcie", "h2d+d2h-pinned", "transferred, both directions together", 2 * n, both_ways,
         f"{n} bytes each way at once, H2D and D2H on two side streams, {events} spanning both; "
         "bytes = total of both directions"),
    ]
    rows = []
    for tier, direction, counts, nbytes, run, method in cases:
        samples, warm = _repeat(lambda: _event_seconds(run), cfg.repeats, cfg.warmup)
        rows.append(_row(tier, direction, counts, nbytes, samples, warm, method, buffer_bytes=n))
    pageable = torch.ones(n, dtype=torch.uint8)
    samples, warm = _repeat(lambda: _event_seconds(lambda: dev_a.copy_(pageable)), cfg.repeats, cfg.warmup)
    rows.append(_row("pcie", "h2d-pageable", "transferred", n, samples, warm,
                     f"Tensor.copy_ of {n} bytes from pageable (unpinned) host memory, {events}",
                     buffer_bytes=n))
    return rows


# ---- disk -------------------------------------------------------------------------------------

def _write_file(path: str, view: memoryview, nbytes: int) -> float:
    """Seconds to write `nbytes` sequentially into a new file and fsync it."""
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        done = 0
        while done < nbytes:
            done += os.write(fd, view[:min(len(view), nbytes - done)])
        os.fsync(fd)
        elapsed = time.perf_counter() - start
        if hasattr(os, "posix_fadvise"):  # clean pages now: drop them so no read is served from them
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return elapsed


def _read_file(path: str, buf: mmap.mmap, nbytes: int, mode: str) -> float:
    """Seconds to read the file sequentially, bypassing the page cache as `mode` says."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if mode == "o_direct" else 0))
    try:
        if mode == "fadvise_dontneed":
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        start = time.perf_counter()
        done = 0
        while done < nbytes:
            got = os.readv(fd, [buf])
            if got == 0:
                raise OSError(errno.EIO, f"{path} ended after {done} of {nbytes} bytes")
            done += got
        return time.perf_counter() - start
    finally:
        os.close(fd)


def _cache_bypass(path: str, buf: mmap.mmap) -> str:
    """O_DIRECT where the filesystem takes it (tmpfs and some others refuse it with EINVAL)."""
    o_direct = getattr(os, "O_DIRECT", None)
    if o_direct is not None:
        try:
            fd = os.open(path, os.O_RDONLY | o_direct)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
        else:
            try:
                os.readv(fd, [buf])  # some filesystems accept the flag and refuse the read
                return "o_direct"
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
            finally:
                os.close(fd)
    return "fadvise_dontneed" if hasattr(os, "posix_fadvise") else "none"


READ_METHOD = {
    "o_direct": "O_DIRECT (page cache bypassed)",
    "fadvise_dontneed": "posix_fadvise(DONTNEED) after fsync and before the read (O_DIRECT refused by "
                        "this filesystem; best effort: the cache drop is not verified)",
    "none": "buffered, page cache NOT bypassed (neither O_DIRECT nor posix_fadvise available)",
}


def _block_device(path: str) -> str | None:
    """The kernel's name of the block device under `path` (nvme0n1p1, vda, ...), if it has one."""
    dev = os.stat(path).st_dev
    link = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    return link.resolve().name if link.exists() else None


def disk_tiers(cfg: ProbeConfig) -> list[dict]:
    n = cfg.disk_bytes
    chunk = min(DISK_CHUNK, n)
    where = {"disk_dir": os.path.abspath(cfg.disk_dir), "block_device": _block_device(cfg.disk_dir)}
    buf = mmap.mmap(-1, chunk)  # anonymous mapping: page-aligned, as O_DIRECT needs
    buf.write(os.urandom(chunk))  # incompressible, so no layer below can shrink the work
    view = memoryview(buf)
    path = None
    try:
        fd, path = tempfile.mkstemp(prefix=".megatrain-bandwidth-", suffix=".bin", dir=cfg.disk_dir)
        os.close(fd)
        warm_w = [_write_file(path, view, n) for _ in range(cfg.warmup)]
        mode = _cache_bypass(path, buf)
        warm_r = [_read_file(path, buf, n, mode) for _ in range(cfg.warmup)]
        write_s, read_s = [], []
        for _ in range(cfg.disk_repeats):  # each read follows a fresh write, as a checkpoint load would
            write_s.append(_write_file(path, view, n))
            read_s.append(_read_file(path, buf, n, mode))
        return [
            _row("disk", "write", "written", n, write_s, warm_w,
                 f"sequential os.write of {chunk}-byte chunks into a new file, then fsync; perf_counter from "
                 "open to the end of fsync", file_bytes=n, **where),
            _row("disk", "read", "read", n, read_s, warm_r,
                 f"sequential os.readv of {chunk}-byte chunks into a page-aligned buffer, {READ_METHOD[mode]}",
                 file_bytes=n, cache_bypass=mode, **where),
        ]
    except OSError as e:
        return [{**_not_measured("disk", d, "error", f"{type(e).__name__}: {e}"), **where} for d in ("write", "read")]
    finally:
        if path is not None and os.path.exists(path):
            os.remove(path)
        view.release()
        buf.close()


# ---- entry ------------------------------------------------------------------------------------

def measure(cfg: ProbeConfig, device: torch.device | None) -> list[dict]:
    rows = [host_copy(cfg)]
    if device is None:
        reason = "no CUDA device (torch.cuda.is_available() is False)"
        rows += [_not_measured(t, d, "absent", reason) for t, d in CUDA_ROWS]
    else:
        rows += cuda_tiers(cfg, device)
        torch.cuda.empty_cache()
    rows += disk_tiers(cfg)
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"{'tier':<6} {'direction':<16} {'GB/s':>9} {'bytes/rep':>12} {'reps':>4}  counts / note")
    for r in rows:
        if r["status"] == "ok":
            note = r["counts"] + (f", {r['cache_bypass']}" if "cache_bypass" in r else "")
            print(f"{r['tier']:<6} {r['direction']:<16} {r['gbps']:>9.2f} {r['bytes']:>12} {r['repeats']:>4}  {note}")
        else:
            print(f"{r['tier']:<6} {r['direction']:<16} {r['status']:>9} {'':>12} {'':>4}  {r['reason']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bandwidth.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the JSON to write, e.g. results/<machine>/probes/bandwidth.json")
    parser.add_argument("--quick", action="store_true", help="small sizes and few repetitions (CI)")
    parser.add_argument("--size-gib", type=float, help=f"buffer of the memory tiers (default {FULL['size_gib']}, "
                                                       f"--quick {QUICK['size_gib'] * 1024:.0f} MiB)")
    parser.add_argument("--disk-gib", type=float, help=f"disk test file (default {FULL['disk_gib']}, "
                                                       f"--quick {QUICK['disk_gib'] * 1024:.0f} MiB)")
    parser.add_argument("--disk-dir", help="where the disk test file goes (default: tempfile.gettempdir())")
    args = parser.parse_args(argv)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    try:
        if Path(args.out).is_dir():
            raise ValueError(f"--out {args.out} is a directory; give the JSON file's path")
        cfg = build_config(args)
        check_resources(cfg, device is not None)
    except ValueError as e:
        parser.error(str(e))  # exits 2 before anything is measured or written
    rows = measure(cfg, device)
    write_json(args.out, {"probe": "bandwidth", "config": asdict(cfg), "tiers": rows,
                          "env": environment(device or torch.device("cpu"))})
    print_table(rows)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

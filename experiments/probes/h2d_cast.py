"""Probe: what a layer's load costs when its float32 master streams as it is and is cast on the
device (a whole master's load, buffers.py), against a bf16 shadow's load (a split master's).

On one GPU, N elements from pinned host memory into a bf16 device buffer, each way timed by CUDA
events on a stream of its own, the median of --reps after a warm-up:
- shadow: a pinned bf16 tensor copied as it is (a split master's load);
- staged: a pinned float32 tensor copied in chunks of --chunk elements into a float32 device
  buffer, each chunk cast into the bf16 buffer on the same stream before the next comes;
- direct: torch's copy_ from the pinned float32 tensor straight into the bf16 buffer (where torch
  casts it is what this shows);
and each way's bf16 result against the host's cast (the same bits: the round to nearest even).

    python experiments/probes/h2d_cast.py --n 268435456 --out h2d_cast.json
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch


def timed(stream: torch.cuda.Stream, fn, reps: int) -> float:
    """The median of `reps` timings of fn on `stream`, in seconds, after one untimed run."""
    times = []
    for _ in range(reps + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record()
            fn()
            end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=1 << 28, help="elements (default 2^28, about a 7B layer)")
    parser.add_argument("--chunk", type=int, default=1 << 25, help="elements a staged copy takes at a time")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", default=None, help="write the JSON here")
    args = parser.parse_args()
    n, chunk = args.n, args.chunk
    master = (torch.randn(n) * 0.02).pin_memory()
    shadow = master.to(torch.bfloat16).pin_memory()
    out = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    staging = torch.empty(chunk, dtype=torch.float32, device="cuda")
    stream = torch.cuda.Stream()

    def staged():
        for lo in range(0, n, chunk):
            hi = min(n, lo + chunk)
            staging[: hi - lo].copy_(master[lo:hi], non_blocking=True)
            out[lo:hi].copy_(staging[: hi - lo])

    ways = {"shadow": lambda: out.copy_(shadow, non_blocking=True), "staged": staged,
            "direct": lambda: out.copy_(master, non_blocking=True)}
    result = {"n": n, "chunk": chunk, "device": torch.cuda.get_device_name(), "torch": torch.__version__, "ways": {}}
    for name, fn in ways.items():
        seconds = timed(stream, fn, args.reps)
        host_bytes = n * (2 if name == "shadow" else 4)
        result["ways"][name] = {"seconds": seconds, "host_bytes": host_bytes, "link_GBps": host_bytes / seconds / 1e9,
                                "same_bits_as_host_cast": bool(torch.equal(out.cpu(), shadow))}
        out.zero_()
        print(f"{name:<7} {seconds * 1e3:8.1f} ms  {host_bytes / seconds / 1e9:6.1f} GB/s from the host  "
              f"bits {'equal' if result['ways'][name]['same_bits_as_host_cast'] else 'DIFFER'}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

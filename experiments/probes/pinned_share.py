"""What a torch.multiprocessing queue does to a pinned host tensor: the route of Ratel's gradient
buffer on its disk offload (baselines/ratel.md, "Read from its code"). Ratel's main process puts
`fp32_param.grad`, a slice of one pinned buffer, on a queue to its optimizer process each step, then
copies the next step's gradients into `grad.narrow(...).pin_memory()`.

The probe does the same with one tensor of 1 GiB: it pins it, sends it to a child process, pins a
slice of it again, writes into that slice from the GPU, and asks where the write landed. It also
reads each process's resident memory by kind (anonymous, file, shared memory) at each stage: where
pinned and shared pages show, for the harness's count of a process tree's host memory.
What it showed with torch 2.11 (results/h200/probes/pinned_share.json), as read from torch's code
beforehand: the send moves the tensor's storage into shared memory, which is not pinned. The
slice's `pin_memory()` is then a copy, so the write reaches neither the parent's tensor nor the
child's. A GPU is needed, since pinning needs CUDA.

    python -m experiments.probes.pinned_share [--out F.json]
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.multiprocessing as mp

N = 1 << 28  # float32: 1 GiB
SLICE = 16


def rss_by_kind() -> dict[str, float]:
    """This process's resident MiB by kind (/proc/self/status: RssAnon, RssFile, RssShmem)."""
    with open("/proc/self/status", encoding="utf-8") as f:
        return {k: int(v.split()[0]) / 1024 for k, v in (line.split(":", 1) for line in f) if k.startswith("Rss")}


def _child(inbox, outbox) -> None:
    t = inbox.get()
    t.sum()  # touches every page, as the optimizer's step does
    outbox.put(rss_by_kind())
    inbox.get()  # the parent has written
    outbox.put(float(t[:SLICE].sum()))


def probe() -> dict:
    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_child, args=(inbox, outbox))
    child.start()
    rss = {"parent_start": rss_by_kind()}
    grad = torch.zeros(N).pin_memory()
    rss["parent_pinned"] = rss_by_kind()
    out = {"pinned_before": grad.is_pinned(), "shared_before": grad.is_shared()}
    inbox.put(grad)
    rss["child_after_send"] = outbox.get(timeout=120)
    rss["parent_after_send"] = rss_by_kind()
    out.update(pinned_after_send=grad.is_pinned(), shared_after_send=grad.is_shared())
    view = grad.narrow(0, 0, SLICE).pin_memory()  # ratel_optimizer.py's gradient copy target
    out["pin_memory_is_a_copy"] = view.data_ptr() != grad.data_ptr()
    view.copy_(torch.ones(SLICE, device="cuda"), non_blocking=True)
    torch.cuda.synchronize()
    inbox.put("written")
    out.update(reached_parent=float(grad[:SLICE].sum()) == SLICE, reached_child=outbox.get(timeout=120) == SLICE)
    child.join(timeout=60)
    return {**out, "rss_MiB": rss, "torch": torch.__version__, "sharing_strategy": mp.get_sharing_strategy()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="write the answers here as JSON")
    args = ap.parse_args()
    result = probe()
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

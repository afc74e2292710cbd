"""One data-parallel rank of tests/distributed/test_data_parallel.py, run under torchrun:

    python -m torch.distributed.run --nproc-per-node 2 tests/distributed/dp_rank.py SPEC.json

SPEC: {"config": a run's settings, "batches": a torch.save'd list of steps' micro-batches or null
(then Trainer.fit on the config's data), "out": a folder, "crash_rank": a rank that dies at once
once the trainer is built (optional), "evaluate": true to evaluate the built weights on the
held-out data instead of training (optional)}. Writes out/rank{R}.json (losses,
gradient norms, the gradient slabs' size, the kept attention it offloaded, the shared store's
mapping in this process) and, from each host's first rank,
out/params-host{N}.pt (the weights as that host's store holds them).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from helpers import store_params
from megatrain.config import load_config
from megatrain.trainer import Trainer


def store_mapping() -> dict:
    """Resident and proportional bytes of this process's mappings of the shared store (smaps)."""
    out = {"rss_bytes": 0, "pss_bytes": 0, "files": []}
    current = None
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and not fields[0].endswith(":"):  # a mapping's header
                current = fields[5] if len(fields) > 5 and "megatrain-" in fields[5] else None
                if current and current not in out["files"]:
                    out["files"].append(current)
            elif current and fields[0] in ("Rss:", "Pss:"):
                out["rss_bytes" if fields[0] == "Rss:" else "pss_bytes"] += int(fields[1]) * 1024
    return out


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    out = Path(spec["out"])
    trainer = Trainer(load_config(base=spec["config"]))
    if spec.get("crash_rank") == trainer.ranks.rank:  # dies with the store built, the others in a collective
        os._exit(3)
    try:
        if spec.get("evaluate"):
            (out / f"rank{trainer.ranks.rank}.json").write_text(json.dumps({"eval": trainer.evaluate()}))
            return
        reduce_s = None  # the last step's gradient reduction, as its timeline has it
        if spec["batches"]:
            steps = [trainer.train_step(mbs) for mbs in torch.load(spec["batches"], weights_only=False)]
            losses, reduce_s = [m["loss"] for m in steps], steps[-1]["exposed"]["reduce_s"]
        else:
            losses = [m["loss"] for m in trainer.fit(log=open("/dev/null", "w"), progress=False)]
        trainer.optimizer.flush()
        trainer.comm.barrier()  # every rank's updates written before the weights are read
        r, e = trainer.ranks, trainer.engine
        layers = {t.name for t in e.store.layers}
        slabs = {"slab_numel": e.slab_numel, "layer_numel": max(t.layout.numel for t in e.store.layers),
                 "largest_layer_part": max(hi - lo for t, (lo, hi) in e.parts.items() if t.name in layers)}
        report = {"rank": r.rank, "node": r.node, "losses": losses, "reduce_s": reduce_s, **slabs,
                  "offloaded_attention_layers": trainer.settings.offloaded_attention_layers,
                  "attention_d2h": e.attention.bytes_d2h,
                  "grad_norms": [trainer.optimizer.grad_norms[k] for k in sorted(trainer.optimizer.grad_norms)],
                  "store_bytes": trainer.arena.nbytes if trainer.arena else None, **store_mapping()}
        (out / f"rank{r.rank}.json").write_text(json.dumps(report))
        if r.local_rank == 0:
            torch.save(store_params(trainer), out / f"params-host{r.node}.pt")
        trainer.comm.barrier()
    finally:
        trainer.close()


if __name__ == "__main__":
    main(sys.argv[1])

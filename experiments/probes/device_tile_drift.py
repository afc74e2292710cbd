"""Where device tiles' weights part from host tiles' (GPU): the tiny bf16 model of tests/engine/test_gpu.py
trained from one seeded init on the same batches with the default engine and with each variant,
the largest weight difference per tile after every step, and the gradient at that element.

Reading it: at step 1 both runs see the same weights and gradients, so any difference is AdamW's
own rounding (host vs CUDA kernel); from step 2 on, a weight one bf16 rounding apart changes the
forward, and Adam turns rounding noise in a near-zero gradient into a step of up to lr.

    python -m experiments.probes.device_tile_drift --out drift.json
"""
from __future__ import annotations

import argparse
import json

import torch

from megatrain.batch import Batch
from megatrain.config import load_config
from megatrain.trainer import Trainer

OVERRIDES = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4, "head_dim": 32,
             "num_hidden_layers": 4}
VARIANTS = {"device_tiles_2": {"device_tiles": 2}, "device_tiles_5": {"device_tiles": 5},
            "kept_4": {"no_recompute_layers": 4}, "auto": {"device_tiles": "auto", "no_recompute_layers": "auto"}}


def run(engine: dict, steps: int, lr: float, device: str) -> list[dict]:
    cfg = load_config(base={
        "model": {"preset": "tiny-qwen2", "overrides": OVERRIDES},
        "engine": {"device": device, "checkpoint_every": 2, "loss_chunk_tokens": 96, **engine},
        "optim": {"lr": lr, "max_grad_norm": 1.0, "warmup_steps": 2},
        "data": {"seq_len": 64, "batch_size": 4, "grad_accum": 2}, "steps": 20})
    trainer = Trainer(cfg)
    gen = torch.Generator().manual_seed(1)
    out = []
    try:
        for _ in range(steps):
            mbs = []
            for _ in range(2):
                ids = torch.randint(0, trainer.shape.vocab, (4, 64), generator=gen)
                mbs.append(Batch(ids, ids.clone()))
            loss = trainer.train_step(mbs)["loss"]
            trainer.optimizer.flush()
            out.append({"loss": loss, "masters": {t.name: t.read_master().detach().float().cpu().clone()
                                                  for t in trainer.store.tiles}})
    finally:
        settings = trainer.settings
        trainer.close()
    out[0]["settings"] = {"device_tiles": settings.device_tiles, "no_recompute_layers": settings.no_recompute_layers}
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    base = run({}, args.steps, args.lr, args.device)
    report = {"lr": args.lr, "variants": {}}
    for name, engine in VARIANTS.items():
        other = run(engine, args.steps, args.lr, args.device)
        rows = []
        for step, (a, b) in enumerate(zip(base, other), 1):
            tiles = {}
            for tile, wa in a["masters"].items():
                d = (b["masters"][tile] - wa).abs()
                prev = base[step - 2]["masters"][tile] if step > 1 else None
                k = int(d.argmax())
                tiles[tile] = {"max_abs_diff": float(d.max()), "elements_over_1e-5": int((d > 1e-5).sum()),
                               "numel": d.numel(),
                               "base_update_at_max": float((wa - prev).flatten()[k]) if prev is not None else None}
            rows.append({"step": step, "loss_base": a["loss"], "loss_variant": b["loss"], "tiles": tiles})
        report["variants"][name] = {"settings": other[0]["settings"], "steps": rows}
        worst = [max(t["max_abs_diff"] for t in r["tiles"].values()) for r in rows]
        print(f"{name:16s} {other[0]['settings']}  max |dw| per step: " + "  ".join(f"{w:.2e}" for w in worst))
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()

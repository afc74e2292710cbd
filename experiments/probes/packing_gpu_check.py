"""Packed against unpacked training on the GPU (bf16): the same examples as packed rows
(position_ids restarting, no mask) or one padded row each, two steps from one init; and the
held-out forward (Engine.evaluate) against the step's loss before any update.

    python experiments/probes/packing_gpu_check.py --out results/h100/probes/engine/packing_gpu_check.json
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def main() -> int:
    from helpers import store_params, tiny_checkpoint
    from megatrain.config import load_config
    from megatrain.data.pipeline import Examples
    from megatrain.data.source import collate
    from megatrain.metrics import environment
    from megatrain.trainer import Trainer
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp())
    overrides = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4, "head_dim": 32,
                 "num_hidden_layers": 4, "max_position_embeddings": 512}
    gen = np.random.default_rng(0)
    lengths = gen.integers(20, 120, 12).astype(np.int32)
    tokens = gen.integers(0, 256, int(lengths.sum())).astype(np.uint16)
    targets = gen.random(len(tokens)) < 0.6
    ex = Examples(tokens, targets, np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64), lengths, {})
    report = {"env": environment(torch.device("cuda", 0)), "presets": {}}
    for preset in ("tiny-qwen2", "tiny-mistral"):
        tiny_checkpoint(work / preset, preset, overrides)
        runs = {}
        for packed in (True, False):
            cfg = load_config(base={"model": {"pretrained": str(work / preset)},
                                    "engine": {"device": "cuda", "checkpoint_every": 2},
                                    "optim": {"lr": 1e-3, "warmup_steps": 1},
                                    "data": {"seq_len": 512, "batch_size": 12}, "steps": 2})
            trainer = Trainer(cfg)
            try:
                losses, evals = [], []
                for g in (np.arange(0, 6), np.arange(6, 12)):
                    rows = [g[:3], g[3:]] if packed else [g[k: k + 1] for k in range(6)]
                    mb = collate(ex, rows, 0, packed)
                    part, n, _ = trainer.engine.evaluate([mb])
                    evals.append(part / n)
                    losses.append(trainer.train_step([mb])["loss"])
                runs[packed] = losses, evals, store_params(trainer)
            finally:
                trainer.close()
        diff = max(float((runs[True][2][k] - runs[False][2][k]).abs().max()) for k in runs[False][2])
        report["presets"][preset] = {"packed_losses": runs[True][0], "unpacked_losses": runs[False][0],
                                     "packed_eval": runs[True][1], "unpacked_eval": runs[False][1],
                                     "max_weight_diff": diff}
        print(preset, json.dumps(report["presets"][preset]), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

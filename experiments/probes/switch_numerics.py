"""Probe: where a streaming switch's run first parts from the default run's, on the GPU.

The GPU test file holds every streaming switch to the default run's numbers bit for bit
(tests/engine/test_gpu.py, test_moe_streaming_switches_keep_numerics). For GPT-OSS two switches
(K = 1; kept layers with offloaded checkpoints) parted from the default while the compiled rotary
returned its queries and keys contiguous (docs/log.md, 2026-11-30). This trains the test's tiny model with the
default engine and with each switch, in the test's order in one process and each run in a process
of its own, with the GPU's compiled kernels and with some or all of them eager (the engine's
*_kernel settings), and the default run again beside them: each run's
losses, the first step at which they part and dynamo's recompilations; the same in one process with
torch's deterministic algorithms on (the ops that have none named by their warnings), in fresh
processes with CUDA's caching allocator off (each tensor allocated on its own), and in process
without clipping; which parameters' gradients, the step's norm and each tile's squared norm
(which clipping sums) part first, every kernel eager or with the GPU's kernels; and holds the
compiled rotary against the library's on the GPU on the queries and keys of the tiny model's
shapes, with and without grad mode. The report is written after each part.

    python -m experiments.probes.switch_numerics --out switch_numerics.json
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

PRESET = "tiny-gpt-oss"
OVERRIDES = {"hidden_size": 128, "intermediate_size": 64, "num_local_experts": 8, "head_dim": 32}
SWITCHES = {"K1": {"checkpoint_every": 1}, "kept": {"no_recompute_layers": 2, "offload_checkpoints": True},
            "one_buffer": {"weight_buffers": 1, "grad_slabs": 0}, "again": {}}
SEQ, BATCH, STEPS = 64, 4, 3


def train(init: Path, engine: dict, steps: int = STEPS, grads: list | None = None, optim: dict | None = None) -> list[float]:
    """The GPU test's run (test_gpu.gpu_tree; `optim` set over its optimizer's settings): its
    losses; into `grads`, each step's float32 gradient of every parameter, by its library name, as
    the host store holds it for the update, its gradient norm under "norm" and each tile's squared
    norm, as the engine summed it on the device, under "sq.<tile>"."""
    from helpers import random_batches
    from megatrain.config import load_config
    from megatrain.trainer import Trainer
    tree = {"model": {"pretrained": str(init)},
            "engine": {"device": "cuda", "checkpoint_every": 2, "loss_chunk_tokens": 96, "device_tiles": 0, **engine},
            "optim": {"lr": 1e-3, "max_grad_norm": 1.0, "warmup_steps": 2, **(optim or {})},
            "data": {"seq_len": SEQ, "batch_size": BATCH, "grad_accum": 2}, "steps": STEPS}
    trainer = Trainer(load_config(base=tree))
    try:
        losses = []
        for mbs in random_batches(STEPS, 2, BATCH, SEQ, 256, pad=True)[:steps]:
            losses.append(trainer.train_step(mbs)["loss"])
            if grads is not None:
                trainer.optimizer.flush()
                grads.append({name: view.clone() for tile in trainer.store.tiles
                              for name, view in zip(trainer.shape.hf_names(tile.name), tile.layout.views(tile.grad))})
                norms = trainer.optimizer.grad_norms  # by step
                grads[-1]["norm"] = torch.tensor(norms[max(norms)], dtype=torch.float64)
                for tile, sq in zip(trainer.store.tiles, trainer.engine.sq_host):  # each tile's squared norm
                    grads[-1][f"sq.{tile.name}"] = sq.clone()
        return losses
    finally:
        trainer.close()


def parted(a: list[float], b: list[float]) -> int | None:
    """The first step whose losses differ, None where none does."""
    return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), None)


def in_process(init: Path, kernels: dict, optim: dict | None = None, names: tuple = tuple(SWITCHES)) -> dict:
    """The default then each switch (of `names`), in this process, as the test runs them."""
    from torch._dynamo.utils import counters
    out = {}
    for name in names:
        switch = SWITCHES[name]
        before = sum(counters["recompiles"].values()) if "recompiles" in counters else 0
        base, other = train(init, kernels, optim=optim), train(init, {**kernels, **switch}, optim=optim)
        out[name] = {"base": base, "switch": other, "parted_at": parted(base, other),
                     "recompiles": (sum(counters["recompiles"].values()) if "recompiles" in counters else 0) - before}
    return out


def grad_diff(init: Path, kernels: dict) -> dict:
    """Each switch's first two steps' gradients against the default run's: per step, the parameters
    whose gradient differs, by their largest difference, largest first."""
    base: list = []
    train(init, kernels, 2, base)
    out = {}
    for name in ("K1", "kept"):
        other: list = []
        train(init, {**kernels, **SWITCHES[name]}, 2, other)
        out[name] = {"parted_at": next((k for k, (a, b) in enumerate(zip(base, other))
                                        if any(not torch.equal(a[p], b[p]) for p in a)), None)}
        for step, (a, b) in enumerate(zip(base, other)):
            diffs = {p: float((a[p] - b[p]).abs().max()) for p in a if not torch.equal(a[p], b[p])}
            out[name][f"step{step}"] = dict(sorted(diffs.items(), key=lambda kv: -kv[1]))
    return out


def deterministic(init: Path, kernels: dict) -> dict:
    """in_process with torch.use_deterministic_algorithms on: its runs, and the ops it warned of."""
    import warnings
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = in_process(init, kernels)
    finally:
        torch.use_deterministic_algorithms(False)
    out["warned"] = sorted({str(w.message)[:300] for w in caught if "determinis" in str(w.message)})
    return out


def fresh(init: Path, kernels: dict, env: dict | None = None) -> dict:
    """The default and each switch, each in a process of its own (with `env` added to its environment)."""
    out = {}
    runs = {"base": {}, **SWITCHES}
    losses = {}
    for name, switch in runs.items():
        r = subprocess.run([sys.executable, "-m", "experiments.probes.switch_numerics", "--one", str(init),
                            json.dumps({**kernels, **switch})], cwd=ROOT, capture_output=True, text=True,
                           env={**os.environ, **(env or {})})
        losses[name] = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else r.stderr[-2000:]
    for name in SWITCHES:
        out[name] = {"base": losses["base"], "switch": losses[name],
                     "parted_at": parted(losses["base"], losses[name]) if isinstance(losses[name], list) else "failed"}
    return out


def rotary_kernel() -> dict:
    """The compiled GPT-OSS rotary against the library's on the GPU, bf16, the tiny model's q and k
    (4 query heads of 32 over 2 key heads, transposed views), with and without grad: equal or not."""
    from transformers.models.gpt_oss.modeling_gpt_oss import apply_rotary_pos_emb as library
    from megatrain import rotary
    gen = torch.Generator(device="cuda").manual_seed(0)
    out = {}
    for rows in (2, 4):
        for grad in (False, True):
            B, S, D = rows, SEQ, 32
            q = (3 * torch.randn(B, S, 4, D, generator=gen, device="cuda")).bfloat16().transpose(1, 2)
            k = (3 * torch.randn(B, S, 2, D, generator=gen, device="cuda")).bfloat16().transpose(1, 2)
            angles = torch.randn(B, S, D // 2, generator=gen, device="cuda")
            cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
            results = []
            for fn in (library, rotary.apply_rotary_halves):
                qi, ki = q.detach().requires_grad_(grad), k.detach().requires_grad_(grad)
                with torch.set_grad_enabled(grad):
                    qo, ko = fn(qi, ki, cos, sin)
                    got = [qo, ko]
                    if grad:
                        got += torch.autograd.grad((qo, ko), (qi, ki), (torch.ones_like(qo), torch.ones_like(ko)))
                results.append([t.detach() for t in got])
            out[f"rows{rows}_grad{grad}"] = [bool(torch.equal(a, b)) for a, b in zip(*results)]
    return out


def grad_mode(init: Path) -> dict:
    """The library's tiny model in bf16 on the GPU, flex attention and eager: its logits computed
    under no_grad and with grad (the input embeddings requiring it), equal or not; and of its first
    decoder layer alone, on random hidden states."""
    from transformers import AutoModelForCausalLM
    out = {}
    ids = torch.randint(0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(0)).cuda()
    for attn in ("flex_attention", "eager"):
        model = AutoModelForCausalLM.from_pretrained(init, dtype=torch.bfloat16, attn_implementation=attn).cuda()
        embeds = model.get_input_embeddings()(ids).detach()
        with torch.no_grad():
            plain = model(inputs_embeds=embeds).logits
        with torch.enable_grad():
            graphed = model(inputs_embeds=embeds.clone().requires_grad_(True)).logits
        out[f"{attn}_logits_equal"] = bool(torch.equal(plain, graphed))
        out[f"{attn}_logits_max_diff"] = float((plain.float() - graphed.detach().float()).abs().max())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out")
    ap.add_argument("--parts", nargs="*", help="only these parts of the report (its keys)")
    ap.add_argument("--grad-mode", action="store_true", help="only the library model's no_grad against grad forward")
    ap.add_argument("--one", nargs=2, metavar=("INIT", "ENGINE_JSON"), help="(internal) one run: its losses")
    args = ap.parse_args()
    if args.one:
        print(json.dumps(train(Path(args.one[0]), json.loads(args.one[1]))))
        return
    from helpers import tiny_checkpoint
    init = Path(tempfile.mkdtemp()) / "init"
    tiny_checkpoint(init, PRESET, OVERRIDES)
    if args.grad_mode:
        report = {"grad_mode": grad_mode(init)}
        print(json.dumps(report), flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=1))
        return
    report = {"rotary_kernel": rotary_kernel()}
    print(json.dumps(report["rotary_kernel"]), flush=True)
    eager = {k: "eager" for k in ("norm_kernel", "mlp_kernel", "loss_kernel", "rotary_kernel")}
    parts = [("in_process_compiled", in_process, {}), ("deterministic_compiled", deterministic, {}),
             ("fresh_compiled", fresh, {}), ("in_process_eager_rotary", in_process, {"rotary_kernel": "eager"}),
             ("in_process_eager_mlp", in_process, {"mlp_kernel": "eager"}), ("in_process_eager", in_process, eager),
             ("fresh_eager", fresh, eager), ("grad_diff_eager", grad_diff, eager), ("grad_diff_compiled", grad_diff, {}),
             # every tensor its own cudaMalloc, at the allocator's alignment whatever the schedule
             ("fresh_no_caching", functools.partial(fresh, env={"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}), {}),
             # without clipping: the update takes no norm of the step's gradients
             ("in_process_no_clipping", functools.partial(in_process, optim={"max_grad_norm": None}, names=("K1", "kept")), {})]
    parts = [p for p in parts if not args.parts or p[0] in args.parts]
    for key, part, kernels in parts:
        report[key] = part(init, kernels)
        print(key, {name: r["parted_at"] for name, r in report[key].items() if name != "warned"},
              report[key].get("warned", ""), flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=1))

if __name__ == "__main__":
    main()

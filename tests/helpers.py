"""Helpers the tests share: tiny `transformers` checkpoints, random batches, a plain-PyTorch
reference trainer (transformers + torch.optim.AdamW) to hold the engine to, a preset's shape and
its resolved engine settings, and ranks launched under torchrun (tests/distributed/dp_rank.py)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, get_scheduler

from megatrain.shapes import ModelShape, ParamSpec, load_hf_config
from megatrain.config import DataConfig, EngineConfig, EngineSettings, ModelConfig, OptimConfig
from megatrain.batch import Batch
from megatrain.optim import schedule_arguments
from megatrain.resolve import Machine, resolve

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent  # the repository


def tiny_checkpoint(path, preset: str, overrides: dict | None = None, seed: int = 0):
    """Save a seeded, float32, randomly initialised tiny model; return it. DeepSeek-V3's routers'
    correction biases, which the library initialises to zero, are drawn as a trained model's are not
    (N(0, 0.1): about the spread of the sigmoid scores they are added to), so that routing depends on them."""
    torch.manual_seed(seed)
    hf = load_hf_config(ModelConfig(preset=preset, overrides=overrides or {}))
    model = AutoModelForCausalLM.from_config(hf).float()
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.1)
    model.save_pretrained(path)
    return model


def random_batches(steps: int, accum: int, batch: int, seq: int, vocab: int, pad: bool, seed: int = 1):
    """Per step, `accum` micro-batches; with pad, some sequences are right-padded."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        mbs = []
        for _ in range(accum):
            ids = torch.randint(0, vocab, (batch, seq), generator=gen)
            mask = torch.ones_like(ids)
            if pad:
                mask[0, seq - 5:] = 0
                mask[-1, seq // 2:] = 0
            labels = ids.masked_fill(mask == 0, -100)
            mbs.append(Batch(ids, labels, mask))
        out.append(mbs)
    return out


class Reference:
    """A fully resident `transformers` model trained with torch.optim.AdamW: the ground truth. A
    mixture of experts whose config asks for the router's loss (output_router_logits) adds the
    model's own `aux_loss`, weighted as its `loss` weighs it, to each micro-batch's share."""

    def __init__(self, model, optim: OptimConfig, total_steps: int):
        self.model = model
        matrices = {n for n, p in model.named_parameters() if ParamSpec(n, tuple(p.shape)).decay}
        decay = [p for n, p in model.named_parameters() if n in matrices or optim.decay == "all"]
        rest = [p for n, p in model.named_parameters() if n not in matrices and optim.decay == "matrices"]
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": optim.weight_decay},
                                      {"params": rest, "weight_decay": 0.0}],
                                     lr=optim.lr, betas=optim.betas, eps=optim.eps)
        # the schedule as the HF Trainer builds and steps it, once after each optimizer step
        self.sched = get_scheduler(optim.schedule, self.opt, num_warmup_steps=optim.warmup_steps,
                                   num_training_steps=total_steps, scheduler_specific_kwargs=schedule_arguments(optim))
        self.max_norm = optim.max_grad_norm

    def step(self, microbatches: list[Batch]) -> tuple[float, float]:
        """Mean loss over the step's target tokens, and the gradient norm before clipping."""
        self.opt.zero_grad()
        n = sum(int((mb.labels[:, 1:] != -100).sum()) for mb in microbatches)
        total = 0.0
        aux_coef = getattr(self.model.config, "router_aux_loss_coef", 0.0)
        for mb in microbatches:
            out = self.model(input_ids=mb.input_ids, attention_mask=mb.attention_mask)
            logits = out.logits.float()
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), mb.labels[:, 1:].reshape(-1),
                ignore_index=-100, reduction="sum")
            share = loss / n
            if getattr(out, "aux_loss", None) is not None:
                share = share + aux_coef * out.aux_loss / len(microbatches)
            share.backward()
            total += share.item()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_norm or float("inf"))
        self.opt.step()
        self.sched.step()
        return total, float(norm)


def store_params(trainer) -> dict[str, torch.Tensor]:
    trainer.optimizer.flush()
    out = {}
    for tile in trainer.store.tiles:
        for name, view in zip(trainer.shape.hf_names(tile.name), tile.master_views()):
            out[name] = view.to("cpu", torch.float32)
    for name, buffer in trainer.store.named_buffers():
        out[name] = buffer.to("cpu")
    return out


def train_save_reload(trainer, batches, out) -> dict[str, torch.Tensor]:
    """Train on `batches`, export with save_pretrained, load with `from_pretrained`: the loaded state,
    checked equal to the trained store to the bit; the trainer is closed."""
    try:
        for mbs in batches:
            trainer.train_step(mbs)
        trainer.save_pretrained(out)
        ours = store_params(trainer)
    finally:
        trainer.close()
    state = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    if trainer.shape.tied:
        state.pop("lm_head.weight")
    assert set(state) == set(ours)
    for name, value in ours.items():
        torch.testing.assert_close(state[name], value, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
    return state


def shape_of(preset: str, **overrides) -> ModelShape:
    return ModelShape(load_hf_config(ModelConfig(preset=preset, overrides=overrides)))


def settings(shape: ModelShape, engine: EngineConfig | None = None, *, master="float32", compute="bfloat16",
             tokens=16384, microbatches=1, clipping=False, pinned=False, device_free=None,
             host=2**60) -> EngineSettings:
    """A run's resolved engine settings: one sequence of `tokens` per micro-batch, a device of
    `device_free` bytes (None: unbounded), `host` bytes of host memory, a GPU's pinned buffers
    where `pinned`."""
    engine = replace(engine or EngineConfig(), master_dtype=master, compute_dtype=compute)
    data = DataConfig(seq_len=tokens, grad_accum=microbatches)
    return resolve(engine, data, OptimConfig(max_grad_norm=1.0 if clipping else None), shape,
                   Machine(pinned, device_free, host))


# the repository and these helpers ahead of the caller's path (a GPU host's carried packages live on
# PYTHONPATH); one OpenMP thread a rank, so that the ranks of a test share the machine's cores
RANK_ENV = {**os.environ, "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS.parent), str(TESTS), os.environ.get("PYTHONPATH")]))}


def torchrun(tmp_path, tree: dict, batches: str | None, name: str, nodes: int = 1, crash_rank: int | None = None,
             per_host: int = 2, evaluate: bool = False) -> list[dict]:
    """Run tests/distributed/dp_rank.py under torchrun, `per_host` ranks per "host", `nodes` hosts on
    this machine (each its own torchrun, as on separate hosts); the ranks' reports."""
    rank = str(TESTS / "distributed" / "dp_rank.py")
    out = tmp_path / name
    out.mkdir()
    spec = out / "spec.json"
    spec.write_text(json.dumps({"config": tree, "batches": batches, "out": str(out), "crash_rank": crash_rank,
                                "evaluate": evaluate}))
    run = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(per_host)]
    if nodes == 1:
        commands = [run + ["--standalone", rank, str(spec)]]
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        commands = [run + ["--nnodes", str(nodes), "--node-rank", str(k), "--master-addr", "127.0.0.1",
                           "--master-port", str(port), rank, str(spec)] for k in range(nodes)]
    procs = [subprocess.Popen(c, env=RANK_ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for c in commands]
    logs = [p.communicate(timeout=240)[0] for p in procs]
    if crash_rank is not None:
        assert all(p.returncode != 0 for p in procs)
        return []
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-4000:] for log in logs)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(per_host * nodes)]

"""Saving: the exported checkpoint loads in `transformers` with our exact weights; a resumed run
continues bit for bit like the uninterrupted one."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import random_batches, store_params, tiny_checkpoint
from megatrain.config import load_config
from megatrain.trainer import Trainer


def config(tmp_path, steps, engine=None, **extra):
    return load_config(base={
        "model": {"pretrained": str(tmp_path / "init")},
        "engine": {"device": "cpu", "checkpoint_every": 2, **(engine or {})},
        "optim": {"lr": 1e-3, "warmup_steps": 1},
        "data": {"seq_len": 16, "batch_size": 2, "grad_accum": 2},
        "steps": steps, **extra,
    })


def test_save_pretrained_round_trip(tmp_path):
    tiny_checkpoint(tmp_path / "init", "tiny-llama")
    trainer = Trainer(config(tmp_path, 2))
    try:
        for mbs in random_batches(2, 2, 2, 16, 256, pad=True):
            trainer.train_step(mbs)
        trainer.save_pretrained(tmp_path / "out")
        ours = store_params(trainer)
    finally:
        trainer.close()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    state = loaded.state_dict()
    assert set(state) == set(ours)
    for name, value in ours.items():
        torch.testing.assert_close(state[name], value, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
    initial = AutoModelForCausalLM.from_pretrained(tmp_path / "init").state_dict()
    assert not torch.equal(initial["model.layers.0.mlp.up_proj.weight"], state["model.layers.0.mlp.up_proj.weight"])


@pytest.mark.parametrize("engine", [{}, {"device_tiles": 2}], ids=["host", "device-tiles"])
def test_resume_equals_uninterrupted(tmp_path, engine):
    """Device tiles' master and moments go through the saved state like the host tiles'."""
    tiny_checkpoint(tmp_path / "init", "tiny-qwen2")
    whole = Trainer(config(tmp_path, 4, engine, output_dir=str(tmp_path / "a")))
    try:
        whole.fit(log=open("/dev/null", "w"), progress=False)
        expected = store_params(whole)
    finally:
        whole.close()
    first = Trainer(config(tmp_path, 2, engine, output_dir=str(tmp_path / "b")))
    try:
        first.fit(log=open("/dev/null", "w"), progress=False)
    finally:
        first.close()
    resumed = Trainer(config(tmp_path, 4, engine, output_dir=str(tmp_path / "b"), resume=True))
    try:
        assert resumed.step == 2 and resumed.data.position == 4
        resumed.fit(log=open("/dev/null", "w"), progress=False)
        got = store_params(resumed)
    finally:
        resumed.close()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
    assert (tmp_path / "b" / "model" / "model.safetensors").is_file()
    assert not [p for p in (tmp_path / "b").iterdir() if p.name.startswith(".")], "temporary files left behind"

"""Saving: the exported checkpoint loads in `transformers` with our exact weights; a resumed run
continues bit for bit like the uninterrupted one; a file is replaced whole or not at all."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers import random_batches, store_params, tiny_checkpoint, train_save_reload
from megatrain.config import load_config
from megatrain.trainer import Trainer


def config(tmp_path, steps, engine=None, **extra):
    return load_config(base={
        "model": {"pretrained": str(tmp_path / "init")},
        "engine": {"device": "cpu", "checkpoint_every": 2, **(engine or {})},
        "optim": {"lr": 1e-3, "schedule": "constant"},
        "data": {"seq_len": 16, "batch_size": 2, "grad_accum": 2},
        "steps": steps, **extra,
    })


@pytest.mark.parametrize("engine", [{}, {"compute_dtype": "bfloat16", "split_masters": True}], ids=["float32", "split-masters"])
def test_save_pretrained_round_trip(tmp_path, engine):
    """Split float32 masters (engine.split_masters, store.py): the export joins them."""
    tiny_checkpoint(tmp_path / "init", "tiny-llama")
    state = train_save_reload(Trainer(config(tmp_path, 2, engine)), random_batches(2, 2, 2, 16, 256, pad=True),
                              tmp_path / "out")
    initial = AutoModelForCausalLM.from_pretrained(tmp_path / "init").state_dict()
    assert not torch.equal(initial["model.layers.0.mlp.up_proj.weight"], state["model.layers.0.mlp.up_proj.weight"])


@pytest.mark.parametrize("preset, name", [("tiny-phi3", "model.layers.0.mlp.gate_up_proj.weight"),
                                          ("tiny-gemma2", "model.layers.0.post_feedforward_layernorm.weight"),
                                          ("tiny-gemma3", "model.layers.0.self_attn.q_norm.weight")])
def test_save_pretrained_round_trip_of_each_dense_family(tmp_path, preset, name):
    """Phi-3's fused projections and Gemma's extra norms are exported under the library's names and
    load back by `from_pretrained` (Gemma 3's text model from its own model_type) to the bit."""
    tiny_checkpoint(tmp_path / "init", preset)
    state = train_save_reload(Trainer(config(tmp_path, 2)), random_batches(2, 2, 2, 16, 256, pad=True), tmp_path / "out")
    initial = AutoModelForCausalLM.from_pretrained(tmp_path / "init").state_dict()
    assert not torch.equal(initial[name], state[name])


@pytest.mark.parametrize("preset, engine", [("tiny-qwen2", {}), ("tiny-qwen2", {"device_tiles": 2}),
                                            ("tiny-qwen2", {"compute_dtype": "bfloat16", "split_masters": True}),
                                            ("tiny-gpt-oss", {}), ("tiny-qwen3-moe", {"device_tiles": 2}),
                                            ("tiny-mixtral", {}), ("tiny-phi3", {}), ("tiny-gemma3", {}),
                                            ("tiny-deepseek-v3", {"device_tiles": 2})],
                         ids=["host", "device-tiles", "split-masters", "gpt-oss", "qwen3-moe-device-tiles", "mixtral",
                              "phi3", "gemma3", "deepseek-v3-device-tiles"])
def test_resume_equals_uninterrupted(tmp_path, preset, engine):
    """Device tiles' master and moments go through the saved state like the host tiles'; split
    masters (engine.split_masters) are saved joined, with plain moments, and split again on resume;
    mixtures of experts (their router loss on) resume as the dense models do, DeepSeek-V3's layer
    buffers saved beside the tiles."""
    tiny_checkpoint(tmp_path / "init", preset)
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
    with pytest.raises(ValueError, match=r"differ from the saved run's in steps: 2 -> 4; set resume_changes=true"):
        Trainer(config(tmp_path, 4, engine, output_dir=str(tmp_path / "b"), resume=True))
    # at a constant rate the first two steps are the 4-step run's: extending it changes nothing done
    resumed = Trainer(config(tmp_path, 4, engine, output_dir=str(tmp_path / "b"), resume=True, resume_changes=True))
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


class _Killed(BaseException):
    """Stands for the process dying at this instant (nothing after it runs, no cleanup counts)."""


def test_a_save_killed_at_any_point_leaves_a_complete_state(tmp_path, monkeypatch):
    """Kill a save over an earlier one at each of its file operations (each rename and removal): a
    resume finds a complete state, the earlier save's or the new one's, never none and never half."""
    import os
    import shutil

    from megatrain import checkpoint, io
    tiny_checkpoint(tmp_path / "init", "tiny-llama")
    run = tmp_path / "run"
    trainer = Trainer(config(tmp_path, 4, output_dir=str(run)))
    state, pristine = run / "state", tmp_path / "first"
    try:
        trainer.train_step(random_batches(1, 2, 2, 16, 256, pad=True)[0])
        trainer.save_state(pristine)
        first = {k: v.clone() for k, v in store_params(trainer).items()}
        trainer.train_step(random_batches(1, 2, 2, 16, 256, pad=True, seed=2)[0])
        trainer.optimizer.flush()
        second = store_params(trainer)
        real_replace, real_rmtree = os.replace, shutil.rmtree
        point, killed = 0, True
        while killed:
            run.mkdir(exist_ok=True)
            for leftover in run.iterdir():
                real_rmtree(leftover)
            shutil.copytree(pristine, state)
            calls = [0]

            def dying(real):
                def op(*args, **kwargs):
                    calls[0] += 1
                    if calls[0] == point + 1:
                        raise _Killed
                    return real(*args, **kwargs)
                return op
            monkeypatch.setattr(io.os, "replace", dying(real_replace))
            monkeypatch.setattr(io.shutil, "rmtree", dying(real_rmtree))
            try:
                trainer.save_state(state)
                killed = False
            except _Killed:
                pass
            finally:
                monkeypatch.setattr(io.os, "replace", real_replace)
                monkeypatch.setattr(io.shutil, "rmtree", real_rmtree)
            assert checkpoint.saved_state(state) is not None, f"no complete state after a kill at operation {point}"
            resumed = Trainer(config(tmp_path, 4, output_dir=str(run), resume=True))  # the same settings
            try:
                got = store_params(resumed)
            finally:
                resumed.close()
            expected = {1: first, 2: second}[resumed.step]
            assert killed or resumed.step == 2
            for name, value in expected.items():
                torch.testing.assert_close(got[name], value, rtol=0, atol=0)
            point += 1
    finally:
        trainer.close()
    assert point >= 4  # the swap over an earlier save: its operations, each killed once, then a whole save


def test_resume_without_a_saved_state_is_refused(tmp_path):
    tiny_checkpoint(tmp_path / "init", "tiny-llama")
    with pytest.raises(ValueError, match="resume=true: no saved training state"):
        Trainer(config(tmp_path, 2, output_dir=str(tmp_path / "never"), resume=True))
    assert not (tmp_path / "never").exists()


def test_an_output_dir_that_cannot_be_written_is_refused_before_training(tmp_path):
    tiny_checkpoint(tmp_path / "init", "tiny-llama")
    (tmp_path / "file").write_text("x")
    cases = [(tmp_path / "file", "is a file"), (tmp_path / "file" / "sub", "is a file")]
    if os.path.isdir("/proc/self"):  # a folder whose permission bits allow root to write, where nothing can be made
        cases.append((Path("/proc/megatrain-out/run"), "/proc cannot be written"))
    for where, message in cases:
        with pytest.raises(ValueError, match=message):
            Trainer(config(tmp_path, 2, output_dir=str(where)))
    Trainer(config(tmp_path, 2, output_dir=str(tmp_path / "new" / "run"))).close()  # a writable one is taken
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "init"]  # its probe removed, nothing made yet


def test_saves_the_disk_cannot_hold_are_refused_before_training(tmp_path, monkeypatch):
    """planning.save_bytes counts what a run's saves write (the state and the model's weights, their
    files' headers and the model's config aside), and a run whose output_dir's disk has less free is
    refused by name before anything is made; a save_every run needs a second state and its
    checkpoint's model."""
    from megatrain import planning
    tiny_checkpoint(tmp_path / "init", "tiny-llama")
    out = tmp_path / "run"
    trainer = Trainer(config(tmp_path, 2, output_dir=str(out), save_dtype="bfloat16"))
    need = planning.save_bytes(trainer.cfg, trainer.shape)
    trainer.fit(progress=False)
    trainer.close()
    written = {name: sum(f.stat().st_size for f in (out / name).rglob("*.safetensors")) for name in need}
    for name in need:
        assert need[name] <= written[name] <= need[name] * 1.01 + 2**16, name
    every = planning.save_bytes(config(tmp_path, 2, output_dir=str(out), save_every=1, save_total_limit=3,
                                       save_dtype="bfloat16"),
                                trainer.shape)
    assert every == {"state": 2 * need["state"], "model": 4 * need["model"]}
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(planning.shutil, "disk_usage", lambda _: usage._replace(free=sum(need.values()) - 1))
    with pytest.raises(ValueError, match=r"output_dir \S+/other: the run's saves need at least 0.0 GiB \(training "
                                         r"state 0.0, model 0.0 in bfloat16\), and its disk has 0.0 GiB free"):
        Trainer(config(tmp_path, 2, output_dir=str(tmp_path / "other"), save_dtype="bfloat16"))
    assert not (tmp_path / "other").exists()
    monkeypatch.setattr(planning.shutil, "disk_usage", lambda _: usage._replace(free=sum(need.values())))
    Trainer(config(tmp_path, 2, output_dir=str(tmp_path / "other"), save_dtype="bfloat16")).close()


def test_a_rerun_never_replaces_an_earlier_run_unasked(tmp_path):
    """A second run into an output_dir that holds a run's outputs is refused, naming them, with
    nothing changed; overwrite=true removes them before writing its own; resume with it is refused;
    a state left as its `.old` copy by a save cut short counts as an earlier run's."""
    tiny_checkpoint(tmp_path / "init", "tiny-llama")
    out = tmp_path / "run"
    first = Trainer(config(tmp_path, 3, output_dir=str(out)))
    first.fit(progress=False)
    first.close()
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    assert sorted(before) == ["metrics.jsonl", "model", "state"]
    with pytest.raises(ValueError, match="holds an earlier run's metrics.jsonl, state, model: resume=true continues"):
        Trainer(config(tmp_path, 2, output_dir=str(out)))
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
    with pytest.raises(ValueError, match="resume and overwrite exclude each other"):
        config(tmp_path, 2, output_dir=str(out), resume=True, overwrite=True)
    second = Trainer(config(tmp_path, 2, output_dir=str(out), overwrite=True))
    (out / "tensorboard").mkdir()  # an earlier run's events, which this run does not write
    second.fit(progress=False)
    second.close()
    assert sorted(p.name for p in out.iterdir()) == ["metrics.jsonl", "model", "state"]
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert json.loads((out / "state" / "state.json").read_text())["step"] == 2
    os.replace(out / "state", out / ".state.old")
    (out / "metrics.jsonl").unlink()
    shutil.rmtree(out / "model")
    with pytest.raises(ValueError, match="holds an earlier run's .state.old"):
        Trainer(config(tmp_path, 2, output_dir=str(out)))


@pytest.mark.parametrize("clip, engine", [(None, {}), (1.0, {}), (None, {"device_tiles": 2}), (1.0, {"device_tiles": 2})],
                         ids=["host", "host-clip", "device-tiles", "device-tiles-clip"])
def test_a_non_finite_step_never_reaches_the_weights(tmp_path, monkeypatch, clip, engine):
    """The head's gradient made NaN at the second step: the step stops with a clear error, and
    every tile (updated on the host from slabs, after clipping, or on the device) keeps the
    weights and moments of the first step: nothing non-finite anywhere."""
    import megatrain.engine
    tiny_checkpoint(tmp_path / "init", "tiny-llama")
    trainer = Trainer(load_config(base={
        "model": {"pretrained": str(tmp_path / "init")}, "engine": {"device": "cpu", "checkpoint_every": 2, **engine},
        "optim": {"lr": 1e-3, "max_grad_norm": clip}, "data": {"seq_len": 16, "batch_size": 2, "grad_accum": 2},
        "steps": 4}))
    try:
        trainer.train_step(random_batches(1, 2, 2, 16, 256, pad=True)[0])
        before = {k: v.clone() for k, v in store_params(trainer).items()}
        moments = [t.exp_avg_sq.clone() for t in trainer.store.tiles]
        real = megatrain.engine.head_loss_and_grads

        def poisoned(*args, **kwargs):
            part, dx = real(*args, **kwargs)
            return part, dx * float("nan")
        monkeypatch.setattr(megatrain.engine, "head_loss_and_grads", poisoned)
        with pytest.raises(FloatingPointError, match="NaN or an infinity in embed, layer.0"):
            trainer.train_step(random_batches(1, 2, 2, 16, 256, pad=True, seed=2)[0])
        after = store_params(trainer)
        for name, value in before.items():
            if name not in ("model.norm.weight", "lm_head.weight"):  # the head's own gradient stayed finite
                torch.testing.assert_close(after[name], value, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
        assert all(bool(torch.isfinite(v).all()) for v in after.values())
        for tile, m in zip(trainer.store.tiles, moments):
            if tile.name != "head":
                assert torch.equal(tile.exp_avg_sq, m), tile.name
        assert trainer.step == 1
    finally:
        trainer.close()


def test_the_command_stops_on_a_non_finite_step_and_saves_nothing(tmp_path, monkeypatch, capsys):
    import megatrain.engine
    from megatrain.cli import main
    tiny_checkpoint(tmp_path / "init", "tiny-llama")
    monkeypatch.setattr(megatrain.engine, "head_loss_and_grads",
                        lambda *a, **_: (torch.tensor(float("nan")), torch.full_like(a[0], float("nan"))))
    code = main(["train", "--no-progress", "--no-json", f"model.pretrained={tmp_path / 'init'}", "engine.device=cpu",
                 "data.seq_len=16", "data.batch_size=2", "steps=2", f"output_dir={tmp_path / 'out'}"])
    assert code == 3 and "error at step 1" in capsys.readouterr().err
    assert not (tmp_path / "out" / "model").exists() and not (tmp_path / "out" / "state").exists()


def saved_run(tmp_path) -> None:
    """A tiny llama trained 2 steps into tmp_path/r, its state saved there."""
    tiny_checkpoint(tmp_path / "init", "tiny-llama")
    first = Trainer(config(tmp_path, 2, output_dir=str(tmp_path / "r")))
    try:
        first.fit(log=open("/dev/null", "w"), progress=False)
    finally:
        first.close()


def test_resume_names_each_change_of_meaning(tmp_path):
    saved_run(tmp_path)
    cfg = config(tmp_path, 2, output_dir=str(tmp_path / "r"), resume=True)
    cfg.optim.lr, cfg.data.batch_size = 5e-4, 4
    with pytest.raises(ValueError, match=r"optim.lr: 0.001 -> 0.0005; data.batch_size: 2 -> 4"):
        Trainer(cfg)
    cfg = config(tmp_path, 2, output_dir=str(tmp_path / "r"), resume=True, engine={"checkpoint_every": 1})
    Trainer(cfg).close()  # how the engine runs is not what the run means


def test_a_damaged_or_foreign_saved_state_is_refused_before_anything_is_allocated(tmp_path, monkeypatch):
    """resume=true reads the saved state's headers first: a state.json that is not the state's, a
    tile's file missing, cut short or of another model is refused by name, not by safetensors once
    the store is allocated and filled."""
    import megatrain.trainer
    saved_run(tmp_path)
    state = tmp_path / "r" / "state"
    monkeypatch.setattr(megatrain.trainer, "HostStore", None)  # a store allocated would fail otherwise
    layer = state / "layer.1.safetensors"
    whole = layer.read_bytes()
    other = tmp_path / "other.safetensors"
    from safetensors.torch import save_file
    save_file({k: torch.zeros(8) for k in ("master", "exp_avg", "exp_avg_sq")}, other)
    for damage, message in ((lambda: layer.write_bytes(whole[: len(whole) // 2]), r"layer.1.safetensors is not a readable safetensors"),
                            (lambda: layer.unlink(), r"layer.1.safetensors is missing: the saved state is incomplete"),
                            (lambda: shutil.copy(other, layer), r"where this model's layer.1 holds .* a state of another model"),
                            (lambda: (state / "state.json").write_text("{"), r"state.json is not readable JSON"),
                            (lambda: (state / "state.json").write_text("{}"), r"state.json lacks \['step'")):
        meta = (state / "state.json").read_text()
        damage()
        with pytest.raises(ValueError, match=message):
            Trainer(config(tmp_path, 2, output_dir=str(tmp_path / "r"), resume=True))
        layer.write_bytes(whole)
        (state / "state.json").write_text(meta)


def test_ctrl_c_says_which_saved_step_a_resume_continues_from(tmp_path, capsys, monkeypatch):
    """Interrupted in its fourth step, saving every two: exit 130, no traceback, the message names
    the state's step, and that state is complete (what resume reads); interrupted while the trainer
    is built, nothing is written."""
    from megatrain.cli import main
    train_step, calls = Trainer.train_step, []

    def interrupted_fourth(self, microbatches):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return train_step(self, microbatches)
    monkeypatch.setattr(Trainer, "train_step", interrupted_fourth)
    out = tmp_path / "run"
    args = ["train", "--no-progress", "--no-json", "model.preset=tiny-qwen2", "engine.device=cpu", "data.seq_len=16",
            "steps=10", "save_every=2", f"output_dir={out}"]
    assert main(args) == 130
    err = capsys.readouterr().err
    assert f"interrupted after step 3 of 10; {out}/state holds step 2: resume=true continues from it" in err
    assert "Traceback" not in err
    assert json.loads((out / "state" / "state.json").read_text())["step"] == 2
    # the step-2 save's model beside its state; none of step 3, cut short (tests/training/test_exports.py: one Ctrl-C)
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-2", "metrics.jsonl", "state"]
    # interrupted between a save's two renames: the last complete save is the `.old`, named and put back
    from megatrain.cli import saved_where
    from megatrain.io import _old
    os.replace(out / "state", _old(out / "state"))
    assert saved_where(str(out)) == f"{out}/state holds step 2: resume=true continues from it"
    assert (out / "state" / "state.json").is_file()

    def interrupted_build(self, *a, **kw):
        raise KeyboardInterrupt
    monkeypatch.setattr(Trainer, "__init__", interrupted_build)
    assert main([*args[:-1], f"output_dir={tmp_path / 'never'}"]) == 130
    assert "interrupted before training began; nothing was written" in capsys.readouterr().err
    assert not (tmp_path / "never").exists()


def test_atomic_file_replaces_whole_or_not_at_all(tmp_path):
    """A writer that fails half way leaves the previous file as it was and no temporary beside it."""
    from megatrain.io import atomic_file, write_text
    target = tmp_path / "table.csv"
    write_text(target, "old\n")
    with pytest.raises(RuntimeError):
        with atomic_file(target) as tmp:
            assert tmp.suffix == ".csv" and tmp.parent == tmp_path
            tmp.write_text("half")
            raise RuntimeError("killed")
    assert target.read_text() == "old\n" and sorted(p.name for p in tmp_path.iterdir()) == ["table.csv"]
    write_text(target, "new\n")
    assert target.read_text() == "new\n"

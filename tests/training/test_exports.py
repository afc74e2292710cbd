"""What a run keeps of its model: checkpoint-N every save_every steps and their limit, the best
model by an evaluation metric, early stopping, the model of the step a Ctrl-C came in; and the
trackers of report_to (their packages stood in for by fakes: no network, none installed here)."""
from __future__ import annotations

import importlib.machinery
import json
import os
import signal
import sys
import types

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers import store_params
from megatrain.cli import main
from megatrain.exports import META, rotate
from megatrain.trainer import Trainer
from test_run_outputs import config, setup


def exported(monkeypatch) -> dict:
    """Record the store's weights at each export, by folder name."""
    seen, export = {}, Trainer.export

    def recording(self, path, evaluation=None):
        seen[path.name] = {k: v.clone() for k, v in store_params(self).items()}  # views of the live store
        export(self, path, evaluation)
    monkeypatch.setattr(Trainer, "export", recording)
    return seen


def assert_loads_as(path, params):
    state = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    for name, value in params.items():
        torch.testing.assert_close(state[name], value, rtol=0, atol=0, msg=lambda m: f"{path.name} {name}: {m}")


def records(out, kind):
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["kind"] == kind]


def test_checkpoints_every_save_and_their_limit(tmp_path, monkeypatch):
    """Saves at steps 2, 4 and 6 of 8, two kept: checkpoint-4 and -6, each the store's weights at
    its step to the bit, loadable with from_pretrained, its step beside them; the final model too."""
    data = setup(tmp_path)
    seen = exported(monkeypatch)
    out = tmp_path / "out"
    trainer = Trainer(config(tmp_path, data, steps=8, output_dir=str(out), save_every=2, save_total_limit=2))
    try:
        trainer.fit(progress=False)
    finally:
        trainer.close()
    assert sorted(seen) == ["checkpoint-2", "checkpoint-4", "checkpoint-6", "model"]
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-4", "checkpoint-6", "metrics.jsonl", "model", "state"]
    for name, step in (("checkpoint-4", 4), ("checkpoint-6", 6), ("model", 8)):
        assert_loads_as(out / name, seen[name])
        assert json.loads((out / name / META).read_text()) == {"step": step, "eval": None}
        assert (out / name / "tokenizer_config.json").is_file()
    assert not torch.equal(seen["checkpoint-4"]["model.norm.weight"], seen["checkpoint-6"]["model.norm.weight"])


def test_rotation_removes_the_oldest_never_the_best_nor_the_newest(tmp_path):
    for step in (2, 4, 6, 8):
        (tmp_path / f"checkpoint-{step}").mkdir()
    (tmp_path / "checkpoint-x").mkdir()  # not a checkpoint's name: left alone
    assert [p.name for p in rotate(tmp_path, 2, keep=2)] == ["checkpoint-4", "checkpoint-6"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2", "checkpoint-8", "checkpoint-x"]
    assert rotate(tmp_path, 1, keep=2) == []  # the best and the newest: one more than the limit, as HF keeps
    assert [p.name for p in rotate(tmp_path, 1, keep=None)] == ["checkpoint-2"]
    assert rotate(tmp_path, None, keep=None) == [] and (tmp_path / "checkpoint-8").is_dir()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("metric", ["loss", "accuracy"])
def test_the_best_model_by_evaluation(tmp_path, monkeypatch, metric):
    """Evaluations every 2 steps of 8: output_dir/best holds the weights of the evaluation best by
    the metric (lower loss, higher accuracy), with that evaluation beside them; its checkpoint is
    never rotated out; a resumed run goes on from the saved best."""
    data = setup(tmp_path)
    seen = exported(monkeypatch)
    out = tmp_path / "out"
    settings = dict(output_dir=str(out), eval_every=2, save_every=2, save_total_limit=1, metric_for_best_model=metric,
                    optim={"lr": 3e-2}, data={"eval_fraction": 0.25})
    trainer = Trainer(config(tmp_path, data, steps=8, **settings))
    try:
        trainer.fit(progress=False)
    finally:
        trainer.close()
    evals = records(out, "eval")
    assert [e["step"] for e in evals] == [2, 4, 6, 8] and all(0 <= e["eval_accuracy"] <= 1 for e in evals)
    pick = max if metric == "accuracy" else min
    best = pick(evals, key=lambda e: (e[f"eval_{metric}"], -e["step"]) if metric == "accuracy" else
                (e[f"eval_{metric}"], e["step"]))  # the first of equals: a later one must improve on it
    saved = json.loads((out / "best" / META).read_text())
    assert saved["step"] == best["step"] and saved["eval"] == {k: v for k, v in best.items() if k != "kind"}
    assert_loads_as(out / "best", seen["best"])
    kept = sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-"))
    assert kept == sorted({f"checkpoint-{best['step']}", "checkpoint-6"} - {"checkpoint-8"})
    state = json.loads((out / "state" / "state.json").read_text())["best"]
    assert (state["step"], state["value"]) == (best["step"], best[f"eval_{metric}"])


def test_early_stopping_ends_the_run_as_its_last_step(tmp_path):
    """Patience 2 with a threshold no evaluation can beat: the first evaluation sets the best, the
    next two do not improve on it by more, and the run ends after the third (step 6 of 20), its state
    and model saved as at a last step."""
    data = setup(tmp_path)
    out = tmp_path / "out"
    trainer = Trainer(config(tmp_path, data, steps=20, output_dir=str(out), eval_every=2, metric_for_best_model="loss",
                             early_stopping_patience=2, early_stopping_threshold=100.0, data={"eval_fraction": 0.25}))
    try:
        history = trainer.fit(progress=False)
    finally:
        trainer.close()
    assert [m["step"] for m in history] == list(range(1, 7))
    assert [e["step"] for e in records(out, "eval")] == [2, 4, 6]
    assert json.loads((out / "state" / "state.json").read_text())["step"] == 6
    assert json.loads((out / "model" / META).read_text())["step"] == 6
    assert json.loads((out / "best" / META).read_text())["step"] in (2, 4, 6)


def run_args(tmp_path, data, out, *extra):
    return ["train", "--no-progress", "--no-json", f"model.pretrained={tmp_path / 'init'}", "engine.device=cpu",
            "engine.checkpoint_every=2", "data.source=file", f"data.path={data}", "data.format=chat",
            "data.seq_len=128", "data.batch_size=2", "optim.warmup_steps=0", "steps=10", f"output_dir={out}", *extra]


@pytest.mark.parametrize("presses", [1, 2])
def test_ctrl_c_exports_the_model_of_the_step_it_came_in(tmp_path, capsys, monkeypatch, presses):
    """Ctrl-C (SIGINT) in the third step: that step completes and its model is exported atomically,
    the store's weights to the bit, exit 130 naming it; pressed twice, the run stops at once (the
    step cut short: no model of any step to export) and nothing but the last save is left."""
    data = setup(tmp_path)
    seen = exported(monkeypatch)
    train_step, calls = Trainer.train_step, []

    def pressed_in_third(self, microbatches):
        calls.append(1)
        if len(calls) == 3:
            for _ in range(presses):
                os.kill(os.getpid(), signal.SIGINT)
        return train_step(self, microbatches)
    monkeypatch.setattr(Trainer, "train_step", pressed_in_third)
    out = tmp_path / "out"
    handler = signal.getsignal(signal.SIGINT)
    assert main(run_args(tmp_path, data, out, "save_every=2")) == 130
    assert signal.getsignal(signal.SIGINT) is handler  # the run's own handler is gone with it
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert json.loads((out / "state" / "state.json").read_text())["step"] == 2
    if presses == 1:
        assert (f"interrupted after step 3 of 10; {out}/state holds step 2: resume=true continues from it; "
                f"the model of step 3 is in {out}/model") in err
        assert json.loads((out / "model" / META).read_text()) == {"step": 3, "eval": None}
        assert_loads_as(out / "model", seen["model"])
    else:
        assert f"interrupted after step 2 of 10; {out}/state holds step 2: resume=true continues from it\n" in err
        assert not (out / "model").exists()
    assert sorted(p.name for p in out.iterdir()) == sorted(["checkpoint-2", "metrics.jsonl", "state"] + ["model"] * (presses == 1))


def fake_module(name: str, **attributes) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)  # what find_spec reads of a module imported
    module.__dict__.update(attributes)
    return module


def test_trackers_get_every_step_and_evaluation(tmp_path, monkeypatch):
    """report_to: [tensorboard, wandb, mlflow], each package a fake recording the calls the run
    makes through the package's API: the run's settings, every step's scalars and evaluations,
    closed at the end."""
    calls = []

    class Writer:
        def __init__(self, logdir):
            calls.append(("tensorboard.init", logdir))

        def add_scalar(self, key, value, step):
            calls.append(("tensorboard", key, step))

        def close(self):
            calls.append(("tensorboard.close",))

    class Run:
        def log(self, scalars, step):
            calls.append(("wandb", tuple(sorted(scalars)), step))

        def finish(self):
            calls.append(("wandb.finish",))

    def wandb_init(project, dir, config):
        calls.append(("wandb.init", project, dir, config["steps"]))
        return Run()
    monkeypatch.setitem(sys.modules, "tensorboard", fake_module("tensorboard"))
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", fake_module("torch.utils.tensorboard", SummaryWriter=Writer))
    monkeypatch.setitem(sys.modules, "wandb", fake_module("wandb", init=wandb_init))
    monkeypatch.setitem(sys.modules, "mlflow", fake_module(
        "mlflow", start_run=lambda: calls.append(("mlflow.start_run",)),
        log_params=lambda params: calls.append(("mlflow.params", params["optim.lr"], params["data.format"])),
        log_metrics=lambda scalars, step: calls.append(("mlflow", tuple(sorted(scalars)), step)),
        end_run=lambda: calls.append(("mlflow.end_run",))))
    monkeypatch.setenv("WANDB_PROJECT", "p")
    data = setup(tmp_path)
    out = tmp_path / "out"
    trainer = Trainer(config(tmp_path, data, steps=2, output_dir=str(out), eval_every=2,
                             report_to=["tensorboard", "wandb", "mlflow"], data={"eval_fraction": 0.25}))
    try:
        trainer.fit(progress=False)
    finally:
        trainer.close()
    train = ("train/grad_norm", "train/loss", "train/lr", "train/model_tflops", "train/tokens_per_s")
    evaluation = ("eval/accuracy", "eval/loss", "eval/perplexity")
    assert [c for c in calls if c[0].startswith("wandb")] == [
        ("wandb.init", "p", str(out), 2), ("wandb", train, 1), ("wandb", train, 2), ("wandb", evaluation, 2),
        ("wandb.finish",)]
    assert [c for c in calls if c[0].startswith("mlflow")] == [
        ("mlflow.start_run",), ("mlflow.params", "0.001", "chat"), ("mlflow", train, 1), ("mlflow", train, 2),
        ("mlflow", evaluation, 2), ("mlflow.end_run",)]
    board = [c for c in calls if c[0].startswith("tensorboard")]
    assert board[0] == ("tensorboard.init", str(out / "tensorboard")) and board[-1] == ("tensorboard.close",)
    assert sorted(c[1:] for c in board[1:-1]) == sorted([(k, s) for s in (1, 2) for k in train]
                                                        + [(k, 2) for k in evaluation])


@pytest.mark.parametrize("settings, message", [
    (["save_total_limit=2"], "save_total_limit limits the checkpoint-N folders that save_every writes: set save_every"),
    (["metric_for_best_model=loss", "data.eval_fraction=null"],
     "metric_for_best_model needs held-out data: data.eval_path, data.eval_fraction or data.eval_split"),
    (["metric_for_best_model=loss", "early_stopping_patience=2"],
     "early_stopping_patience counts evaluations (eval_every) that do not improve metric_for_best_model: set both"),
    (["metric_for_best_model=bleu"], "metric_for_best_model must be 'loss' or 'perplexity' or 'accuracy' or null"),
    (["report_to=[wandb, wandb]"], "report_to names a tracker twice"),
])
def test_export_and_evaluation_settings_that_cannot_work_are_refused(tmp_path, capsys, settings, message):
    data = setup(tmp_path)
    out = tmp_path / "out"
    assert main(run_args(tmp_path, data, out, "data.eval_fraction=0.25", *settings)) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_a_resumed_run_goes_on_from_the_saved_best(tmp_path):
    """The best evaluation and early stopping's count travel in the saved state: a resumed run
    (extended from 4 steps to 6) judges its evaluations against the best before it."""
    data = setup(tmp_path)
    out = tmp_path / "out"

    def run(steps, **extra):
        return Trainer(config(tmp_path, data, steps=steps, output_dir=str(out), eval_every=2, metric_for_best_model="loss",
                              early_stopping_patience=5, data={"eval_fraction": 0.25}, **extra))
    trainer = run(4)
    try:
        trainer.fit(progress=False)
        before = trainer.best.state()
    finally:
        trainer.close()
    assert before["step"] in (2, 4) and before["value"] is not None
    resumed = run(6, resume=True, resume_changes=True)
    try:
        assert resumed.best.state() == before
    finally:
        resumed.close()

"""A fine-tuning run as a user sees it: chat data with a held-out split, packing equal to unpacked
training, metrics.jsonl with this step's gradient norm, evaluation equal to a plain forward, a
resumed run with its evaluation, `megatrain plan` and `train --help`, and a saved model that loads
with its tokenizer and generates; a closed trainer, once dropped, is freed."""
from __future__ import annotations

import contextlib
import gc
import json
import math
import warnings
import weakref

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from helpers import store_params, tiny_checkpoint
from megatrain.cli import main
from megatrain.config import load_config
from megatrain.data.source import collate
from megatrain.shapes import ModelShape
from megatrain.trainer import Trainer
from tiny_tokenizer import byte_tokenizer

pytest.importorskip("datasets")

QUESTIONS = ["What is the capital of France?", "And of Italy?", "Name a prime.", "Two plus two?", "Say hi."]
ANSWERS = ["Paris.", "Rome.", "Seven.", "Four.", "Hi!"]


def chat_rows(n: int) -> list[dict]:
    out = []
    for k in range(n):
        q, a = QUESTIONS[k % 5], ANSWERS[k % 5]
        turns = [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        if k % 3 == 0:
            turns += [{"role": "user", "content": QUESTIONS[(k + 1) % 5]},
                      {"role": "assistant", "content": ANSWERS[(k + 1) % 5]}]
        out.append({"messages": turns})
    return out


def setup(tmp_path, preset="tiny-qwen2", rows=24):
    """A tiny checkpoint with a Qwen2.5-templated byte tokenizer beside it, and a chat JSONL."""
    tiny_checkpoint(tmp_path / "init", preset, {"vocab_size": 300, "max_position_embeddings": 512})
    byte_tokenizer("qwen2.5").save_pretrained(tmp_path / "init")
    data = tmp_path / "chat.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in chat_rows(rows)) + "\n")
    return data


def config(tmp_path, path, data=None, **extra):
    base = {"model": {"pretrained": str(tmp_path / "init")}, "engine": {"device": "cpu", "checkpoint_every": 2},
            "optim": {"lr": 1e-3, "warmup_steps": 0},
            "data": {"source": "file", "path": str(path), "format": "chat", "seq_len": 128, "batch_size": 2,
                     "grad_accum": 2, **(data or {})}}
    return load_config(base={**base, **extra})


@pytest.mark.parametrize("preset", ["tiny-qwen2", "tiny-gpt-oss"])
def test_fit_writes_metrics_evaluates_and_saves_a_usable_model(tmp_path, preset):
    data = setup(tmp_path, preset)
    out = tmp_path / "out"
    trainer = Trainer(config(tmp_path, data, steps=4, output_dir=str(out), eval_every=2, save_dtype="bfloat16",
                             data={"eval_fraction": 0.25}))
    try:
        # the examples the run keeps in host memory are in the plan it was admitted with
        assert trainer.memory_plan.detail["data"] == trainer.data.nbytes + trainer.held_out.nbytes > 0
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the save raises no deprecation warning
            history = trainer.fit(progress=False)
        norms, busy = dict(trainer.optimizer.grad_norms), dict(trainer.optimizer.busy)
    finally:
        trainer.close()
    store = weakref.ref(trainer.store)
    del trainer
    gc.collect()
    assert store() is None, "a closed trainer, once dropped, keeps its host store alive"
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [m for m in lines if m["kind"] == "train"]
    evals = [m for m in lines if m["kind"] == "eval"]
    assert [m["step"] for m in train] == [1, 2, 3, 4] and [m["step"] for m in evals] == [2, 4]
    for m in train:  # each line holds its own step's gradient norm and its update's time on the host
        assert m["grad_norm"] == norms[m["step"] - 1] and m["grad_norm"] > 0
        assert m["optimizer_busy_s"] == busy[m["step"] - 1] > 0
        for key in ("loss", "lr", "tokens", "target_tokens", "tokens_per_s", "model_tflops", "step_time_s",
                    "peak_host_bytes"):
            assert m[key] is not None, key
    assert train[0]["lr"] == pytest.approx(1e-3) and train[-1]["lr"] < train[1]["lr"]  # the full rate, then the cosine
    assert [m["grad_norm"] for m in history] == [m["grad_norm"] for m in train]
    for m in evals:
        assert m["eval_perplexity"] == pytest.approx(math.exp(m["eval_loss"])) and m["eval_target_tokens"] > 0
    model = AutoModelForCausalLM.from_pretrained(out / "model")
    assert model.dtype == torch.bfloat16
    tok = AutoTokenizer.from_pretrained(out / "model")
    prompt = tok.apply_chat_template([{"role": "user", "content": "Say hi."}], add_generation_prompt=True,
                                     return_tensors="pt", return_dict=True)
    generated = model.generate(**prompt, max_new_tokens=4, do_sample=False)
    assert generated.shape[1] == prompt["input_ids"].shape[1] + 4 or tok.eos_token_id in generated[0].tolist()
    assert (out / "model" / "generation_config.json").is_file()


@pytest.mark.parametrize("preset", ["tiny-qwen2", "tiny-gemma2", "tiny-gpt-oss", "tiny-qwen3-moe"])
def test_evaluation_equals_a_plain_forward(tmp_path, preset):
    """The held-out loss is the library's cross-entropy (a mixture of experts' without its router term;
    Gemma 2's of its soft-capped logits), the token accuracy the share of targets that are its logits'
    argmax. The library's model runs eager attention, which applies Gemma 2's attention soft-capping
    (its SDPA path drops it)."""
    data = setup(tmp_path, preset)
    # trained a little first, so that some targets are the argmax (none are at the random start)
    trainer = Trainer(config(tmp_path, data, steps=4, optim={"lr": 1e-2}, data={"eval_fraction": 0.5, "batch_size": 3}))
    try:
        for _ in range(4):
            trainer.train_step(trainer.next_microbatches())
        result = trainer.evaluate()
        batches = list(trainer.held_out.batches())
        trainer.save_pretrained(tmp_path / "trained")
    finally:
        trainer.close()
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "trained", dtype=torch.float32, attn_implementation="eager")
    total = n = hits = 0
    with torch.no_grad():
        for b in batches:
            logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits
            total += torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                       b.labels[:, 1:].reshape(-1), reduction="sum").item()
            n += int((b.labels[:, 1:] != -100).sum())
            hits += int((logits[:, :-1].argmax(-1) == b.labels[:, 1:]).sum())
    assert result["eval_target_tokens"] == n
    # the same argmax: float32 logits that differ by summation order alone, no near-tie among them
    assert result["eval_accuracy"] == hits / n and 0 < hits < n
    # float32 on both sides; the engine's head sums in chunks, the reference at once
    assert result["eval_loss"] == pytest.approx(total / n, rel=1e-5)


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-mistral", "tiny-phi3", "tiny-gemma3", "tiny-qwen3-moe",
                                    "tiny-gpt-oss"])
def test_packing_equals_unpacked_training(tmp_path, preset):
    """The same examples, packed into rows with restarting positions, or one padded row each:
    the same losses and weights (Mistral's sliding window, Phi-3's partial rotary and Gemma 3's
    sliding and full layers with their two rotary bases included; and a mixture of experts'
    router loss, which leaves the packed rows' padding out as the padded rows' mask does: with
    the padding counted, GPT-OSS's weights came out up to 1.5 lr apart after two steps)."""
    data = setup(tmp_path, preset)
    runs = {}
    for packed in (True, False):
        trainer = Trainer(config(tmp_path, data, steps=2, data={"packing": packed, "batch_size": 8}))
        try:
            ex = trainer.data.examples
            groups = [np.arange(0, 6), np.arange(6, 12)]  # two steps of six examples
            losses = []
            for g in groups:
                if packed:  # two rows of three examples (each under 128 tokens)
                    mbs = [collate(ex, [g[:3], g[3:]], trainer.data.pad_id, True)]
                else:
                    mbs = [collate(ex, [g[k: k + 1] for k in range(6)], trainer.data.pad_id, False)]
                losses.append(trainer.train_step(mbs)["loss"])
            runs[packed] = losses, store_params(trainer)
        finally:
            trainer.close()
    # float32 on the CPU: the rows' summation order differs, so the losses agree to rounding; Adam
    # divides by each gradient's own magnitude, so an element whose gradient is at rounding level
    # can move by a fraction of lr (1e-3) either way: the weights agree to 1% of lr
    torch.testing.assert_close(torch.tensor(runs[True][0]), torch.tensor(runs[False][0]), rtol=1e-5, atol=1e-6)
    for name, value in runs[False][1].items():
        torch.testing.assert_close(runs[True][1][name], value, rtol=0, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_resume_with_an_evaluation_split(tmp_path):
    data = setup(tmp_path)
    split = {"eval_fraction": 0.25}

    def run(steps, out, resume=False):
        # extended from 2 steps: at a constant rate its first two are the 4-step run's
        trainer = Trainer(config(tmp_path, data, steps=steps, output_dir=str(tmp_path / out), eval_every=2,
                                 resume=resume, resume_changes=resume, data=split,
                                 optim={"lr": 1e-3, "schedule": "constant"}))
        try:
            trainer.fit(progress=False)
            return store_params(trainer)
        finally:
            trainer.close()

    expected = run(4, "a")
    run(2, "b")
    with open(tmp_path / "b" / "metrics.jsonl", "a") as f:  # a step logged after the last save, then a crash
        f.write(json.dumps({"kind": "train", "step": 3, "loss": 0.0}) + "\n")
    got = run(4, "b", resume=True)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
    evals = {d: [json.loads(x) for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines()] for d in "ab"}
    last = {d: [m for m in evals[d] if m["kind"] == "eval"][-1] for d in "ab"}
    assert last["a"]["step"] == last["b"]["step"] == 4 and last["a"]["eval_loss"] == last["b"]["eval_loss"]
    steps_b = [m["step"] for m in evals["b"] if m["kind"] == "train"]
    assert steps_b == [1, 2, 3, 4]  # the resumed run replaces the records of the steps it redoes


def test_epochs_set_the_steps(tmp_path):
    data = setup(tmp_path, rows=20)
    trainer = Trainer(config(tmp_path, data, epochs=2.0))
    try:
        assert trainer.total_steps == 10  # 2 x 20 examples / (2 x 2) per step
    finally:
        trainer.close()
    with pytest.raises(ValueError, match="steps or epochs, not both"):
        config(tmp_path, data, epochs=1.0, steps=3)


def test_plan_and_help(tmp_path, capsys):
    data = setup(tmp_path)
    path = tmp_path / "run.yaml"
    path.write_text(json.dumps({"model": {"pretrained": str(tmp_path / "init")}, "engine": {"device": "cpu"},
                                "data": {"source": "file", "path": str(data), "format": "chat", "seq_len": 128},
                                "output_dir": str(tmp_path / "out")}))
    assert main(["plan", "--config", str(path)]) == 0
    report = capsys.readouterr().out
    for part in (" parameters, 3 layers", "24 examples", "memory plan: host", "data 0.00", "fits this machine", "metrics.jsonl"):
        assert part in report, part
    assert not (tmp_path / "out").exists()  # nothing trained or written
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = capsys.readouterr().out
    from megatrain.config import DataConfig, EngineConfig, OptimConfig, TrainConfig
    import dataclasses
    for section, cls in (("", TrainConfig), ("engine.", EngineConfig), ("optim.", OptimConfig), ("data.", DataConfig)):
        for f in dataclasses.fields(cls):
            if not dataclasses.is_dataclass(f.type) and f.name not in ("model", "engine", "optim", "data"):
                assert f"  {section}{f.name}: " in text, f.name


def test_tensorboard_events(tmp_path):
    pytest.importorskip("tensorboard")
    data = setup(tmp_path)
    trainer = Trainer(config(tmp_path, data, steps=2, output_dir=str(tmp_path / "out"), report_to=["tensorboard"],
                             data={"eval_fraction": 0.25}))
    try:
        trainer.fit(progress=False)
    finally:
        trainer.close()
    assert list((tmp_path / "out" / "tensorboard").glob("events.out.tfevents.*"))


def test_console_and_json_lines(tmp_path, capsys):
    """The console (stderr) has the start-up summary and summary lines; stdout has one JSON line
    a step on request (and when redirected), none with --no-json."""
    data = setup(tmp_path)
    path = tmp_path / "run.yaml"
    path.write_text(json.dumps({"model": {"pretrained": str(tmp_path / "init")}, "engine": {"device": "cpu"},
                                "data": {"source": "file", "path": str(data), "format": "chat", "seq_len": 128},
                                "steps": 4, "log_every": 2}))
    assert main(["train", "--config", str(path), "--no-progress", "--json"]) == 0
    captured = capsys.readouterr()
    lines = [json.loads(line) for line in captured.out.splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3, 4] and all(m["grad_norm"] > 0 for m in lines)
    assert "memory plan: host" in captured.err and "step 2: loss" in captured.err and "step 4: loss" in captured.err
    assert main(["train", "--config", str(path), "--no-progress", "--no-json"]) == 0
    assert capsys.readouterr().out == ""


def test_progress_bars_for_loading_and_saving(tmp_path, capsys, monkeypatch):
    """The long work outside the steps shows a bar on stderr, advanced to every parameter of the
    model: loading the weights, saving the state and the model, loading the state on resume; none
    with --no-progress (the training bar is the runlog's own)."""
    import megatrain.progress
    import megatrain.trainer
    bars = []

    @contextlib.contextmanager
    def counted(description, total, enabled):
        done = [0]
        with megatrain.progress.bar(description, total, enabled) as advance:
            def count(n):
                done[0] += n
                advance(n)
            yield count
        bars.append((description.split(" to ")[0], total, done[0], enabled))
    monkeypatch.setattr(megatrain.trainer, "bar", counted)
    data = setup(tmp_path)
    path = tmp_path / "run.yaml"
    run = {"model": {"pretrained": str(tmp_path / "init")}, "engine": {"device": "cpu"}, "steps": 2,
           "data": {"source": "file", "path": str(data), "format": "chat", "seq_len": 128},
           "output_dir": str(tmp_path / "out")}
    path.write_text(json.dumps(run))
    assert main(["train", "--config", str(path), "--no-json"]) == 0
    path.write_text(json.dumps({**run, "steps": 3, "resume": True, "resume_changes": True}))
    assert main(["train", "--config", str(path), "--no-json"]) == 0
    err = capsys.readouterr().err
    total = ModelShape(AutoConfig.from_pretrained(tmp_path / "init")).total_params()
    expected = ["loading the weights", "saving the training state", "saving the model",
                "loading the weights", "loading the training state", "saving the training state", "saving the model"]
    assert [b[0] for b in bars] == expected
    assert all(b[1:] == (total, total, True) for b in bars), bars  # every parameter, each bar drawn
    for what in set(expected):
        assert what in err
    bars.clear()
    assert main(["train", "--config", str(path), "--no-json", "--no-progress", "steps=4"]) == 0
    err = capsys.readouterr().err
    assert "loading the" not in err and "saving the" not in err and not any(b[3] for b in bars)

"""One planner (planning.plan_run) for `megatrain plan` and `megatrain train`: the same checks, the
same refusal word for word, the same plan; `plan`'s exit status says whether `train` would run."""
from __future__ import annotations

import pytest

import megatrain.trainer
from megatrain import memory, planning
from megatrain.cli import REFUSED, main
from megatrain.config import load_config
from tiny_tokenizer import byte_tokenizer

TINY = ["model.preset=tiny-qwen2", "engine.device=cpu", "data.seq_len=16", "data.batch_size=2", "steps=1"]


def plan_and_train(capsys, args: list[str]) -> tuple[int, str, str, int, str]:
    """`megatrain plan ARGS` and `megatrain train ARGS`: plan's status, report and error, train's status and error."""
    plan_code = main(["plan", *args])
    plan_out, plan_err = capsys.readouterr()
    train_code = main(["train", "--no-progress", "--no-json", *args])
    return plan_code, plan_out, plan_err, train_code, capsys.readouterr().err


@pytest.mark.parametrize("case, args, env, message", [
    ("sequence-too-long", ["data.seq_len=512"], {}, "data.seq_len 512 exceeds the model's max_position_embeddings 256"),
    ("output-dir-occupied", ["output_dir={out}"], {}, "output_dir {out} holds an earlier run's metrics.jsonl: "
                                                      "resume=true continues that run"),
    ("mlp-chunk-of-experts", ["model.preset=tiny-qwen3-moe", "engine.mlp_chunk_tokens=8"], {},
     "engine.mlp_chunk_tokens chunks the bias-free SiLU-gated MLP; this qwen3_moe model's is not"),
    # SiLU-gated, but its post-feedforward norm reads the MLP's output, which a chunked recompute leaves out
    ("mlp-chunk-of-gemma", ["model.preset=tiny-gemma2", "model.overrides.hidden_activation=silu",
                            "engine.mlp_chunk_tokens=8"], {},
     "engine.mlp_chunk_tokens chunks the bias-free SiLU-gated MLP; this gemma2 model's is not, or its output is read"),
    ("host-stated-in-config", ["engine.host_memory_gb=1"], {}, "the run does not fit: host memory: needs"),
    ("host-stated-in-environment", [], {"MEGATRAIN_HOST_MEMORY_GB": "1"}, "the run does not fit: host memory: needs"),
])
def test_plan_refuses_what_train_refuses_with_the_same_message(tmp_path, capsys, monkeypatch, case, args, env, message):
    """Each refused by both before anything is allocated, exit 2, the same error line; nothing written."""
    out = tmp_path / "out"
    if case == "output-dir-occupied":
        out.mkdir()
        (out / "metrics.jsonl").write_text("{}\n")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(megatrain.trainer, "HostStore", None)  # allocating the store would fail
    plan_code, report, plan_err, train_code, train_err = plan_and_train(
        capsys, [*TINY, *(a.format(out=out) for a in args)])
    assert plan_code == train_code == REFUSED == 2
    assert plan_err == train_err and plan_err.startswith(f"megatrain: error: {message.format(out=out)}")
    assert "Traceback" not in plan_err and "fits" not in report
    if "does not fit" in message:  # the plan is made, and shown, up to its verdict
        assert "memory plan: host" in report and "1.0 GiB available" in plan_err
    else:  # refused before any plan
        assert report == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == (["out"] if case == "output-dir-occupied" else [])


def test_a_run_that_fits_is_planned_as_it_trains(tmp_path, capsys):
    """`plan` exits 0 saying it fits; `train` starts with the same report and trains."""
    out = tmp_path / "out"
    plan_code, report, plan_err, train_code, train_err = plan_and_train(capsys, [*TINY, f"output_dir={out}"])
    assert (plan_code, plan_err, train_code) == (0, "", 0)
    body, verdict = report.rstrip().rsplit("\n", 1)
    assert verdict == "fits this machine" and body in train_err
    assert (out / "model").is_dir()


def test_the_trainer_builds_from_the_plan_without_deciding_again(monkeypatch):
    """Once planned, nothing is resolved or admitted again: the trainer takes the plan's settings,
    memory plan and data as they are."""
    plan = planning.plan_run(load_config(None, TINY))
    for where, name in ((planning, "resolve"), (planning, "make_sources"), (memory, "plan"), (memory, "admit")):
        monkeypatch.setattr(where, name, lambda *a, **k: pytest.fail("decided again"))
    trainer = megatrain.trainer.Trainer(plan)
    try:
        assert trainer.settings is plan.settings and trainer.memory_plan is plan.memory_plan
        assert trainer.data is plan.data and trainer.total_steps == plan.total_steps == 1
        assert trainer.describe() == plan.describe()
    finally:
        trainer.close()


def test_a_run_that_cannot_fit_reads_no_data(tmp_path, monkeypatch, capsys):
    """The model alone is admitted before the data is read; the report says the data was not read."""
    monkeypatch.setattr(planning, "make_sources", lambda *a, **k: pytest.fail("the data was read"))
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "never tokenised"}\n')
    args = ["model.preset=tiny-qwen2", "engine.device=cpu", "engine.host_memory_gb=1", f"data.path={data}", "data.seq_len=16",
            "data.format=text"]
    assert main(["plan", *args]) == 2
    out, err = capsys.readouterr()
    assert f"data: {data} (text), not read: the run does not fit without it" in out
    assert "does not fit: host memory" in err
    run = planning.plan_run(load_config(None, args))
    assert run.data is None and run.total_steps == 10 and run.refusal is not None
    with pytest.raises(memory.DoesNotFit, match="host memory"):
        run.check()


def test_plan_exit_status(capsys):
    """0: the run fits; 2: train would refuse it (a setting, or the memory plan) or the command line is wrong."""
    assert main(["plan", *TINY]) == 0
    assert main(["plan", *TINY, "engine.split_masters=true"]) == 2  # a setting resolve refuses
    assert main(["plan", *TINY, "engine.host_memory_gb=1"]) == 2
    with pytest.raises(SystemExit) as stop:
        main(["plan", "--bogus"])
    assert stop.value.code == 2
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    assert "exit 2, with train's message, where train would refuse the run" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("steps, warmup, warned", [(1, 1, True), (3, 5, True), (2, 1, False), (1, 0, False)])
def test_plan_says_when_the_run_ends_inside_its_warmup(capsys, steps, warmup, warned):
    """A run no longer than its warm-up never trains at optim.lr (one step of a warm-up: at lr 0): the
    plan's step line says so, and the run is still planned."""
    args = [a for a in TINY if not a.startswith("steps=")]
    assert main(["plan", *args, f"steps={steps}", f"optim.warmup_steps={warmup}"]) == 0
    report = capsys.readouterr().out
    assert (f"optim.warmup_steps {warmup} is not shorter than the run's {steps} steps" in report) == warned


@pytest.mark.parametrize("settings, said", [(["data.packing=true"], True), (["data.batch_size=1"], False),
                                            (["data.pad_to_multiple_of=null"], False)])
def test_plan_names_the_padded_widths(tmp_path, capsys, settings, said):
    """The step line says the widths padded batches take (collate's rule: packed rows or several rows
    a batch), where data.pad_to_multiple_of rounds them."""
    byte_tokenizer("qwen2.5").save_pretrained(tmp_path / "tok")
    args = [*TINY, "data.seq_len=256", "model.overrides.vocab_size=512", "data.path=data/demo-chat.jsonl", "data.format=chat",
            f"data.tokenizer={tmp_path / 'tok'}", *settings]
    assert main(["plan", *args]) == 0
    assert ("(padded widths: multiples of 64)" in capsys.readouterr().out) == said

"""Bad input fails early with a clear error that names the setting, and writes nothing."""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import tiny_checkpoint
from megatrain.cli import main
from megatrain.config import load_config
from megatrain.trainer import Trainer
from tiny_tokenizer import save_tokenizer

ROOT = Path(__file__).resolve().parents[2]


def run_cli(tmp_path, capsys, text: str, *overrides: str) -> str:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    assert main(["train", "--config", str(path), "--no-progress", *overrides]) == 2
    err = capsys.readouterr().err
    assert err.startswith("megatrain: error:")
    return err


def test_malformed_yaml(tmp_path, capsys):
    assert "not valid YAML" in run_cli(tmp_path, capsys, "model: [preset: tiny-qwen2\n")


def test_a_key_given_twice_is_named(tmp_path, capsys):
    """PyYAML keeps the last of a repeated key: the first `data:` section's seq_len would be lost."""
    err = run_cli(tmp_path, capsys, "model:\n  preset: tiny-qwen2\ndata:\n  seq_len: 32\nsteps: 2\ndata:\n  batch_size: 2\n")
    assert "the key 'data' is given twice in one mapping" in err and "line 6" in err


@pytest.mark.parametrize("override, message", [("steps=[1", "its value is not valid YAML"),
                                               ("model.overrides={a: 1, a: 2}", "the key 'a' is given twice")])
def test_an_override_that_is_not_yaml_is_named(tmp_path, capsys, override, message):
    err = run_cli(tmp_path, capsys, "model:\n  preset: tiny-qwen2\n", override)
    assert f"override {override!r}: " in err and message in err


def test_unknown_keys_are_named(tmp_path, capsys):
    err = run_cli(tmp_path, capsys, "model:\n  preset: tiny-qwen2\nengine:\n  chekpoint_every: 2\n")
    assert "engine" in err and "chekpoint_every" in err
    err = run_cli(tmp_path, capsys, "model:\n  preset: tiny-qwen2\n", "optim.learning_rate=1")
    assert "learning_rate" in err


def test_bad_values_are_named():
    with pytest.raises(ValueError, match="engine.checkpoint_every"):
        load_config(base={"model": {"preset": "tiny-qwen2"}, "engine": {"checkpoint_every": 0}})
    with pytest.raises(ValueError, match="exactly one of"):
        load_config(base={"model": {"preset": "tiny-qwen2", "config": "x.json"}})
    with pytest.raises(ValueError, match="unknown model preset"):
        Trainer(load_config(base={"model": {"preset": "qwen9-1t"}}))


@pytest.mark.parametrize("section, key, value, message", [
    ("optim", "weight_decay", -0.1, "optim.weight_decay must be at least 0, not -0.1"),
    ("optim", "eps", -1e-8, "optim.eps must be at least 0"),
    ("engine", "optimizer_threads", 0, "engine.optimizer_threads must be at least 1, or null, not 0"),
    ("optim", "warmup_steps", -1, "optim.warmup_steps must be at least 0, not -1"),
    ("optim", "min_lr_ratio", 2, "optim.min_lr_ratio must be in [0, 1], not 2"),
    ("engine", "device", "tpu", "engine.device must be auto, cpu, cuda or cuda:N, not 'tpu'"),
    ("data", "seq_len", 1, "data.seq_len must be at least 2, not 1"),
])
def test_numbers_out_of_their_range_are_named(section, key, value, message):
    """Each by its own name and value: let through, torch refuses some at the first step (a device
    it does not know), reads 0 threads as the default, the schedule runs off its range, or a step
    has no token to predict (one token a sequence)."""
    with pytest.raises(ValueError, match=re.escape(message)):
        load_config(base={"model": {"preset": "tiny-qwen2"}, section: {key: value}})


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    with pytest.raises(ValueError, match="'gpt2' is not supported.*llama"):
        Trainer(load_config(base={"model": {"config": str(tmp_path)}}))


def test_what_a_family_cannot_train_exactly_is_refused_by_its_setting():
    """Dropout draws other numbers in the recompute than in the forward; the library's SDPA path
    drops Gemma 2's attention soft-capping; a bidirectional Gemma 3 is an embedding model."""
    from megatrain.config import ModelConfig
    from megatrain.shapes import ModelShape, load_hf_config
    with pytest.raises(ValueError, match=re.escape("resid_pdrop > 0 is not supported (set overrides.resid_pdrop: 0)")):
        ModelShape(load_hf_config(ModelConfig(preset="tiny-phi3", overrides={"resid_pdrop": 0.1})))
    with pytest.raises(ValueError, match="gemma2 has no SDPA attention.*attn_logit_softcapping"):
        load_hf_config(ModelConfig(preset="tiny-gemma2", attn_implementation="sdpa"))
    assert load_hf_config(ModelConfig(preset="tiny-gemma2", overrides={"attn_logit_softcapping": None}),
                          cuda=False)._attn_implementation == "sdpa"
    with pytest.raises(ValueError, match="overrides.use_bidirectional_attention: false"):
        load_hf_config(ModelConfig(preset="tiny-gemma3", overrides={"use_bidirectional_attention": True}))


def test_a_misspelt_model_override_is_named_with_the_field_it_was_meant_for(capsys):
    """transformers keeps any key of a config as an attribute: a misspelt override would change
    nothing (num_hiden_layers: 2 would train all 3 layers). Qwen2's head_dim, which its defaults lack but its
    attention reads, passes."""
    with pytest.raises(ValueError, match=r"model.overrides: \['num_hiden_layers'\] is no field of a qwen2 config "
                                         r"\(num_hiden_layers: did you mean num_hidden_layers\?\)"):
        Trainer(load_config(base={"model": {"preset": "tiny-qwen2", "overrides": {"num_hiden_layers": 2}}}))
    from megatrain.config import ModelConfig
    from megatrain.shapes import load_hf_config
    assert load_hf_config(ModelConfig(preset="tiny-qwen2", overrides={"head_dim": 32})).head_dim == 32


@pytest.mark.parametrize("preset, overrides, message", [
    ("tiny-qwen2", {"num_hidden_layers": 0}, "at least 1: num_hidden_layers 0"),
    ("tiny-qwen2", {"hidden_size": -4, "vocab_size": 0}, "at least 1: hidden_size -4, vocab_size 0"),
    ("tiny-qwen2", {"num_key_value_heads": 3}, "num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
    ("tiny-qwen2", {"hidden_size": 100}, "width 25 .* is odd"),
    ("tiny-llama", {"head_dim": 15}, "width 15 .* is odd"),
    ("tiny-qwen3-moe", {"num_experts_per_tok": 0}, "num_experts_per_tok 0 must be between 1 and the 4 experts"),
    ("tiny-gpt-oss", {"num_experts_per_tok": 5}, "num_experts_per_tok 5 must be between 1 and the 4 experts"),
], ids=["no-layers", "negative", "kv-groups", "odd-heads", "odd-head-dim", "no-experts-picked", "too-many-picked"])
def test_model_sizes_the_library_would_fail_on_are_named(capsys, preset, overrides, message):
    """Each of these let through, the library's construction or first forward fails with a traceback."""
    with pytest.raises(ValueError, match=f"^model: .*{message}"):
        Trainer(load_config(base={"model": {"preset": preset, "overrides": overrides}, "engine": {"device": "cpu"}}))


def test_sequence_longer_than_model_allows():
    with pytest.raises(ValueError, match="seq_len 512 exceeds the model's max_position_embeddings 256"):
        Trainer(load_config(base={"model": {"preset": "tiny-qwen2"}, "data": {"seq_len": 512},
                                  "engine": {"device": "cpu"}}))


def test_model_that_does_not_fit_writes_nothing(tmp_path, capsys):
    out = tmp_path / "out"
    err = run_cli(tmp_path, capsys, "model:\n  preset: qwen2.5-72b\nengine:\n  device: cpu\n",
                  f"output_dir={out}", "engine.host_memory_gb=64")
    assert "host memory: needs" in err and "GiB available" in err
    assert not out.exists()


def test_missing_dataset_columns(tmp_path):
    pytest.importorskip("datasets")
    tiny_checkpoint(tmp_path / "model", "tiny-qwen2")
    save_tokenizer(tmp_path / "model")
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"question": "what is two", "answer": "five"}) + "\n")
    cfg = load_config(base={"model": {"pretrained": str(tmp_path / "model")},
                            "data": {"source": "file", "path": str(data), "format": "instruction", "seq_len": 32},
                            "engine": {"device": "cpu"}, "output_dir": str(tmp_path / "out")})
    with pytest.raises(ValueError, match=r"lacks column\(s\) \['prompt', 'response'\].*question"):
        Trainer(cfg)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("settings, message", [({"save_dtype": "bfloat16"}, "save_dtype needs output_dir"),
                                               ({"save_every": 2, "report_to": ["tensorboard"]}, "save_every, report_to need output_dir")])
def test_a_save_setting_without_output_dir_is_named(settings, message):
    """Without output_dir nothing is saved, so a save setting would do nothing without a word."""
    with pytest.raises(ValueError, match=message):
        load_config(base={"model": {"preset": "tiny-qwen2"}, **settings})


@pytest.mark.parametrize("data, message", [
    ({"format": "chat", "template": "plain"}, "data.template applies to format instruction or alpaca, not chat"),
    ({"format": "chat", "separator": " => "}, "data.separator joins prompt and response in the plain template"),
    ({"format": "instruction", "template": "chat", "separator": " => "}, "data.separator joins prompt and response")])
def test_a_data_setting_its_format_does_not_read_is_named(data, message):
    """Each would do nothing without a word: chat data always takes the tokenizer's chat template."""
    from megatrain.config import DataConfig
    with pytest.raises(ValueError, match=re.escape(message)):
        DataConfig(**data)
    DataConfig(format="alpaca", template="plain", separator=" => ")  # what they are for


def test_a_data_path_is_read_unless_the_source_says_synthetic(tmp_path):
    """data.source `auto` (the default) reads data.path where one is given; a path beside source:
    synthetic is refused (it would train on random tokens, its data unread)."""
    from megatrain.config import DataConfig
    (tmp_path / "d.jsonl").write_text('{"text": "a b"}\n')
    assert DataConfig(path=str(tmp_path / "d.jsonl")).source == "file" and DataConfig().source == "synthetic"
    with pytest.raises(ValueError, match="d.jsonl' is given but data.source is synthetic .random tokens.: set data.source: file"):
        DataConfig(source="synthetic", path=str(tmp_path / "d.jsonl"))


def test_missing_data_file():
    with pytest.raises(ValueError, match="data.path 'nowhere.jsonl' does not exist"):
        load_config(base={"model": {"preset": "tiny-qwen2"}, "data": {"source": "file", "path": "nowhere.jsonl"}})


def _fields():
    """Every setting of the run file, from the config dataclasses: (dotted name, declared type)."""
    import dataclasses
    from typing import get_type_hints

    from megatrain.config import TrainConfig
    hints = get_type_hints(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        if dataclasses.is_dataclass(hints[f.name]):
            sub = get_type_hints(hints[f.name])
            yield from ((f"{f.name}.{g.name}", sub[g.name]) for g in dataclasses.fields(hints[f.name]))
        else:
            yield f.name, hints[f.name]


@pytest.mark.parametrize("name, hint", list(_fields()), ids=lambda x: x if isinstance(x, str) else "")
def test_every_setting_is_checked_by_its_declared_type(name, hint):
    """A value of the wrong type, for every field of every section, is refused before anything is
    built, naming the setting and the value; a YAML string that spells a number of a numeric field
    is converted."""
    from megatrain.config import _convert
    bad = next(v for v in (1.5, "nope", 5, [1], {"a": 1}, True) if _rejects(_convert, v, hint))
    base = {"model": {"preset": "tiny-qwen2"}}
    with pytest.raises(ValueError, match=rf"^{name.replace('.', '[.]')} must be .*, not {repr(bad).replace('[', '.').replace('{', '.')}"):
        load_config(None, [], base=_set(base, name, bad))


def _rejects(convert, value, hint) -> bool:
    try:
        convert(value, hint)
    except TypeError:
        return True
    return False


def _set(base: dict, name: str, value) -> dict:
    tree = json.loads(json.dumps(base))
    *sections, key = name.split(".")
    node = tree
    for s in sections:
        node = node.setdefault(s, {})
    node[key] = value
    return tree


def test_numbers_spelled_as_strings_are_converted():
    """YAML reads `1e-3` as a string: a numeric field takes it as the number it spells."""
    cfg = load_config(None, ["optim.lr=1e-3", "engine.checkpoint_every='2'"], base={"model": {"preset": "tiny-qwen2"}})
    assert cfg.optim.lr == 1e-3 and cfg.engine.checkpoint_every == 2


@pytest.fixture
def bad_files(tmp_path):
    """A tiny checkpoint and tokenizer, and one broken copy of each kind of file a run reads."""
    import shutil
    tiny_checkpoint(tmp_path / "init", "tiny-llama")
    save_tokenizer(tmp_path / "tok")
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "corrupt.jsonl").write_text('{"text": "a b"}\n{"text": "c d"\n{"text": "e"}\n')
    (tmp_path / "number.jsonl").write_text('{"text": "a b c"}\n{"text": 5}\n')
    (tmp_path / "latin1.jsonl").write_bytes(b'{"text": "a b"}\n{"text": "caf\xe9"}\n')
    shard = next((tmp_path / "init").glob("*.safetensors"))
    for kind, content in (("trunc", shard.read_bytes()[: shard.stat().st_size // 2]), ("garbage", b"not safetensors" * 9)):
        shutil.copytree(tmp_path / "init", tmp_path / kind)
        (tmp_path / kind / shard.name).write_bytes(content)
    (tmp_path / "badcfg").mkdir()
    cfg = json.loads((tmp_path / "init" / "config.json").read_text())
    (tmp_path / "badcfg" / "config.json").write_text(json.dumps({**cfg, "num_attention_heads": 3}))
    from safetensors.torch import load_file, save_file
    weights = load_file(shard)
    name = "model.layers.0.mlp.up_proj.weight"
    for kind, changed in (("missing", {k: v for k, v in weights.items() if k != name}),
                          ("reshaped", {**weights, name: weights[name][:-1]}),
                          # the published GPT-OSS weights' experts: MXFP4 blocks and scales
                          ("mxfp4", {**{k: v for k, v in weights.items() if k != name},
                                     name + "_blocks": weights[name].to(torch.uint8), name + "_scales": weights[name][:, 0].clone()})):
        shutil.copytree(tmp_path / "init", tmp_path / kind)
        save_file(changed, tmp_path / kind / shard.name, metadata={"format": "pt"})
    return tmp_path


@pytest.mark.parametrize("overrides, message", [
    (["model.pretrained={d}/init", "data.source=file", "data.path={d}/empty.jsonl", "data.tokenizer={d}/tok"],
     r"data: .*empty.jsonl is empty"),
    (["model.pretrained={d}/init", "data.source=file", "data.path={d}/corrupt.jsonl", "data.tokenizer={d}/tok"],
     r"data: cannot read .*corrupt.jsonl line 2"),
    (["model.pretrained={d}/trunc"], r"model.pretrained: .*trunc/model.safetensors is not a readable safetensors file"),
    (["model.pretrained={d}/garbage"], r"model.pretrained: .*garbage/model.safetensors is not a readable safetensors"),
    (["model.config={d}/badcfg"], r"model: transformers refuses this llama config: .*attention heads"),
    (["model.pretrained={d}/missing"], r"model.pretrained: checkpoint does not match the config: missing "
                                       r"\['model.layers.0.mlp.up_proj.weight'\], unexpected \[\]"),
    (["model.pretrained={d}/reshaped"], r"model.pretrained: model.layers.0.mlp.up_proj.weight has shape \(127, 64\), "
                                        r"the config implies \(128, 64\)"),
    (["model.pretrained={d}/mxfp4"], r"model.pretrained: .*mxfp4 holds MXFP4-quantized experts .*Mxfp4Config\(dequantize=True\)"),
    (["model.pretrained={d}/init/config.json"], r"model.pretrained: .*config.json is not a directory .*is model.config"),
    (["model.pretrained={d}/nowhere"], r"model.pretrained: .*nowhere does not exist"),
    (["model.pretrained={d}/init", "data.source=file", "data.path={d}/corrupt.jsonl", "data.tokenizer={d}/nowhere"],
     r"data.tokenizer: .*nowhere does not exist \(a local tokenizer's"),
    (["model.pretrained={d}/init", "data.source=file", "data.path={d}/number.jsonl", "data.tokenizer={d}/tok"],
     r"data: .*number.jsonl line 2: text is 5, not a string"),
    (["model.pretrained={d}/init", "data.source=file", "data.path={d}/latin1.jsonl", "data.tokenizer={d}/tok"],
     r"data: .*latin1.jsonl line 2 \(byte 14 of the line\) is not UTF-8 text"),
    (["model.pretrained={d}/init", "data.seed=1180591620717411303424"],
     r"data.seed must be a whole number from 0 to 4294967295 \(2\^32 - 1\), not 1180591620717411303424"),
    (["model.pretrained={d}/init", "seed=-1"], r"seed must be a whole number from 0 to 4294967295"),
], ids=["empty-data", "corrupt-jsonl-line", "truncated-shard", "garbage-shard", "config-the-library-refuses",
        "checkpoint-missing-a-tensor", "checkpoint-tensor-of-another-shape", "mxfp4-checkpoint",
        "checkpoint-a-file", "checkpoint-nowhere", "tokenizer-nowhere", "a-row-that-is-no-text",
        "not-utf8", "data-seed-out-of-range", "seed-out-of-range"])
def test_every_bad_file_is_named_without_a_traceback(bad_files, capsys, monkeypatch, overrides, message):
    """Each is refused by name before the host store is allocated, and nothing is written; `megatrain
    plan` refuses it too."""
    import megatrain.trainer
    monkeypatch.setattr(megatrain.trainer, "HostStore", None)  # allocating the store would fail otherwise
    out = bad_files / "out"
    args = ["train", "--no-progress", "engine.device=cpu", "data.seq_len=16", "steps=1", f"output_dir={out}"]
    assert main(args + [o.format(d=bad_files) for o in overrides]) == 2
    err = capsys.readouterr().err
    assert re.search(message, err) and "Traceback" not in err
    assert not out.exists()  # nothing written
    with pytest.raises(ValueError, match=message):  # --debug shows the traceback instead
        main(["train", "--debug", *args[1:], *(o.format(d=bad_files) for o in overrides)])
    assert main(["plan", "engine.device=cpu", "data.seq_len=16", "steps=1", *(o.format(d=bad_files) for o in overrides)]) == 2
    assert re.search(message, capsys.readouterr().err)


def test_settings_stand_anywhere_among_the_flags():
    """`key.sub=value` settings after a flag join the ones before it; anything else unknown is refused."""
    from megatrain.cli import parse_with_settings
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int)
    p.add_argument("overrides", nargs="*")
    args = parse_with_settings(p, ["a=1", "--steps", "3", "b.c=2", "d=x y"], "overrides")
    assert args.steps == 3 and args.overrides == ["a=1", "b.c=2", "d=x y"]
    for bad in (["--steps", "3", "--bogus"], ["a=1", "--steps", "3", "stray"]):
        with pytest.raises(SystemExit):
            parse_with_settings(p, bad, "overrides")


@pytest.mark.parametrize("option, message", [
    ("megatrain", "SYSTEM:KEY=VALUE"), (":engine.k=1", "SYSTEM:KEY=VALUE"),
    ("megatrain:=1", "key.sub=value"), ("megatrain:engine.k", "key.sub=value"),
    ("native:bogus=1", "native options: unknown ['bogus']"),
    ("fsdp2:accumulate=device", "fsdp2 is not among the systems ['megatrain', 'native']")])
def test_a_bad_accuracy_option_is_named_and_nothing_runs(tmp_path, capsys, option, message):
    """`python -m suite accuracy --option` takes SYSTEM:KEY=VALUE: anything else is refused by name,
    without a traceback and before anything is written."""
    from suite.__main__ import main as suite_main
    out, work = tmp_path / "out", tmp_path / "work"
    assert suite_main(["accuracy", "--out", str(out), "--work", str(work), "--option", option]) == 2
    assert message in capsys.readouterr().err and not out.exists() and not work.exists()
    with pytest.raises(SystemExit):  # a stray setting after the flags is no option of this command
        suite_main(["accuracy", "--out", str(out), "--work", str(work), "engine.k=1"])


@pytest.mark.parametrize("command, message", [
    (["compare", "{root}/results/h200/points", "{root}/results/h200x4/points", "--out", "/proc/nowhere/c.json"],
     "error: --out /proc/nowhere"),
    (["check", "--systems", "native", "--out-dir", "/proc/nowhere"], "error: --out-dir /proc/nowhere"),
    (["accuracy", "--out", "/proc/nowhere", "--work", "{tmp}/w"], "error: accuracy --out /proc/nowhere"),
    (["project", "{root}/results/h200", "--out", "/proc/nowhere"], "project: --out /proc/nowhere")])
def test_an_output_folder_that_cannot_be_made_is_named_before_the_work(tmp_path, capsys, command, message):
    """Refused before the command's work, which would otherwise end in a traceback when it writes."""
    from suite.__main__ import main as suite_main
    try:
        code = suite_main([c.format(tmp=tmp_path, root=ROOT) for c in command])
    except SystemExit as e:  # argparse's error
        code = e.code
    assert code == 2 and message in capsys.readouterr().err and not (tmp_path / "w").exists()


@pytest.mark.parametrize("command, message", [
    (["check", "--systems", "megatrain,nope"], "--systems: unknown ['nope']; known: ['megatrain'"),
    (["check", "--systems", "megatrain", "--steps", "0"], "--steps must be at least 1, not 0"),
    (["check", "--systems", "megatrain", "--tolerance", "-1"], "--tolerance must be above 0, not -1.0"),
    (["accuracy", "--systems", "native,nope"], "accuracy systems: unknown ['nope']; known: ['megatrain'")])
def test_an_unknown_system_or_empty_check_is_named_before_any_runs(tmp_path, capsys, command, message):
    """`suite check` and `suite accuracy` name a system they do not know, and a check of no steps,
    before the first system runs, not after native's run."""
    from suite.__main__ import main as suite_main
    out = tmp_path / "out"
    where = ["--out-dir", str(out)] if command[0] == "check" else ["--out", str(out), "--work", str(tmp_path / "w")]
    assert suite_main([*command, *where]) == 2
    assert message in capsys.readouterr().err and not out.exists()


@pytest.mark.slow
def test_a_point_whose_log_is_the_commands_output_is_refused(tmp_path):
    """`python -m suite run ... --out p.json > p.log`: the harness writes the worker's log to p.log,
    so the command's own output there would overwrite its first bytes. Refused by name before the
    point runs; nothing written but the shell's file."""
    log = tmp_path / "p.log"
    with open(log, "w") as f:
        rc = subprocess.run([sys.executable, "-m", "suite", "run", "--system", "megatrain", "--preset", "tiny-llama",
                             "--seq", "16", "--batch", "2", "--steps", "1", "--out", str(tmp_path / "p.json")],
                            stdout=f, stderr=subprocess.STDOUT, cwd=ROOT).returncode
    assert rc == 2
    assert "the worker's log is written to" in log.read_text() and "Traceback" not in log.read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.log"]


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="plans this machine's own GPU there")
def test_megatrain_plan_for_a_gpu_machine_from_one_without(capsys):
    """`megatrain plan engine.device=cuda` where there is no GPU: the plan of the GPU machine the
    settings state (bf16 compute, the GPU's kernels), its verdict against that machine; without
    the sizes, a refusal that names them."""
    args = ["plan", "model.preset=qwen2.5-7b", "data.seq_len=4096", "data.batch_size=4", "steps=1",
            "engine.device=cuda", "engine.checkpoint_every=1", "engine.host_memory_gb=125"]
    assert main([*args, "engine.device_memory_gb=79"]) == 0
    out = capsys.readouterr().out
    assert "bfloat16 compute" in out and out.rstrip().endswith("fits the stated machine")
    assert main([*args, "engine.device_memory_gb=8"]) == 2  # train's refusal, after the report
    out, err = capsys.readouterr()
    assert "memory plan: host" in out and "fits" not in out
    assert "megatrain: error: the run does not fit: device memory" in err and "Traceback" not in err
    assert main(args[:-1] + ["engine.device_memory_gb=79"]) == 2
    err = capsys.readouterr().err
    assert "state engine.host_memory_gb" in err and "engine.device_memory_gb" not in err and "Traceback" not in err


@pytest.mark.parametrize("gpus, message", [("0", "at least 1, not 0"), ("-2", "at least 1, not -2"),
                                           ("two", "a whole number, not 'two'")])
def test_megatrain_plan_names_a_bad_rank_count(capsys, gpus, message):
    with pytest.raises(SystemExit) as stop:
        main(["plan", "model.preset=tiny-qwen2", "--gpus", gpus])
    assert stop.value.code == 2
    assert f"argument --gpus: must be {message}" in capsys.readouterr().err


@pytest.mark.parametrize("tracker", ["tensorboard", "wandb", "mlflow"])
def test_a_tracker_without_its_package_is_refused_before_anything_is_written(tmp_path, capsys, monkeypatch, tracker):
    import importlib.util
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == tracker else find_spec(name, *a))
    out = tmp_path / "out"
    assert main(["train", "--no-progress", "model.preset=tiny-qwen2", "engine.device=cpu", "data.seq_len=16",
                 "steps=1", f"output_dir={out}", f"report_to=[{tracker}]"]) == 2
    assert (f"report_to: {tracker} needs the {tracker} package: pip install 'megatrain[{tracker}]' "
            f"(or pip install {tracker})") in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("command", ["table", "project"])
def test_a_missing_results_folder_is_named(tmp_path, capsys, command):
    from suite.__main__ import main as suite_main
    with pytest.raises(SystemExit) as stop:
        suite_main([command, str(tmp_path), str(tmp_path / "nowhere")])
    assert stop.value.code == 2
    assert f"{command}: not a folder of results: {tmp_path / 'nowhere'}" in capsys.readouterr().err


def test_a_result_path_that_cannot_be_written_is_refused_before_the_run(tmp_path, capsys):
    from suite.__main__ import main as suite_main
    (tmp_path / "file").write_text("x")
    cases = [(tmp_path / "file" / "r.json", "is a file, not a folder")]
    if Path("/proc/self").is_dir():  # root may write anywhere the permission bits say; nothing can be made here
        cases.append((Path("/proc/megatrain/r.json"), "/proc cannot be written"))
    for out, message in cases:
        assert suite_main(["run", "--system", "megatrain", "--preset", "tiny-qwen2", "--seq", "16", "--batch", "2",
                           "--steps", "1", "--out", str(out)]) == 2
        assert message in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]

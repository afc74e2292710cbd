"""Hub ids with the network off: a model repo id (model.pretrained, data.tokenizer) read from a
cache laid out as huggingface_hub's (blobs, snapshots/<revision> of links to them, refs/main), a
dataset id (data.path) read from that cache's snapshot with its subsets and splits, a dataset
repository's folder read alike, and the refusals that name the setting when an id is not cached."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import tiny_checkpoint
from megatrain.config import DataConfig, load_config
from megatrain.data import make_sources
from tiny_tokenizer import byte_tokenizer

datasets = pytest.importorskip("datasets")

REVISION = "0123456789abcdef0123456789abcdef01234567"
CHAT = [{"role": "user", "content": "What is two plus three?"}, {"role": "assistant", "content": "Five."}]
# a dataset repository as the Hub holds one: data files, and a card whose `configs` name the
# subsets and their splits (datasets reads them; the Hub shows them)
CARD = """---
configs:
- config_name: short
  default: true
  data_files:
  - split: train
    path: short/train.jsonl
  - split: test
    path: short/test.jsonl
- config_name: long
  data_files:
  - split: train
    path: long/train.jsonl
---
"""


def lay_out(cache: Path, kind: str, repo: str, folder: Path) -> Path:
    """`folder`'s files as huggingface_hub caches a download of `repo`: content-addressed blobs,
    a snapshot of relative links to them, refs/main naming the snapshot; returns the snapshot."""
    root = cache / f"{kind}s--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / REVISION
    for file in sorted(p for p in folder.rglob("*") if p.is_file()):
        data = file.read_bytes()
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / file.relative_to(folder)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / "main").write_text(REVISION)
    return snapshot


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    """An empty Hub cache in tmp_path with the network off, as HF_HUB_CACHE and HF_HUB_OFFLINE=1
    set it in a fresh process (the libraries read them at import: set where they keep them)."""
    from huggingface_hub import constants
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets")
    return cache


def rows(n: int, answer: str) -> list[dict]:
    return [{"messages": [CHAT[0], {"role": "assistant", "content": f"{answer} {k}."}]} for k in range(n)]


def dataset_repo(path: Path) -> Path:
    path.mkdir()
    (path / "README.md").write_text(CARD)
    for name, data in (("short/train", rows(6, "Five")), ("short/test", rows(2, "Five")), ("long/train", rows(3, "It is five"))):
        (path / name).parent.mkdir(exist_ok=True)
        (path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in data))
    return path


def model_repo(path: Path) -> Path:
    tiny_checkpoint(path, "tiny-qwen2", {"vocab_size": 300})
    byte_tokenizer("qwen2.5").save_pretrained(path)
    (path / "pytorch_model.bin").write_bytes(b"other weights: never downloaded")
    return path


def test_a_model_id_resolves_to_its_cached_snapshot_and_trains(tmp_path, offline_cache):
    """model.pretrained: Qwen/Qwen2.5-0.5B reads the cached snapshot: the config, the safetensors,
    the tokenizer with its chat template (also as data.tokenizer), and trains on a Hub dataset id."""
    from megatrain.trainer import Trainer
    snapshot = lay_out(offline_cache, "model", "Qwen/Qwen2.5-0.5B", model_repo(tmp_path / "model"))
    lay_out(offline_cache, "dataset", "org/chat", dataset_repo(tmp_path / "repo"))
    cfg = load_config(base={"model": {"pretrained": "Qwen/Qwen2.5-0.5B"}, "engine": {"device": "cpu"},
                            "data": {"path": "org/chat", "format": "chat", "seq_len": 256, "batch_size": 2,
                                     "eval_split": "test", "tokenizer": "Qwen/Qwen2.5-0.5B"}, "steps": 1})
    assert cfg.model.pretrained == cfg.data.tokenizer == str(snapshot)
    trainer = Trainer(cfg)
    try:
        assert len(trainer.data.examples) == 6 and len(trainer.held_out.examples) == 2
        assert trainer.fit(log=open(os.devnull, "w"), progress=False)[0]["loss"] > 0
    finally:
        trainer.close()


def test_a_dataset_id_with_its_subset_and_split(tmp_path, offline_cache):
    """A Hub dataset in the cache (as `hf download --repo-type dataset` leaves it) and the same
    repository's folder read alike: data.subset picks a configuration of its card, data.split a split."""
    repo = dataset_repo(tmp_path / "repo")
    lay_out(offline_cache, "dataset", "org/chat", repo)
    tok = str(tmp_path / "tok")
    byte_tokenizer("qwen2.5").save_pretrained(tok)
    for path in ("org/chat", str(repo)):
        def read(**settings):
            return make_sources(DataConfig(path=path, format="chat", seq_len=256, **settings), 300, tok)
        train, held = read()
        assert (len(train.examples), held) == (6, None)
        assert len(read(split="test")[0].examples) == 2
        train, held = read(subset="long", eval_fraction=0.34)
        assert (len(train.examples), len(held.examples)) == (2, 1)
        with pytest.raises(ValueError, match=r"data.path: .*, split validation: .*Unknown split"):
            read(split="validation")
        with pytest.raises(ValueError, match=r"data.path: .*, split train: .*nope"):
            read(subset="nope")


def test_ids_not_in_the_cache_are_refused_by_setting(tmp_path, offline_cache):
    with pytest.raises(ValueError, match=r"model.pretrained: org/absent is no local folder, and the Hub model "
                                         r"org/absent is not in the cache .*HF_HUB_OFFLINE is set: run `hf download org/absent`"):
        load_config(base={"model": {"pretrained": "org/absent"}})
    with pytest.raises(ValueError, match=r"data.tokenizer: org/absent is no local folder"):
        DataConfig(tokenizer="org/absent")
    byte_tokenizer("qwen2.5").save_pretrained(tmp_path / "tok")
    with pytest.raises(ValueError, match=r"data.path: org/absent is no local file or folder, and the Hub dataset "
                                         r"org/absent is not in the cache .*`hf download org/absent --repo-type dataset`"):
        make_sources(DataConfig(path="org/absent", format="chat"), 300, str(tmp_path / "tok"))
    # a missing local path is not taken for an id: a data file's name, a path of several folders
    for path in ("data/chat.jsonl", "runs/a/model"):
        with pytest.raises(ValueError, match=f"data.path '{path}' does not exist"):
            DataConfig(path=path)
    with pytest.raises(ValueError, match="model.pretrained: runs/a/model does not exist"):
        from megatrain.shapes import load_hf_config
        load_hf_config(load_config(base={"model": {"pretrained": "runs/a/model"}}).model)


def test_split_and_subset_are_refused_for_plain_files(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"messages": CHAT}) + "\n")
    byte_tokenizer("qwen2.5").save_pretrained(tmp_path / "tok")
    with pytest.raises(ValueError, match=r"data.path .*d.jsonl is data files, without the subsets and splits"):
        make_sources(DataConfig(path=str(path), format="chat", split="test"), 300, str(tmp_path / "tok"))
    with pytest.raises(ValueError, match=r"give one of data.eval_path, data.eval_fraction, data.eval_split, not "
                                         r"data.eval_fraction and data.eval_split"):
        DataConfig(path=str(path), eval_fraction=0.1, eval_split="test")


def test_the_command_refuses_an_uncached_id_without_a_traceback(tmp_path):
    """In a fresh process HF_HOME and HF_HUB_OFFLINE come from the environment, as a user sets them."""
    env = {**os.environ, "HF_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    done = subprocess.run([sys.executable, "-m", "megatrain.cli", "plan", "model.pretrained=Qwen/Qwen2.5-0.5B"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert f"model.pretrained: Qwen/Qwen2.5-0.5B is no local folder, and the Hub model Qwen/Qwen2.5-0.5B is not in " \
           f"the cache {tmp_path / 'home' / 'hub'}, and HF_HUB_OFFLINE is set" in done.stderr

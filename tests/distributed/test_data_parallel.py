"""Data-parallel ranks (megatrain/distributed.py) on the CPU through gloo, launched by torchrun.

Exactness: 2 ranks with a global batch of B rows train as 1 rank with B rows. Each rank's
gradient sums its B/2 rows and the ranks' sums are added by the reduce-scatter, where one rank's
matmuls sum all B rows at once: the same terms in another order, so float32 rounding differs.
Losses and gradient norms: rtol 1e-5 (the reference test's, tests/engine/test_engine_reference.py).

Weights after 3 AdamW steps at lr <= 1e-3: atol 2e-5, from the rounding it bounds. AdamW divides
the step's gradient g by sqrt(v) + eps, so a rounding difference d in g moves the update by at most
about 2 lr d / (|g| + eps): for an element whose gradient is itself rounding noise (|g| ~ d, e.g.
a bias or a value projection fed by padded rows), by up to 2 lr d / eps. The two orders of
summation differ by d of a few float32 ulps (2^-24 relative) of the gradient sums' terms, here
d <= 3e-8, so with eps 1e-5 (both runs) three steps move such an element by at most
2 * 3e-3 * 3e-8 / 1e-5 = 1.8e-5 apart. With AdamW's default eps 1e-8 the same bound is 1.8e-2:
one such element ended 5e-5 apart on an AMD EPYC, and no tolerance tight enough to mean anything
separates that from a real fault. A wrong reduction or a part updated twice moves whole lr-sized steps (1e-3) on
every element whose gradient is not noise.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from helpers import random_batches, store_params, tiny_checkpoint, torchrun
from megatrain import kept_attention
from megatrain.config import load_config
from megatrain.distributed import Ranks, check, part
from megatrain.shapes import ModelShape
from megatrain.trainer import Trainer
from tiny_tokenizer import WORDS, save_tokenizer

pytestmark = pytest.mark.slow  # minutes on the 2-core machine: `pytest -m "not slow"` leaves them out

SEQ, BATCH, ACCUM, STEPS = 16, 4, 2, 3


def settings(tmp_path, **top) -> dict:
    return {"model": {"pretrained": str(tmp_path / "init")},
            "engine": {"device": "cpu", "checkpoint_every": 2, "loss_chunk_tokens": 7},
            "optim": {"lr": 1e-3, "eps": 1e-5, "weight_decay": 0.1, "max_grad_norm": 0.5, "schedule": "constant"},
            "data": {"seq_len": SEQ, "batch_size": BATCH, "grad_accum": ACCUM}, "steps": STEPS, **top}


def one_rank(tmp_path, tree: dict, batches) -> tuple[list[float], list[float], dict]:
    trainer = Trainer(load_config(base=tree))
    try:
        losses = [trainer.train_step(mbs)["loss"] for mbs in batches]
        trainer.optimizer.flush()
        norms = [trainer.optimizer.grad_norms[k] for k in range(len(batches))]
        return losses, norms, store_params(trainer)
    finally:
        trainer.close()


@pytest.fixture
def model_and_batches(tmp_path):
    model = tiny_checkpoint(tmp_path / "init", "tiny-llama")
    batches = random_batches(STEPS, ACCUM, BATCH, SEQ, model.config.vocab_size, pad=True)
    torch.save(batches, tmp_path / "batches.pt")
    return batches


def assert_same_training(reports, params, reference):
    losses, norms, weights = reference
    for report in reports:
        torch.testing.assert_close(report["losses"], losses, rtol=1e-5, atol=0)
        torch.testing.assert_close(report["grad_norms"], norms, rtol=1e-5, atol=0)
    for name, expected in weights.items():
        torch.testing.assert_close(params[name], expected, rtol=0, atol=2e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("engine, clip", [({}, 0.5), ({"device_tiles": 2, "no_recompute_layers": 1}, None)],
                         ids=["host-tiles-clip", "device-tiles-noclip"])
def test_two_ranks_train_as_one_with_the_global_batch(tmp_path, model_and_batches, engine, clip):
    """Grad accumulation (2 micro-batches), right-padded rows, an untied head; clipping by the
    global norm (the updates at the step's end), or none (each part updated as its gradient
    returns) with the embedding and layer 0 on each GPU, summed whole; the two ranks' store is
    one shared mapping, not two copies, and each rank's gradient slabs hold its part of a layer."""
    tree = settings(tmp_path)
    tree["engine"].update(engine)
    tree["optim"]["max_grad_norm"] = clip
    reports = torchrun(tmp_path, tree, str(tmp_path / "batches.pt"), "two")
    params = torch.load(tmp_path / "two" / "params-host0.pt")
    assert_same_training(reports, params, one_rank(tmp_path, tree, model_and_batches))
    # one file, mapped by both: its pages are counted once over the two processes (PSS), while
    # each maps all of them (RSS)
    assert len({f for r in reports for f in r["files"]}) == 1
    store = reports[0]["store_bytes"]
    assert sum(r["pss_bytes"] for r in reports) <= 1.1 * store
    assert all(r["rss_bytes"] >= 0.5 * store for r in reports)
    assert not Path(reports[0]["files"][0]).exists(), "the shared store's file left behind"
    for r in reports:
        assert r["slab_numel"] == r["largest_layer_part"] < r["layer_numel"] <= 2 * r["slab_numel"], r


def test_two_ranks_keeping_attention_in_host_memory_train_as_one(tmp_path):
    """Kept attention in host memory (engine.offload_attention) on 2 ranks: each rank's own rows'
    attention out and back every step, the run as one rank's (unpadded rows: a padded micro-batch
    keeps none)."""
    model = tiny_checkpoint(tmp_path / "init", "tiny-llama")
    batches = random_batches(STEPS, ACCUM, BATCH, SEQ, model.config.vocab_size, pad=False)
    torch.save(batches, tmp_path / "batches.pt")
    tree = settings(tmp_path)
    tree["engine"].update({"keep_attention_layers": 2, "offload_attention": True})
    reports = torchrun(tmp_path, tree, str(tmp_path / "batches.pt"), "two")
    shape = ModelShape(model.config)
    per_step = 2 * ACCUM * kept_attention.kept_bytes(shape, BATCH // 2 * SEQ, 4)  # 2 layers, each rank's rows
    assert all(r["offloaded_attention_layers"] == 2 and r["attention_d2h"] == STEPS * per_step for r in reports)
    assert_same_training(reports, torch.load(tmp_path / "two" / "params-host0.pt"), one_rank(tmp_path, tree, batches))


def test_two_hosts_of_two_ranks_train_as_one(tmp_path, model_and_batches):
    """4 ranks as 2 "hosts" (two torchruns, --nnodes 2): each host its own shared store, the
    gradients reduced within and across hosts; both hosts' stores end equal to the one rank's."""
    tree = settings(tmp_path)
    reports = torchrun(tmp_path, tree, str(tmp_path / "batches.pt"), "hosts", nodes=2)
    reference = one_rank(tmp_path, tree, model_and_batches)
    for host in (0, 1):
        assert_same_training(reports, torch.load(tmp_path / "hosts" / f"params-host{host}.pt"), reference)
    files = [set(r["files"]) for r in reports]
    assert files[0] == files[1] and files[2] == files[3] and not files[0] & files[2]


def test_four_ranks_on_one_host_train_as_one(tmp_path, model_and_batches):
    """4 ranks of one host (the four-GPU host's layout): one shared store, every tile in 4 parts
    (the last shorter), each rank's slabs a quarter of a layer; clipping by the global norm."""
    tree = settings(tmp_path)
    reports = torchrun(tmp_path, tree, str(tmp_path / "batches.pt"), "four", per_host=4)
    params = torch.load(tmp_path / "four" / "params-host0.pt")
    assert_same_training(reports, params, one_rank(tmp_path, tree, model_and_batches))
    assert len({f for r in reports for f in r["files"]}) == 1
    assert sum(r["pss_bytes"] for r in reports) <= 1.1 * reports[0]["store_bytes"]
    assert all(r["reduce_s"] > 0 for r in reports)  # the timeline's spans of the gradients' reduction
    # a slab holds the largest part (rank 0's); the last rank's part is the shorter one
    assert reports[0]["slab_numel"] == reports[0]["largest_layer_part"]
    for r in reports:
        assert r["largest_layer_part"] <= r["slab_numel"] < r["layer_numel"] <= 4 * r["slab_numel"], r


def test_eight_ranks_on_one_host_train_as_one(tmp_path):
    """8 ranks of one host (the eight-GPU host's layout, issue 77's launch path, on gloo): one
    shared store, every tile in 8 parts (a tiny layer's last parts short or empty), each rank's
    slabs an eighth of a layer; the global micro-batch of 8 rows one row a rank."""
    model = tiny_checkpoint(tmp_path / "init", "tiny-llama")
    batches = random_batches(STEPS, ACCUM, 8, SEQ, model.config.vocab_size, pad=True)
    torch.save(batches, tmp_path / "batches.pt")
    tree = settings(tmp_path)
    tree["data"]["batch_size"] = 8
    reports = torchrun(tmp_path, tree, str(tmp_path / "batches.pt"), "eight", per_host=8)
    params = torch.load(tmp_path / "eight" / "params-host0.pt")
    assert_same_training(reports, params, one_rank(tmp_path, tree, batches))
    assert len({f for r in reports for f in r["files"]}) == 1
    assert sum(r["pss_bytes"] for r in reports) <= 1.1 * reports[0]["store_bytes"]
    for r in reports:
        assert r["largest_layer_part"] <= r["slab_numel"] < r["layer_numel"] <= 8 * r["slab_numel"], r


@pytest.mark.parametrize("preset", ["tiny-qwen3-moe", "tiny-gpt-oss", "tiny-deepseek-v3"])
def test_two_ranks_train_a_mixture_of_experts_as_one(tmp_path, preset):
    """The router's load-balancing loss (moe.py) over the whole micro-batch: each rank routes its own
    rows, the picks, probability sums and rows are summed over the ranks before any backward, so
    the loss, the gradients and the weights are the one rank's (right-padded rows left out of the
    routing's counts on each rank); DeepSeek-V3, without a router loss in the library, as one rank too."""
    model = tiny_checkpoint(tmp_path / "init", preset)
    if preset != "tiny-deepseek-v3":
        assert model.config.output_router_logits and model.config.router_aux_loss_coef
    batches = random_batches(STEPS, ACCUM, BATCH, SEQ, model.config.vocab_size, pad=True)
    torch.save(batches, tmp_path / "batches.pt")
    tree = settings(tmp_path)
    reports = torchrun(tmp_path, tree, str(tmp_path / "batches.pt"), "two")
    reference = one_rank(tmp_path, tree, batches)
    assert_same_training(reports, torch.load(tmp_path / "two" / "params-host0.pt"), reference)


def test_two_ranks_evaluate_as_one(tmp_path):
    """The held-out loss on 2 ranks, each taking its rows of every batch (the last batch's one row
    on rank 0 alone), is 1 rank's: the same targets, summed over the ranks."""
    import random
    tiny_checkpoint(tmp_path / "init", "tiny-llama")
    save_tokenizer(tmp_path / "init")
    rng = random.Random(0)

    def text(words: int) -> str:
        return json.dumps({"text": " ".join(rng.choice(WORDS[5:]) for _ in range(words))}) + "\n"
    (tmp_path / "train.jsonl").write_text(text(8 * SEQ))
    (tmp_path / "held.jsonl").write_text(text(5 * SEQ + 3))  # 5 sequences: batches of 4 rows and 1
    data = {"source": "file", "path": str(tmp_path / "train.jsonl"), "eval_path": str(tmp_path / "held.jsonl"),
            "format": "text", "seq_len": SEQ, "batch_size": BATCH, "grad_accum": ACCUM}
    tree = settings(tmp_path, data=data)
    trainer = Trainer(load_config(base=tree))
    try:
        assert len(trainer.held_out.examples) == 5
        expected = trainer.evaluate()
    finally:
        trainer.close()
    for report in torchrun(tmp_path, tree, None, "eval", evaluate=True):
        got = report["eval"]
        assert got["eval_target_tokens"] == expected["eval_target_tokens"] == 5 * (SEQ - 1)
        assert isinstance(got["eval_target_tokens"], int)
        assert got["eval_loss"] == pytest.approx(expected["eval_loss"], rel=1e-5)
        assert got["eval_accuracy"] == expected["eval_accuracy"]  # whole counts, summed over the ranks


def test_resume_after_a_two_rank_run(tmp_path):
    """2 ranks train 2 steps (fit, synthetic data: the sampler's rows split by rank) and save; 2
    ranks, or 1, resume for 2 more: the same as 1 rank for 4 steps (the state does not depend on N)."""
    import shutil
    tiny_checkpoint(tmp_path / "init", "tiny-qwen2")
    data = {"seq_len": SEQ, "batch_size": 2, "grad_accum": 2}
    trainer = Trainer(load_config(base=settings(tmp_path, steps=4, data=data)))
    try:
        trainer.fit(log=open("/dev/null", "w"), progress=False)
        expected = store_params(trainer)
    finally:
        trainer.close()
    torchrun(tmp_path, settings(tmp_path, steps=2, data=data, output_dir=str(tmp_path / "two")), None, "first")
    shutil.copytree(tmp_path / "two", tmp_path / "one")

    def resume(out: str) -> dict:
        return settings(tmp_path, steps=4, data=data, output_dir=str(tmp_path / out), resume=True, resume_changes=True)
    reports = torchrun(tmp_path, resume("two"), None, "resumed")
    assert [len(r["losses"]) for r in reports] == [2, 2]
    by_two = torch.load(tmp_path / "resumed" / "params-host0.pt")
    trainer = Trainer(load_config(base=resume("one")))
    try:
        assert trainer.step == 2
        trainer.fit(log=open("/dev/null", "w"), progress=False)
        by_one = store_params(trainer)
    finally:
        trainer.close()
    for name in expected:
        for got in (by_two, by_one):
            torch.testing.assert_close(got[name], expected[name], rtol=0, atol=2e-5, msg=lambda m: f"{name}: {m}")


def test_a_rank_that_dies_leaves_no_shared_store_behind(tmp_path):
    """The shared file is unlinked once mapped: a rank dying (torchrun then ends the others) leaves
    nothing in /dev/shm."""
    tiny_checkpoint(tmp_path / "init", "tiny-llama")
    before = set(Path("/dev/shm").glob("megatrain-*"))
    torchrun(tmp_path, settings(tmp_path), None, "crash", crash_rank=1)
    assert set(Path("/dev/shm").glob("megatrain-*")) == before


def test_parts_cover_every_tile_once():
    for numel in (64, 128, 4096 + 64, 1_000_064):
        for n in (1, 2, 3, 8):
            spans = [part(numel, n, k)[:2] for k in range(n)]
            assert spans[0][0] == 0 and spans[-1][1] == numel
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
            assert all(lo % 64 == 0 for lo, _ in spans)


@pytest.mark.parametrize("ranks, batch, device, gpus, message", [
    (Ranks(0, 4, 0, 4), 8, "cuda", 2, r"4 ranks on this host but 2 GPU\(s\)"),
    (Ranks(0, 2, 0, 2), 3, "cpu", 0, r"data.batch_size 3 .* does not split over 2 ranks"),
    (Ranks(0, 4, 0, 2, 0), 6, "cpu", 0, r"does not split over 4 ranks"),
])
def test_bad_combinations_are_refused(ranks, batch, device, gpus, message):
    with pytest.raises(ValueError, match=message):
        check(ranks, batch, device, gpus)


def test_a_global_batch_that_does_not_split_is_refused_before_anything_is_built(tmp_path, monkeypatch):
    tiny_checkpoint(tmp_path / "init", "tiny-llama")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    tree = settings(tmp_path, data={"seq_len": SEQ, "batch_size": 3})
    with pytest.raises(ValueError, match="data.batch_size 3"):
        Trainer(load_config(base=tree))


def test_a_host_too_small_for_the_shared_store_is_refused(tmp_path, monkeypatch):
    """The plan counts the store once per host and the rest per rank; /dev/shm too small is refused."""
    import megatrain.planning
    tiny_checkpoint(tmp_path / "init", "tiny-llama")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(megatrain.planning, "shared_memory_free", lambda: 4096)
    with pytest.raises(ValueError, match=r"host memory: .*/dev/shm"):
        Trainer(load_config(base=settings(tmp_path)))


def test_the_plan_counts_the_shared_store_once_per_host():
    """Two ranks on a host: the store once, the runtime twice, each rank's gradient slabs for its
    half of a layer (together one rank's; none with clipping: gradients return into the store's
    buffers), each rank's device memory for its half of the micro-batch."""
    from megatrain import memory
    from megatrain.config import DataConfig, EngineConfig, ModelConfig, OptimConfig
    from megatrain.resolve import Machine, resolve
    from megatrain.shapes import ModelShape, load_hf_config
    from megatrain.store import Layout, pinned_bytes
    shape = ModelShape(load_hf_config(ModelConfig(preset="qwen2.5-7b")))
    data, machine = DataConfig(seq_len=4096, batch_size=4), Machine(True, 80 << 30, 1 << 40, gpus=2)
    unclipped = OptimConfig(max_grad_norm=None)
    one = memory.plan(shape, resolve(EngineConfig(), data, unclipped, shape, machine))
    two = memory.plan(shape, resolve(EngineConfig(), data, unclipped, shape, machine, Ranks(0, 2, 0, 2)))
    assert memory.plan(shape, resolve(EngineConfig(), data, OptimConfig(), shape, machine, Ranks(0, 2, 0, 2))
                       ).detail["grad_slabs"] == 0
    assert two.detail["store"] <= one.detail["store"]  # no power-of-two pinned blocks in the shared file
    assert two.detail["runtime"] == 2 * one.detail["runtime"]
    layer = 4 * Layout.of(shape.layer_specs).numel
    assert one.detail["grad_slabs"] == 8 * pinned_bytes(layer, True)  # 1 GiB each: a power of two
    assert two.detail["grad_slabs"] == 2 * 8 * pinned_bytes(layer // 2, True) == one.detail["grad_slabs"]
    assert two.device_bytes < one.device_bytes
    assert two.host_bytes < 1.1 * one.host_bytes


@pytest.mark.parametrize("bad, message", [
    (dict(system="native", gpus=2), "native runs on one GPU in this harness; only megatrain, fsdp2, zero3, "
                                     "zero_infinity run data-parallel"),
    (dict(system="gemini", gpus=2), "only megatrain, fsdp2, zero3, zero_infinity run data-parallel"),
    (dict(system="megatrain", gpus=3), "batch_size 2 does not split over gpus 3"),
    (dict(system="fsdp2", gpus=3), "batch_size 2 does not split over gpus 3"),
    (dict(system="zero3", gpus=4), "batch_size 2 does not split over gpus 4"),
])
def test_the_harness_refuses_what_cannot_run_data_parallel(bad, message):
    from suite.spec import RunSpec
    with pytest.raises(ValueError, match=message):
        RunSpec(model={"preset": "tiny-llama"}, seq_len=32, batch_size=2, **bad)


def test_a_harness_point_on_two_ranks_runs_under_torchrun(tmp_path):
    """The worker under torchrun (suite/runner.py), the first rank writing the result: the same
    losses as the point on one rank, the host peak counting the shared store once."""
    from suite.runner import run_point
    from suite.spec import RunSpec
    results = {}
    for gpus in (1, 2):
        spec = RunSpec(system="megatrain", model={"preset": "tiny-llama"}, seq_len=32, batch_size=2, grad_accum=2,
                       steps=2, max_steps=2, warmup=1, timeout_s=240.0, gpus=gpus)  # both the same steps
        results[gpus] = run_point(spec, tmp_path / f"{gpus}.json")
        assert results[gpus]["status"] == "ok", results[gpus].get("log_tail")
    torch.testing.assert_close([s["loss"] for s in results[2]["steps"]], [s["loss"] for s in results[1]["steps"]],
                               rtol=1e-5, atol=0)
    assert results[2]["spec"]["gpus"] == 2


@pytest.mark.parametrize("accumulate", ["host", "device"])
def test_fsdp2_on_two_ranks_trains_as_one(tmp_path, accumulate):
    """FSDP2 CPU offload on 2 ranks (gloo) under the harness's torchrun: each rank its rows, the
    parameters sharded over both; the same losses and trained weights as the point on one rank
    (float32 on the CPU; the ranks' averaged gradients differ from one rank's only in rounding),
    with the micro-batches summed through the host after each or on each rank before one reduce."""
    from safetensors.torch import load_file
    from suite.runner import run_point
    from suite.spec import RunSpec
    results, weights = {}, {}
    for gpus in (1, 2):
        spec = RunSpec(system="fsdp2", model={"preset": "tiny-llama"}, seq_len=32, batch_size=2, grad_accum=2,
                       steps=2, warmup=1, timeout_s=240.0, gpus=gpus, save_to=str(tmp_path / f"model{gpus}"),
                       options={"accumulate": accumulate})
        results[gpus] = run_point(spec, tmp_path / f"{gpus}.json")
        assert results[gpus]["status"] == "ok", results[gpus].get("log_tail")
        assert results[gpus]["info"]["accumulate"] == accumulate
        weights[gpus] = load_file(tmp_path / f"model{gpus}" / "model.safetensors")
    torch.testing.assert_close([s["loss"] for s in results[2]["steps"]], [s["loss"] for s in results[1]["steps"]],
                               rtol=1e-5, atol=0)
    torch.testing.assert_close(weights[2], weights[1], rtol=1e-5, atol=1e-7)
    assert results[2]["model_flops_per_step"] == results[1]["model_flops_per_step"]  # the global step's
    assert results[2]["env"]["cpu_threads"] == max(1, os.cpu_count() // 2)  # each rank its share of the cores
    # each rank's own memory counts (no shared store): the tree of 2 ranks holds more than 1 rank
    assert results[2]["peak"]["host_rss_bytes"] > results[1]["peak"]["host_rss_bytes"]


def test_the_harness_gives_each_rank_its_share_of_the_cores(monkeypatch):
    """Not torchrun's one OpenMP thread a worker (a baseline's CPU Adam would run serially); a
    user's own OMP_NUM_THREADS is kept."""
    from suite.runner import worker_env
    from suite.spec import RunSpec
    monkeypatch.setattr(os, "cpu_count", lambda: 32)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    spec = dict(system="zero3", model={"preset": "tiny-llama"}, seq_len=32, batch_size=4)
    assert worker_env(RunSpec(**spec, gpus=2))["OMP_NUM_THREADS"] == "16"
    assert worker_env(RunSpec(**spec, gpus=4))["OMP_NUM_THREADS"] == "8"
    assert "OMP_NUM_THREADS" not in worker_env(RunSpec(**spec, gpus=1))  # one process: torch's own default
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert worker_env(RunSpec(**spec, gpus=2))["OMP_NUM_THREADS"] == "3"


def test_every_system_takes_the_same_rows_of_a_global_batch():
    """Rows rank, rank + N, ...: every field alike, and the ranks' rows together the whole batch."""
    from megatrain.batch import Batch
    from megatrain.distributed import shard_batch
    ids = torch.arange(6 * 4).view(6, 4)
    batch = Batch(ids, ids + 100, torch.ones_like(ids), ids % 4)
    parts = [shard_batch(batch, Ranks(r, 3, r, 3)) for r in range(3)]
    assert parts[1].input_ids[:, 0].tolist() == [4, 16]
    for shard in parts:
        assert torch.equal(shard.labels, shard.input_ids + 100) and torch.equal(shard.position_ids, shard.input_ids % 4)
    assert sorted(torch.cat([p.input_ids for p in parts])[:, 0].tolist()) == ids[:, 0].tolist()
    assert shard_batch(batch, Ranks()) is batch


@pytest.mark.parametrize("env, cuda, message", [
    (dict(WORLD_SIZE="2", RANK="0", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2"), 1, "2 ranks on this host but 1 GPU"),
    (dict(WORLD_SIZE="4", RANK="0", LOCAL_RANK="0", LOCAL_WORLD_SIZE="4"), 4, "gpus 2, but 4 rank"),
])
def test_the_worker_refuses_ranks_it_cannot_run_before_building_anything(env, cuda, message, monkeypatch):
    """For every system alike, on every rank alike: more ranks than GPUs, or not the spec's ranks."""
    from suite import worker
    from suite.spec import RunSpec
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: cuda)
    built = []
    monkeypatch.setattr(worker, "load", lambda name: built.append(name))
    spec = RunSpec(system="fsdp2", model={"preset": "tiny-llama"}, seq_len=32, batch_size=2, gpus=2)
    with pytest.raises(ValueError, match=message):
        worker.run(spec, None)
    assert built == []


def test_a_tile_is_ready_once_every_owner_has_published_its_update():
    """Flags: the reader's own part published is not enough; the peer's counter must reach it."""
    import threading
    import time
    from megatrain.distributed import Flags
    memory = torch.zeros(Flags.nbytes(2, 2), dtype=torch.uint8)
    mine, peer = Flags(memory, ["embed", "layer.0"], 0), Flags(memory, ["embed", "layer.0"], 1)
    assert mine.ready("layer.0")
    mine.mark("layer.0")
    assert not mine.ready("layer.0") and peer.ready("layer.0") and mine.ready("embed")
    later = threading.Timer(0.2, peer.mark, ["layer.0"])
    later.start()
    start = time.perf_counter()
    mine.wait("layer.0")
    assert time.perf_counter() - start > 0.1 and mine.ready("layer.0")
    later.join()


def test_megatrain_plan_for_two_gpus(tmp_path, capsys):
    """`megatrain plan --gpus 2`: the plan of one host's ranks, or the refusal, before anything runs."""
    from megatrain.cli import main
    tiny_checkpoint(tmp_path / "init", "tiny-llama")
    path = tmp_path / "run.yaml"
    path.write_text(json.dumps(settings(tmp_path)))
    assert main(["plan", "--config", str(path), "--gpus", "2"]) == 0
    report = capsys.readouterr().out
    assert "2 data-parallel ranks (2 per host, sharing its host store), 2 rows" in report and "fits" in report
    assert main(["plan", "--config", str(path), "--gpus", "3"]) == 2
    assert "does not split over 3 ranks" in capsys.readouterr().err

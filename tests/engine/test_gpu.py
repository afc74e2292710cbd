"""GPU checks (skipped without CUDA): the bf16 streamed run tracks the float32 CPU reference, and
the streaming switches (buffers, slabs, K, checkpoint offload, layers kept from recompute, attention
kept for the recompute) change the schedule but not one bit of the numerics."""
from __future__ import annotations

import contextlib
import os
import warnings

import pytest
import torch

from helpers import Reference, random_batches, store_params, tiny_checkpoint
from megatrain.config import load_config
from megatrain.trainer import Trainer

pytestmark = pytest.mark.gpu
SEQ, BATCH, STEPS = 64, 4, 20
OVERRIDES = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4, "head_dim": 32,
             "num_hidden_layers": 4}
EAGER = {"norm_kernel": "eager", "mlp_kernel": "eager", "loss_kernel": "eager", "rotary_kernel": "eager"}  # the library's kernels (the GPU's default compiles them)


def gpu_tree(tmp_path, **engine) -> dict:
    """A tiny run streaming every tile from the host (`device_tiles: 0`; the default, auto, would keep
    all of a tiny model's state on the GPU, leaving nothing to stream or update on the host)."""
    return {
        "model": {"pretrained": str(tmp_path / "init")},
        "engine": {"device": "cuda", "checkpoint_every": 2, "loss_chunk_tokens": 96, "device_tiles": 0, **engine},
        "optim": {"lr": 1e-3, "max_grad_norm": 1.0, "warmup_steps": 2},
        "data": {"seq_len": SEQ, "batch_size": BATCH, "grad_accum": 2},
        "steps": STEPS,
    }


def gpu_trainer(tmp_path, **engine):
    cfg = load_config(base=gpu_tree(tmp_path, **engine))
    return cfg, Trainer(cfg)


def train(tmp_path, engine: dict, steps: int = 3) -> tuple[list[float], dict]:
    """`engine` trained from the saved init on `steps` fixed steps of batches: the losses and final weights."""
    _, trainer = gpu_trainer(tmp_path, **engine)
    try:
        return [trainer.train_step(mbs)["loss"] for mbs in random_batches(steps, 2, BATCH, SEQ, 256, pad=True)], \
            store_params(trainer)
    finally:
        trainer.close()


def base_and(tmp_path, engine: dict, steps: int = 3) -> list[tuple[list[float], dict]]:
    """The default engine and `engine`, each trained as `train` does."""
    return [train(tmp_path, {}, steps), train(tmp_path, engine, steps)]


def assert_same_direction(start: dict, runs) -> None:
    """Adam turns rounding noise in near-zero gradients into lr-sized steps: compare the updates' direction."""
    moved = [torch.cat([(params[k] - start[k]).flatten() for k in params if k in start]) for _, params in runs]
    assert torch.nn.functional.cosine_similarity(*moved, dim=0) > 0.99


# the dense families beyond the Llama layout, at OVERRIDES' size (Gemma 3's layer types for 4 layers)
DENSE = {"tiny-qwen2": OVERRIDES, "tiny-phi3": OVERRIDES, "tiny-gemma2": OVERRIDES,
         "tiny-gemma3": {**OVERRIDES, "layer_types": ["sliding_attention", "full_attention"] * 2}}


@pytest.mark.parametrize("preset", list(DENSE))
def test_bf16_gpu_tracks_float32_reference(tmp_path, cuda_only, preset):
    """bf16 streamed training against the library's float32 model on the CPU. The reference runs eager
    attention where the GPU's run takes flex attention (Gemma 2's soft-capping), which the CPU
    cannot differentiate."""
    model = tiny_checkpoint(tmp_path / "init", preset, DENSE[preset])
    if model.config._attn_implementation == "flex_attention":
        model.set_attn_implementation("eager")
    start = {k: v.clone() for k, v in model.state_dict().items()}
    cfg, trainer = gpu_trainer(tmp_path)
    reference = Reference(model, cfg.optim, STEPS)
    batches = random_batches(1, 2, BATCH, SEQ, trainer.shape.vocab, pad=True)[0]  # one batch, repeated
    try:
        losses, ref_losses = [], []
        for _ in range(STEPS):
            losses.append(trainer.train_step(batches)["loss"])
            ref_losses.append(reference.step(batches)[0])
        params = store_params(trainer)
    finally:
        trainer.close()
    # bf16 weights and activations: about 3 significant digits per op; 1% on the loss is bf16 tolerance
    torch.testing.assert_close(losses, ref_losses, rtol=1e-2, atol=0)
    assert ref_losses[-1] < ref_losses[0] - 0.5, "the reference should learn the repeated batch"
    # the updates point the same way as the reference's
    moved = torch.cat([(params[k] - start[k]).flatten() for k in start if k in params])
    ref_moved = torch.cat([(model.state_dict()[k] - start[k]).flatten() for k in start if k in params])
    cosine = torch.nn.functional.cosine_similarity(moved, ref_moved, dim=0)
    assert cosine > 0.9, f"update direction differs from the reference: cosine {cosine:.3f}"


@pytest.mark.parametrize("engine", [{"weight_buffers": 1}, {"grad_slabs": 0}, {"checkpoint_every": 1},
                                    {"checkpoint_every": 3, "weight_buffers": 3, "grad_slabs": 1},
                                    {"offload_checkpoints": True, "checkpoint_every": 2},
                                    {"no_recompute_layers": 3, "offload_checkpoints": True}])
def test_streaming_switches_keep_numerics(tmp_path, cuda_only, engine):
    tiny_checkpoint(tmp_path / "init", "tiny-qwen2", OVERRIDES)
    runs = base_and(tmp_path, engine)
    torch.testing.assert_close(runs[0], runs[1], rtol=0, atol=0)


@pytest.mark.parametrize("stage", [None, 1000])
def test_whole_masters_cast_on_the_device_keep_numerics(tmp_path, cuda_only, monkeypatch, stage):
    """Whole float32 masters (engine.split_masters: false) stream as they are and are cast to bf16
    on the device (buffers.py), in chunks of buffers.STAGE elements (here also 1000, which divides
    no tile: many chunks a load, and a short last one): training is the split default's, whose
    loads move the shadow the host cast, to the bit."""
    import megatrain.buffers
    if stage:
        monkeypatch.setattr(megatrain.buffers, "STAGE", stage)
    tiny_checkpoint(tmp_path / "init", "tiny-qwen2", OVERRIDES)
    runs = base_and(tmp_path, {"split_masters": False})
    torch.testing.assert_close(runs[0], runs[1], rtol=0, atol=0)


def test_embedding_copies_wait_for_the_compute_stream(tmp_path, cuda_only, monkeypatch):
    """Gemma's scaled embedding frees a micro-batch's copied rows at once, and the next micro-batch's
    rows may be copied into that memory: the copy must wait until the compute stream has read it.
    With the compute stream held back before each micro-batch's embedding (a sleep on it, ~25 ms),
    training is the run's without, to the bit."""
    from megatrain.engine import Engine
    tiny_checkpoint(tmp_path / "init", "tiny-gemma3", DENSE["tiny-gemma3"])
    base = train(tmp_path, {})
    embed = Engine._embed

    def held_back(self, ids):
        torch.cuda._sleep(50_000_000)  # on the compute stream, the step's current one
        return embed(self, ids)
    monkeypatch.setattr(Engine, "_embed", held_back)
    held = train(tmp_path, {})
    torch.testing.assert_close(held, base, rtol=0, atol=0)


@pytest.mark.parametrize("engine", [{"checkpoint_every": 2}, {"checkpoint_every": 1, "no_recompute_layers": 1}])
def test_kept_attention_keeps_numerics(tmp_path, cuda_only, monkeypatch, engine):
    """Recomputed layers that take their attention's output and log-sum-exp from the forward
    (kept_attention.py: the kernel SDPA picks, flash attention or cuDNN, and that kernel's backward)
    against recomputing it, on unpadded batches: not one bit apart. `auto` keeps it in every
    recomputed layer (a tiny model, the GPU's free memory), and every such layer and micro-batch
    takes it."""
    import megatrain.kept_attention as kept_attention
    tiny_checkpoint(tmp_path / "init", "tiny-qwen2", OVERRIDES)
    reused = []
    forward = kept_attention._Reused.forward
    monkeypatch.setattr(kept_attention._Reused, "forward", staticmethod(lambda *a: reused.append(1) or forward(*a)))
    runs = []
    for keep in ("auto", 0):
        _, trainer = gpu_trainer(tmp_path, **engine, keep_attention_layers=keep)
        try:
            recomputed = OVERRIDES["num_hidden_layers"] - trainer.settings.no_recompute_layers
            assert trainer.settings.keep_attention_layers == (recomputed if keep == "auto" else 0)
            batches = random_batches(3, 2, BATCH, SEQ, trainer.shape.vocab, pad=False)
            runs.append(([trainer.train_step(mbs)["loss"] for mbs in batches], store_params(trainer)))
        finally:
            trainer.close()
    assert len(reused) == 3 * 2 * recomputed
    torch.testing.assert_close(runs[0], runs[1], rtol=0, atol=0)


def test_offloaded_attention_keeps_numerics(tmp_path, cuda_only):
    """engine.offload_attention with the device bounded (engine.device_memory_gb) to hold one layer's
    kept attention: the other three keep theirs in pinned host memory, their output and log-sum-exp
    across the link once each way a step, and the run is the recompute's to the bit."""
    from dataclasses import replace
    from megatrain import kept_attention, memory
    from megatrain.units import GiB
    tiny_checkpoint(tmp_path / "init", "tiny-qwen2", OVERRIDES)
    batches = random_batches(3, 2, BATCH, SEQ, 256, pad=False)

    def run(**engine):
        _, trainer = gpu_trainer(tmp_path, no_recompute_layers=0, **engine)
        try:
            steps = [trainer.train_step(mbs) for mbs in batches]
            assert not trainer.engine.attention.kept
            return ([m["loss"] for m in steps], store_params(trainer)), \
                (steps[-1]["bytes_h2d"], steps[-1]["bytes_d2h"]), trainer.shape, trainer.settings
        finally:
            trainer.close()
    recomputed, moved, shape, settings = run(keep_attention_layers=0)
    one = 2 * kept_attention.kept_bytes(shape, BATCH * SEQ, 2)  # a layer's, two micro-batches in bf16
    bound = memory.plan(shape, replace(settings, keep_attention_layers=1)).device_bytes + memory.DEVICE_WORKSPACE
    offloaded, moved_offloaded, _, settings = run(keep_attention_layers=4, offload_attention=True,
                                                  device_memory_gb=(bound + one // 2) / GiB)
    assert (settings.keep_attention_layers, settings.offloaded_attention_layers) == (4, 3)
    assert moved_offloaded == (moved[0] + 3 * one, moved[1] + 3 * one)
    torch.testing.assert_close(recomputed, offloaded, rtol=0, atol=0)


@pytest.mark.parametrize("engine", [{"device_tiles": 2}, {"device_tiles": "auto", "no_recompute_layers": "auto"}])
def test_device_tiles_track_host_tiles(tmp_path, cuda_only, engine):
    """Tiles updated on the device (CUDA's fused AdamW, the clip scale computed there) instead of by
    the host; with `auto` against the GPU's free memory a tiny model gets every tile on the device and
    every layer kept. After one step, the same weights and gradients went into both updates: only
    AdamW's float32 rounding differs (measured 7.5e-9 on the H100; an error would be lr = 1e-3).
    From the next step a weight one bf16 rounding apart changes the forward, and Adam turns the
    rounding noise of near-zero gradients into steps of up to lr on a few percent of the elements
    (measured: experiments/probes/device_tile_drift.py, results/h100/probes/engine/device_tile_drift.json),
    so after three steps the losses agree to 1e-4 and the updates point the same way."""
    start = tiny_checkpoint(tmp_path / "init", "tiny-qwen2", OVERRIDES).state_dict()
    if engine.get("device_tiles") == "auto":
        _, trainer = gpu_trainer(tmp_path, **engine)
        trainer.close()
        layers = OVERRIDES["num_hidden_layers"]
        assert (trainer.settings.device_tiles, trainer.settings.no_recompute_layers) == (layers + 1, layers)
    one = base_and(tmp_path, engine, steps=1)
    torch.testing.assert_close(one[0], one[1], rtol=0, atol=1e-7)
    runs = base_and(tmp_path, engine)
    torch.testing.assert_close(runs[0][0], runs[1][0], rtol=1e-4, atol=0)
    assert_same_direction(start, runs)


def test_chunked_mlp_tracks_the_whole_mlp(tmp_path, cuda_only):
    """The MLP over 40-token chunks (forward, and backward with the chunk recomputed) against the
    whole MLP, in bf16 on the device: matmuls of other shapes round differently, nothing more."""
    start = tiny_checkpoint(tmp_path / "init", "tiny-qwen2", OVERRIDES).state_dict()
    runs = base_and(tmp_path, {"mlp_chunk_tokens": 40})
    torch.testing.assert_close(runs[0][0], runs[1][0], rtol=2e-3, atol=0)
    assert_same_direction(start, runs)


def test_chunked_norms_track_whole_norms(tmp_path, cuda_only, monkeypatch):
    """The decoder layers' norms over 40-token chunks (64K in real runs) against whole norms, in bf16
    on the device: outputs and input gradients are row-wise (unchanged), the weights' gradients sum
    chunks in float32, so only rounding differs."""
    import megatrain.lean_norm
    start = tiny_checkpoint(tmp_path / "init", "tiny-qwen2", OVERRIDES).state_dict()
    whole = train(tmp_path, {})
    monkeypatch.setattr(megatrain.lean_norm, "CHUNK", 40)
    monkeypatch.setattr(megatrain.lean_norm, "NARROW", 1)  # chunks of rows, whatever their width
    runs = [whole, train(tmp_path, {})]
    torch.testing.assert_close(runs[0][0], runs[1][0], rtol=2e-3, atol=0)
    assert_same_direction(start, runs)


def test_unread_down_projection_keeps_numerics(tmp_path, cuda_only, monkeypatch):
    """The recompute of a block's last layer leaving its MLP's down projection out (unread_mlp.py)
    against computing it, in bf16 on the device: the same gradient matmuls, not one bit apart."""
    import contextlib

    import megatrain.engine
    tiny_checkpoint(tmp_path / "init", "tiny-qwen2", OVERRIDES)
    skipped = train(tmp_path, {})
    monkeypatch.setattr(megatrain.engine, "output_unused", contextlib.nullcontext)
    torch.testing.assert_close(skipped, train(tmp_path, {}), rtol=0, atol=0)


def test_timeline_times_the_gpu_steps_and_traces_them(tmp_path, cuda_only):
    """On the GPU the timeline reads CUDA events for the streams and host clocks for the optimizer:
    each step's breakdown is within the step, nothing in it negative, the copies both ways and the
    optimizer seen; the trace holds every layer's passes and the last step's updates."""
    import json
    tiny_checkpoint(tmp_path / "init", "tiny-qwen2", OVERRIDES)
    _, trainer = gpu_trainer(tmp_path)
    try:
        for mbs in random_batches(3, 2, BATCH, SEQ, 256, pad=True):
            e = trainer.train_step(mbs)["exposed"]
            assert min(e.values()) >= 0, e
            assert 0 < e["gpu_busy_s"] <= e["step_s"] and e["optimizer_exposed_s"] <= e["host_blocked_on_optimizer_s"]
            assert e["h2d_busy_s"] > 0 and e["d2h_busy_s"] > 0 and e["optimizer_busy_s"] > 0
        trainer.write_trace(tmp_path / "trace.json")
    finally:
        trainer.close()
    spans = [e for e in json.loads((tmp_path / "trace.json").read_text())["traceEvents"] if e["ph"] == "X"]
    assert all(e["dur"] >= 0 for e in spans)
    names = {e["name"] for e in spans}
    layers = OVERRIDES["num_hidden_layers"]
    assert {f"forward L{layers - 1}", "head", "recompute L0", "backward L0", "load layer.0"} <= names
    assert any(e["cat"] == "update" and e["name"].startswith("update layer.0 [") for e in spans)


def test_suite_run_forks_a_worker_that_trains_on_the_gpu(cuda_only, tmp_path):
    """`suite run` asks NVML, not CUDA, whether there is a GPU, so its worker is forked from its
    imports and still takes the GPU (a runner that touched CUDA would leave it a fresh worker)."""
    import json
    import subprocess
    import sys
    out = tmp_path / "r.json"
    done = subprocess.run([sys.executable, "-m", "suite", "run", "--system", "megatrain", "--preset", "tiny-llama",
                           "--seq", "32", "--batch", "2", "--steps", "2", "--warmup", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    r = json.loads(out.read_text())
    assert done.returncode == 0 and r["status"] == "ok", (done.stderr + r.get("log_tail", ""))[-3000:]
    assert r["forked"] and r["env"]["gpu"] and r["imported_s"] < 0.5
    # the link's yardsticks beside the matmul's: a PCIe or NVLink-C2C link moves more than 5 GB/s
    assert r["env"]["h2d_gbps"] > 5 and r["env"]["d2h_gbps"] > 5, r["env"]


def test_the_link_measure_leaves_no_memory_behind(cuda_only):
    """The worker's link measure registers its host buffer and releases it and the device's."""
    from megatrain.metrics import link_gbps
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # what earlier tests left cached, which the measure's own empty_cache would free
    reserved, pinned = torch.cuda.memory_reserved(), torch.cuda.host_memory_stats().get("allocated_bytes.all.current", 0)
    rates = link_gbps(torch.device("cuda"))
    assert set(rates) == {"h2d_gbps", "d2h_gbps"} and min(rates.values()) > 5, rates
    assert torch.cuda.memory_reserved() == reserved
    assert torch.cuda.host_memory_stats().get("allocated_bytes.all.current", 0) == pinned


def test_allocator_uses_expandable_segments(cuda_only, monkeypatch):
    """Without the user's PYTORCH_CUDA_ALLOC_CONF the engine's device grows expandable segments (the
    fixed ones fragmented by 10 GiB at 128K tokens)."""
    from megatrain.device import Device
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    Device("cuda")
    torch.cuda.empty_cache()  # a new segment, not one an earlier test left cached
    x = torch.empty(64 << 20, device="cuda")
    segments = [s for s in torch.cuda.memory_snapshot() if s["address"] <= x.data_ptr() < s["address"] + s["total_size"]]
    assert segments and segments[0]["is_expandable"]


@pytest.mark.parametrize("system", ["native", "fsdp2"])
def test_baselines_grow_expandable_segments(cuda_only, monkeypatch, system):
    """PyTorch native's and FSDP2's allocators grow expandable segments too, unless the user's
    PYTORCH_CUDA_ALLOC_CONF says otherwise (native's fixed ones refused 7B's logits at 4 x 4096 on an
    H200 with 22 GiB of the cache free in pieces; FSDP2's `auto` leaves less slack for them)."""
    from suite.spec import RunSpec
    from suite.system import load
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    with warnings.catch_warnings():  # torch 2.11 names a newer private twin of this call
        warnings.simplefilter("ignore", FutureWarning)
        torch.cuda.memory._set_allocator_settings("expandable_segments:False")  # as a fresh process has it
    spec = RunSpec.from_dict({"system": system, "model": {"preset": "tiny-llama"}, "seq_len": 16, "batch_size": 1})
    run = load(system)(spec, torch.device("cuda", torch.cuda.current_device()))  # FSDP2 joins its group on it
    try:
        torch.cuda.empty_cache()
        x = torch.empty(64 << 20, device="cuda")
        segments = [s for s in torch.cuda.memory_snapshot() if s["address"] <= x.data_ptr() < s["address"] + s["total_size"]]
        assert segments and segments[0]["is_expandable"]
    finally:
        run.close()


@pytest.mark.alone  # reads the device's free memory, which another test's process moves
def test_free_bytes_count_what_a_closed_run_left_cached(cuda_only):
    """A second run in one process (a probe's variants, a notebook) is admitted against the memory
    the first one's allocator keeps cached, not refused for it."""
    from megatrain.device import Device
    device = Device("cuda")
    before = device.free_bytes()
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    del x  # cached by the allocator, free to the driver no longer
    assert torch.cuda.mem_get_info()[0] < before - (1 << 29)
    assert device.free_bytes() >= before - (64 << 20)


def test_a_closed_deepspeed_run_leaves_the_process_as_it_found_it(cuda_only):
    """DeepSpeed's one-process group is made of environment variables and of group references of its
    own, and transformers builds every later model under zero.Init while it can see a DeepSpeed
    config: after `close` none is left, so the next run in this process (ZeRO-3's again, then
    FSDP2's, each built while the one before still exists) builds as it would alone."""
    pytest.importorskip("deepspeed")
    from suite.spec import RunSpec
    from suite.system import load
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    before = {k: os.environ.get(k) for k in keys}
    device = torch.device("cuda", torch.cuda.current_device())
    runs = []
    for name in ("zero3", "zero3", "fsdp2"):
        spec = RunSpec.from_dict({"system": name, "model": {"preset": "tiny-llama"}, "seq_len": 16, "batch_size": 1})
        runs.append(load(name)(spec, device))
        runs[-1].close()
        assert {k: os.environ.get(k) for k in keys} == before
        assert not is_deepspeed_zero3_enabled()


MOE = {"tiny-gpt-oss": {"hidden_size": 128, "intermediate_size": 64, "num_local_experts": 8, "head_dim": 32},
       "tiny-qwen3-moe": {"hidden_size": 128, "moe_intermediate_size": 64, "num_experts": 8, "head_dim": 32,
                          "num_hidden_layers": 4},
       "tiny-mixtral": {"hidden_size": 128, "intermediate_size": 64, "num_local_experts": 8, "head_dim": 32,
                        "num_hidden_layers": 4},
       # a dense layer and 3 MoE ones (8 experts, a shared one); V3's correction biases (drawn nonzero)
       # float32 beside the bf16 weights, as the library's bf16 model keeps them
       "tiny-deepseek-v3": {"hidden_size": 128, "moe_intermediate_size": 64},
       "tiny-deepseek-v2": {"hidden_size": 128, "moe_intermediate_size": 64}}


@pytest.mark.parametrize("preset", list(MOE))
def test_moe_bf16_gpu_tracks_float32_reference(tmp_path, cuda_only, preset):
    """A mixture of experts (8 experts, 2 per token, the router's loss on) in bf16 against the
    library's float32 model on the CPU, as the dense bf16 check: losses within bf16 tolerance and the
    updates pointing the same way. The reference runs eager attention: on a machine with a GPU the
    library picks flex attention for GPT-OSS, which its CPU model cannot run."""
    model = tiny_checkpoint(tmp_path / "init", preset, MOE[preset])
    model.set_attn_implementation("eager")
    start = {k: v.clone() for k, v in model.state_dict().items()}
    cfg, trainer = gpu_trainer(tmp_path)
    reference = Reference(model, cfg.optim, STEPS)
    batches = random_batches(1, 2, BATCH, SEQ, trainer.shape.vocab, pad=True)[0]
    try:
        losses, ref_losses = [], []
        for _ in range(STEPS):
            losses.append(trainer.train_step(batches)["loss"])
            ref_losses.append(reference.step(batches)[0])
        params = store_params(trainer)
    finally:
        trainer.close()
    torch.testing.assert_close(losses, ref_losses, rtol=2e-2, atol=0)  # bf16, and routing ties may flip
    moved = torch.cat([(params[k] - start[k]).flatten() for k in start if k in params])
    ref_moved = torch.cat([(model.state_dict()[k] - start[k]).flatten() for k in start if k in params])
    assert torch.nn.functional.cosine_similarity(moved, ref_moved, dim=0) > 0.9


@pytest.mark.parametrize("preset", list(MOE))
@pytest.mark.parametrize("engine", [{"checkpoint_every": 1}, {"weight_buffers": 1, "grad_slabs": 0},
                                    {"no_recompute_layers": 2, "offload_checkpoints": True}])
def test_moe_streaming_switches_keep_numerics(tmp_path, cuda_only, preset, engine):
    """The streaming switches leave a mixture of experts' numerics as they leave a dense model's,
    bit for bit, with the GPU's defaults (the compiled norms, the lean experts and their compiled
    gate, the compiled rotary and sinks' product)."""
    tiny_checkpoint(tmp_path / "init", preset, MOE[preset])
    runs = base_and(tmp_path, engine)
    torch.testing.assert_close(runs[0], runs[1], rtol=0, atol=0)


def experts_on_gpu(preset: str, gate: bool):
    """A tiny preset's library experts in bf16 on the GPU (weights drawn at 0.05), their lean copy
    (with its compiled gate where `gate`), 4096 tokens' rows, the router's picks and weights, and an
    output gradient."""
    import copy
    import importlib
    from megatrain import lean_experts
    from megatrain.config import ModelConfig
    from megatrain.shapes import load_hf_config
    hf = load_hf_config(ModelConfig(preset=preset, overrides=MOE[preset]), cuda=True)
    modeling = importlib.import_module(f"transformers.models.{hf.model_type}.modeling_{hf.model_type}")
    cls = next(getattr(modeling, n) for n in dir(modeling) if n.endswith("Experts"))
    torch.manual_seed(0)
    library = cls(hf).to("cuda", torch.bfloat16)
    for p in library.parameters():
        torch.nn.init.normal_(p, std=0.05)
    lean = copy.deepcopy(library)
    lean_experts.make_lean(lean, lean_experts.gate_kind(hf.model_type, hf.hidden_act) if gate else None)
    x = torch.randn(4096, hf.hidden_size, device="cuda", dtype=torch.bfloat16)
    weights, index = torch.topk(torch.randn(4096, library.num_experts, device="cuda").softmax(-1), hf.num_experts_per_tok)
    return library, lean, x, index, weights.to(torch.bfloat16), torch.randn_like(x)


@pytest.mark.parametrize("preset", list(MOE))
@pytest.mark.parametrize("gate", [False, True], ids=["library-gate", "compiled-gate"])
def test_lean_experts_compute_the_library_experts_in_bf16(cuda_only, preset, gate):
    """engine.experts_kernel: lean (the GPU's default for a mixture of experts) against the library's
    grouped-GEMM experts on the device in bf16, 4096 tokens, both measured against the library's
    experts in float32: with the library's gate the forward bit for bit (the same kernels, the
    sentinel masks and the gathers' backward apart); the gradients (the tokens' k rows summed in
    float32 at once, where autograd's scatter adds them in bf16 one by one; the biases' rows as one
    segment sum) and, with the compiled gate (engine.mlp_kernel, the GPU's default: float32 inside
    the kernel), the forward too, no further from float32 than the library's own bf16 results."""
    import copy
    library, lean, x, index, weights, grad = experts_on_gpu(preset, gate)
    exact = copy.deepcopy(library).float()
    runs = []
    for module, dtype in ((exact, torch.float32), (library, torch.bfloat16), (lean, torch.bfloat16)):
        xi, wi = x.to(dtype).clone().requires_grad_(), weights.to(dtype).clone().requires_grad_()
        out = module(xi, index, wi)
        out.backward(grad.to(dtype))
        runs.append([t.float() for t in (out, xi.grad, wi.grad, *(p.grad for p in module.parameters()))])
    assert gate or torch.equal(runs[1][0], runs[2][0])
    for truth, theirs, ours in zip(*runs):
        assert (ours - truth).norm() <= 1.5 * (theirs - truth).norm() + 1e-6 * truth.norm()


@pytest.mark.parametrize("preset", list(MOE))
def test_lean_experts_never_wait_for_the_device(cuda_only, preset):
    """The lean experts' forward and backward with the GPU's defaults (the compiled gate; GPT-OSS's
    biases in Triton) issue without the host waiting for the device: a wait there stalls the issue
    of the layer's later kernels (torch's sync debug mode raises at one; torch's segment sum, for
    one, checks its lengths on the host unless told not to)."""
    _, lean, x, index, weights, grad = experts_on_gpu(preset, gate=True)

    def step():
        xi, wi = x.clone().requires_grad_(), weights.clone().requires_grad_()
        lean(xi, index, wi).backward(grad)
    step()  # builds the kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("preset", ["tiny-qwen2", "tiny-gpt-oss"])
def test_a_closed_trainer_is_freed_once_dropped(tmp_path, cuda_only, preset):
    """After steps with the GPU's compiled kernels (the norms, the MLP or the lean experts' gate, the
    loss, the host AdamW), a closed trainer, once dropped, leaves its host store to be freed, as on
    the CPU (tests/training/test_run_outputs.py). The layer probe, one trainer per variant in one process,
    found the earlier trainers' host memory not all given back on a GPU host
    (results/h200/probes/layer_probe_exits.txt); the referrers are named if the store outlives it."""
    import gc
    import weakref
    tiny_checkpoint(tmp_path / "init", preset, OVERRIDES if preset == "tiny-qwen2" else MOE[preset])
    _, trainer = gpu_trainer(tmp_path)
    try:
        for mbs in random_batches(2, 2, BATCH, SEQ, 256, pad=True):
            trainer.train_step(mbs)
    finally:
        trainer.close()
    store, engine = weakref.ref(trainer.store), weakref.ref(trainer.engine)
    del trainer
    gc.collect()
    held = [o for o in (store(), engine()) if o is not None]
    assert not held, [[type(r).__name__ + ":" + str(r)[:80] for r in gc.get_referrers(o)] for o in held]


def two_gpus() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")


@pytest.mark.parametrize("preset", ["tiny-qwen2", "tiny-gpt-oss", "tiny-qwen3-moe", "tiny-mixtral", "tiny-deepseek-v3",
                                    "tiny-deepseek-v2"])
def test_two_gpus_track_one_gpu(tmp_path, cuda_only, preset):
    """Data-parallel MegaTrain on 2 GPUs (torchrun, NCCL, one shared host store) against 1 GPU with
    the same global batch, 20 steps: bf16 matmuls over 2 rows instead of 4 round differently, so the
    losses agree within bf16 tolerance and the updates point the same way; the two ranks report the
    same losses (one global step). The mixtures of experts with a router loss (all but DeepSeek's)
    train with it, its routing counts summed over the ranks (moe.py), and eager attention: flex
    attention, GPT-OSS's default on a GPU, takes minutes to build in each of the three processes."""
    from helpers import torchrun
    two_gpus()
    model = tiny_checkpoint(tmp_path / "init", preset, OVERRIDES if preset == "tiny-qwen2" else MOE[preset])
    if preset in ("tiny-gpt-oss", "tiny-qwen3-moe", "tiny-mixtral"):
        assert model.config.output_router_logits
    start = {k: v.clone() for k, v in model.state_dict().items()}
    batches = random_batches(STEPS, 2, BATCH, SEQ, model.config.vocab_size, pad=True)
    torch.save(batches, tmp_path / "batches.pt")
    tree = gpu_tree(tmp_path)
    if preset != "tiny-qwen2":
        tree["model"]["attn_implementation"] = "eager"
    trainer = Trainer(load_config(base=tree))
    try:
        losses = [trainer.train_step(mbs)["loss"] for mbs in batches]
        params = store_params(trainer)
    finally:
        trainer.close()
    reports = torchrun(tmp_path, tree, str(tmp_path / "batches.pt"), "two")
    rtol, cosine = (1e-2, 0.99) if preset == "tiny-qwen2" else (2e-2, 0.9)  # routing ties may flip, as in the bf16 check
    assert reports[0]["losses"] == reports[1]["losses"]
    torch.testing.assert_close(reports[0]["losses"], losses, rtol=rtol, atol=0)
    two = torch.load(tmp_path / "two" / "params-host0.pt")
    moved = torch.cat([(params[k] - start[k]).flatten() for k in start if k in params])
    two_moved = torch.cat([(two[k] - start[k]).flatten() for k in start if k in params])
    assert torch.nn.functional.cosine_similarity(moved, two_moved, dim=0) > cosine


@pytest.mark.parametrize("system", ["megatrain", "fsdp2", "zero3"])
def test_harness_on_two_gpus_tracks_one_gpu(tmp_path, cuda_only, system):
    """A point on 2 GPUs under the harness's torchrun (each rank its rows of the same global batch)
    against the point on 1: the losses agree up to bf16 kernels that differ with the per-GPU batch."""
    from suite.runner import run_point
    from suite.spec import RunSpec
    two_gpus()
    if system == "zero3":
        pytest.importorskip("deepspeed")
    losses = {}
    for gpus in (1, 2):
        spec = RunSpec(system=system, model={"preset": "tiny-qwen2", "overrides": OVERRIDES}, seq_len=SEQ,
                       batch_size=BATCH, grad_accum=2, steps=3, max_steps=3, warmup=1, timeout_s=600.0, gpus=gpus)
        r = run_point(spec, tmp_path / f"{system}{gpus}.json")
        assert r["status"] == "ok", r.get("log_tail")
        losses[gpus] = [s["loss"] for s in r["steps"]]
    torch.testing.assert_close(losses[2], losses[1], rtol=1e-2, atol=0)


@pytest.mark.parametrize("engine", [{**EAGER, "norm_kernel": "compiled"}, {**EAGER, "mlp_kernel": "compiled"},
                                    {**EAGER, "loss_kernel": "compiled"}, {**EAGER, "rotary_kernel": "compiled"}])
def test_compiled_kernels_track_eager_kernels(tmp_path, cuda_only, engine):
    """engine.norm_kernel, engine.mlp_kernel, engine.loss_kernel and engine.rotary_kernel: compiled (torch.compile's
    fused kernels, forward and backward; the GPU's default) against the library's eager ops, in bf16 on the device over
    20 steps: rounding apart (their products stay in float32 where the library's round to bf16),
    within bf16 tolerance."""
    start = tiny_checkpoint(tmp_path / "init", "tiny-qwen2", OVERRIDES).state_dict()
    runs = [train(tmp_path, EAGER, STEPS), train(tmp_path, engine, STEPS)]
    torch.testing.assert_close(runs[0][0], runs[1][0], rtol=1e-2, atol=0)
    # over 20 steps Adam turns the kernels' rounding differences in near-zero gradients into steps of
    # up to lr: the updates' direction as the float32 reference test bounds it
    moved = [torch.cat([(params[k] - start[k]).flatten() for k in params if k in start]) for _, params in runs]
    assert torch.nn.functional.cosine_similarity(*moved, dim=0) > 0.9


BUILD = """
import sys, psutil, torch
from megatrain import lean_norm, swiglu
x = torch.randn(4, 64, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
w = torch.ones(128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
if sys.argv[1] == "engine":
    y = lean_norm._LeanRMSNorm.apply(x, w, 1e-6, False, True)
    out = swiglu.swiglu(y, y)
else:  # the same function by torch.compile itself: the control, inductor's own pool
    out = torch.compile(lean_norm._rms_norm, dynamic=True)(x, w, 1e-6)
out.float().sum().backward()
torch.cuda.synchronize()
print(len(psutil.Process().children(recursive=True)))
"""


def test_compiled_kernels_build_without_compile_workers(tmp_path, cuda_only):
    """The engine's compiled kernels (a norm and the MLP product, forward and backward) built in a
    fresh process with an empty inductor cache start no compile worker (kernel_build.py); the same
    norm by torch.compile itself, the control, starts inductor's pool."""
    import os
    import subprocess
    import sys
    children = {}
    for how in ("engine", "control"):
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / how), "TRITON_CACHE_DIR": str(tmp_path / how / "triton")}
        done = subprocess.run([sys.executable, "-c", BUILD, how], env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        children[how] = int(done.stdout.split()[-1])
    assert children["engine"] == 0 and children["control"] > 0, children


def _page_locked(t: torch.Tensor) -> bool:
    """Whether CUDA holds `t`'s first byte page-locked: cudaPointerGetAttributes reads a registered
    host range as host memory, another as unregistered. Not `Tensor.is_pinned`: that asks about the
    first byte of the tensor's storage, and a store block starts up to a page into its storage (the
    test asking so failed on registered blocks: docs/log.md, 2026-11-23)."""
    import ctypes
    import ctypes.util
    path = next((line.split()[-1] for line in open("/proc/self/maps") if "libcudart" in line), None)
    cudart = ctypes.CDLL(path or ctypes.util.find_library("cudart"))
    attributes = (ctypes.c_int * 32)()  # cudaPointerAttributes, its first field the memory type
    assert cudart.cudaPointerGetAttributes(attributes, ctypes.c_void_p(t.data_ptr())) == 0
    return attributes[0] == 1  # cudaMemoryTypeHost


def test_store_shadows_are_pinned_at_their_size_until_close(tmp_path, cuda_only):
    """The shadows the device copies from, and with clipping the gradient buffers it copies into, are
    registered with CUDA (page-locked: DMA, no staging) at their exact size, and unregistered when
    the run closes; with clipping no gradient slab is allocated."""
    tiny_checkpoint(tmp_path / "init", "tiny-qwen2", OVERRIDES)
    _, trainer = gpu_trainer(tmp_path)  # clipping
    host = [t for t in trainer.store.tiles if not t.on_device]
    try:
        assert host and all(_page_locked(t.shadow) and _page_locked(t.grad) for t in host)
        assert len(trainer.store.blocks.registered) == 2 * len(host)
        assert not _page_locked(host[0].exp_avg)  # the optimizer's state is not registered
        assert trainer.engine.slabs._free.empty()
    finally:
        trainer.close()
    assert not any(_page_locked(t.shadow) or _page_locked(t.grad) for t in host)


def test_accumulate_add_is_the_library_add_on_the_gpu(cuda_only):
    """The step gradient's add on the GPU (accumulate.add_into: the Triton kernel) against torch's, to
    the bit: contiguous, a length no block divides, transposed (torch's add), and past 2**31
    elements (the kernel's offsets in 64 bits; GPT-OSS-120B's experts' gate-up projection holds 2.1
    billion)."""
    from megatrain.accumulate import add_into
    gen = torch.Generator(device="cuda").manual_seed(0)
    for shape, transposed in (((37, 24), False), ((24, 37), True), ((2**31 + 5,), False)):
        acc = torch.randn(shape, generator=gen, device="cuda")
        grad = torch.randn(shape[::-1] if transposed else shape, generator=gen, device="cuda").to(torch.bfloat16)
        grad = grad.t() if transposed else grad
        want = acc.clone().add_(grad)
        add_into(acc, grad)
        assert torch.equal(acc, want), shape
        del acc, grad, want


def test_accumulate_copy_is_the_library_copy_on_the_gpu(cuda_only):
    """The first micro-batch's gradient copied into the step gradient (accumulate.copy_into: the
    Triton kernel) against torch's copy, to the bit, -0.0 kept: contiguous, a length no block
    divides, transposed (torch's copy)."""
    from megatrain.accumulate import copy_into
    gen = torch.Generator(device="cuda").manual_seed(0)
    for shape, transposed in (((37, 24), False), ((24, 37), True), ((2**20 + 5,), False)):
        grad = torch.randn(shape[::-1] if transposed else shape, generator=gen, device="cuda").to(torch.bfloat16)
        grad.view(-1)[:3] = -0.0
        grad = grad.t() if transposed else grad
        acc = torch.full(shape, float("nan"), device="cuda")
        copy_into(acc, grad)
        want = torch.empty(shape, device="cuda").copy_(grad)
        assert torch.equal(acc.view(torch.int32), want.view(torch.int32))


def test_embedding_rows_add_in_one_order_on_the_gpu(cuda_only):
    """The embedding gradient's add (accumulate.add_rows) on the GPU, ids repeating as a batch's
    tokens do: the same bits in every run (index_add_ on the GPU adds with atomics in no fixed order),
    and each row within the serial sum's rounding bound of the exact sum: n additions of float32,
    n u (|start| + sum |row|), u = 2**-24."""
    from megatrain.accumulate import add_rows
    gen = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(0, 64, (8192,), generator=gen, device="cuda")
    rows = torch.randn(8192, 256, generator=gen, device="cuda")
    start = torch.randn(64, 256, generator=gen, device="cuda")
    runs = []
    for _ in range(5):
        table = start.clone()
        add_rows(table, ids, rows)
        runs.append(table)
    assert all(torch.equal(runs[0], r) for r in runs[1:])
    exact = start.double().index_add_(0, ids, rows.double())
    n = torch.bincount(ids, minlength=64).double().unsqueeze(1)
    bound = n * 2**-24 * start.double().abs().index_add_(0, ids, rows.double().abs())
    assert ((runs[0].double() - exact).abs() <= bound).all()


def _gpt_oss_expert_rows():
    """GPT-OSS's experts' rows at its expert width (2880, which no column block divides), 1031 tokens
    (which no row block divides) routed to 4 of 8 experts, bf16: the routing (sorted expert ids,
    counts, offsets, permutation and its inverse), the up projection's unbiased rows, its bias, the
    down projection (experts, in, out: GPT-OSS's transposed layout), its bias, the router's weights,
    the output's gradient, and the gate's constants."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    experts, width, tokens, k = 8, 2880, 1031, 4
    top = torch.rand(tokens, experts, generator=gen, device="cuda").topk(k)
    ids, perm = torch.sort(top.indices.reshape(-1))
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device="cuda")
    counts = torch.bincount(ids, minlength=experts)
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
    bf16 = lambda *shape: (4 * torch.randn(*shape, generator=gen, device="cuda")).to(torch.bfloat16)  # noqa: E731
    tensors = (bf16(ids.numel(), 2 * width), bf16(experts, 2 * width), bf16(experts, width, width) / 64,
               bf16(experts, width), top.values.softmax(-1).to(torch.bfloat16))
    return (ids, counts, offsets, perm, inv), tensors, bf16(tokens, width), (7.0, 1.702)


def test_gpt_oss_experts_with_an_unread_output_leave_the_gate_out_on_the_gpu(cuda_only, monkeypatch):
    """Where nothing reads the experts' output (a recomputed block's last layer: unread_mlp.py), GPT-OSS's
    experts on the GPU run neither the down projection's GEMM nor the gate's forward kernel (the
    backward makes the gate's output again), and their gradients are those of the run that reads
    the output, to the bit."""
    from megatrain import expert_bias, lean_experts
    from megatrain.unread_mlp import output_unused
    routing, tensors, g_out, gate = _gpt_oss_expert_rows()
    ids, counts, offsets, perm, inv = routing
    ran = []
    monkeypatch.setattr(expert_bias, "gate", lambda *a, gate=expert_bias.gate: ran.append(1) or gate(*a))
    grads = []
    for unused in (False, True):
        y1, b1, w_down, b2, w = (t.clone().requires_grad_() for t in tensors)
        ran.clear()
        with output_unused() if unused else contextlib.nullcontext():
            out = lean_experts._DownCombine.apply(y1, w_down, b2, ids, counts, offsets, w, perm, inv, True, b1, gate)
        assert len(ran) == (0 if unused else 1)
        torch.autograd.backward(out, g_out)
        grads.append((y1.grad, b1.grad, w_down.grad, b2.grad, w.grad))
    for read, unread in zip(*grads):
        assert torch.equal(read, unread)


def test_expert_bias_is_the_lean_experts_passes_on_the_gpu(cuda_only, monkeypatch):
    """GPT-OSS's biases and gate inside the kernels around them (expert_bias.py: the up projection's
    bias in the clamped gate's kernels, the gate's backward in one pass from the down projection's
    input gradient before the router's weight, the down projection's bias in the router's weighting)
    against the lean experts' compiled passes (each bias added by a pass of its own, the gate and
    the weighting's backward apart), bf16, at GPT-OSS's expert width (2880, which no column block
    divides) and at rows no row block divides: the output and the rows' gradients within one
    rounding of the compiled passes' (each takes float32 inside; their sigmoids and sums may part in
    the last place), the biases', weights' and down projection's gradients (sums) as close."""
    from megatrain import expert_bias, lean_experts
    routing, (y_up, b_up, down, b_down, weights), g_out, gate = _gpt_oss_expert_rows()
    results = []
    for fused in (False, True):
        monkeypatch.setattr(expert_bias, "runs", lambda rows, fused=fused: fused)
        y1, b1, w_down, b2, w = (t.clone().requires_grad_() for t in (y_up, b_up, down, b_down, weights))
        ids, counts, offsets, perm, inv = routing
        if fused:
            out = lean_experts._DownCombine.apply(y1, w_down, b2, ids, counts, offsets, w, perm, inv, True, b1, gate)
        else:
            h = lean_experts._Gate.apply(lean_experts._ExpertBias.apply(y1, b1, ids, counts, True), "clamped", *gate)
            out = lean_experts._DownCombine.apply(h, w_down, b2, ids, counts, offsets, w, perm, inv, True)
        out.backward(g_out)
        results.append((out, y1.grad, b1.grad, w_down.grad, b2.grad, w.grad))
    names = ("output", "up rows' gradient", "up bias's gradient", "down projection's gradient",
             "down bias's gradient", "weights' gradient")
    for name, want, got in zip(names, *results):
        error = (got.float() - want.float()).abs()
        if name in ("output", "up rows' gradient"):  # not sums, whose roundings may part by more near zero
            assert (error <= want.float().abs() * 2**-7).float().mean() > 0.999, name  # one bf16 rounding
        assert error.max() <= 2 * 2**-7 * want.float().abs().max(), name


def test_gpt_oss_rotary_kernel_is_the_library_rotary_to_the_bit_on_the_gpu(cuda_only, monkeypatch):
    """GPT-OSS's rotary on the GPU (rotary_halves.py, a Triton program a block of tokens, taking the
    queries and keys as the projections make them: 64 and 8 heads of 64, 2 x 1031 tokens, which no
    block of tokens divides, cos and sin per sequence in the library's strides) in bf16: the library's output and gradients
    to the bit; the kernel, not the compiled fallback, ran for both."""
    from transformers.models.gpt_oss.modeling_gpt_oss import apply_rotary_pos_emb as library
    from megatrain import rotary, rotary_halves
    gen = torch.Generator(device="cuda").manual_seed(0)
    B, S, D = 2, 1031, 64
    bf16 = lambda *shape: (3 * torch.randn(*shape, generator=gen, device="cuda")).to(torch.bfloat16)  # noqa: E731
    q, k = bf16(B, S, 64, D).transpose(1, 2).requires_grad_(), bf16(B, S, 8, D).transpose(1, 2).requires_grad_()
    # tokens-fastest, as the library's rotary embedding makes them (a transposed product of frequencies)
    angles = torch.randn(B, D // 2, S, generator=gen, device="cuda").transpose(1, 2)
    cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)
    grads = bf16(B, S, 64, D).transpose(1, 2), bf16(B, S, 8, D).transpose(1, 2)
    ran = []
    monkeypatch.setattr(rotary_halves, "rotate", lambda *a, rotate=rotary_halves.rotate, **kw: ran.append(a[0].shape)
                        or rotate(*a, **kw))
    runs = []
    for fn in (library, rotary.apply_rotary_halves):
        out = fn(q, k, cos, sin)
        runs.append((*out, *torch.autograd.grad(out, (q, k), grads)))
    assert len(ran) == 4  # queries and keys, each way
    for got, want in zip(runs[1], runs[0]):
        assert got.shape == want.shape and torch.equal(got, want)


@pytest.mark.parametrize("width", [2880, 2048, 100])
def test_rows_gathered_into_expert_order_are_torchs_on_the_gpu(cuda_only, width):
    """gather_rows.gather on the GPU (a Triton program per block of rows and of columns; 2880 and
    100 no column block divides, 1031 x 4 rows no row block) copies torch's index to the bit."""
    from megatrain import gather_rows
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1031, width, generator=gen, device="cuda").to(torch.bfloat16)
    index = torch.rand(1031 * 4, generator=gen, device="cuda").argsort() // 4
    assert torch.equal(gather_rows.gather(x, index), x[index])


@pytest.mark.parametrize("preset,width", [("tiny-gpt-oss", 256), ("tiny-qwen3-moe", 128)])
def test_the_memory_plan_counts_what_the_experts_keep_on_the_gpu(cuda_only, preset, width):
    """As on the CPU (test_lean_experts.py), with the GPU's kernels (GPT-OSS's biases inside Triton
    kernels, expert_bias.py): the lean experts keep within mlp_kept_compiled's count a pick and less
    than one element below it, the library's within mlp_kept's; GPT-OSS's keep one expert's width
    less than the count (the gate's output, which their backward makes again)."""
    from tests.engine.test_lean_experts import kept_per_pick
    shape, kept = kept_per_pick(preset, width, "cuda")
    k = shape.top_k
    assert kept[False] <= shape.mlp_kept / k
    count = shape.mlp_kept_compiled / k - (width if preset == "tiny-gpt-oss" else 0)
    assert count - 1 < kept[True] <= count


@pytest.mark.parametrize("width", [5760, 2880])
def test_expert_sums_kernel_sums_each_experts_rows_on_the_gpu(cuda_only, width):
    """expert_bias.expert_sums on the GPU (a Triton program per expert and block of columns, 2880 no
    block divides) over bf16 rows of experts with none, one, a few and thousands: within float32
    summation and one bf16 rounding of the exact sums, empty experts exactly zero, and the same bits
    on a second run."""
    from megatrain import expert_bias
    gen = torch.Generator(device="cuda").manual_seed(0)
    counts = torch.tensor([0, 1, 37, 0, 4096, 3, 1000, 0], device="cuda")
    rows = (4 * torch.randn(int(counts.sum()), width, generator=gen, device="cuda")).to(torch.bfloat16)
    assert expert_bias.runs(rows)
    got = expert_bias.expert_sums(rows, counts)
    assert torch.equal(got, expert_bias.expert_sums(rows, counts)) and not got[counts == 0].any()
    ids = torch.repeat_interleave(torch.arange(8, device="cuda"), counts)
    exact = torch.zeros(8, width, dtype=torch.float64, device="cuda").index_add_(0, ids, rows.double())
    size = torch.zeros(8, width, dtype=torch.float64, device="cuda").index_add_(0, ids, rows.double().abs())
    bound = exact.abs() * 2**-8 + counts.unsqueeze(1) * 2**-24 * size
    assert ((got.double() - exact).abs() <= bound).all()


def _sums_within_rounding(got: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor, experts: int) -> bool:
    """Each expert's sum of its rows (bf16) within float32 summation and one bf16 rounding of the exact."""
    exact = torch.zeros(experts, rows.shape[1], dtype=torch.float64, device="cuda").index_add_(0, ids, rows.double())
    size = torch.zeros_like(exact).index_add_(0, ids, rows.double().abs())
    counts = torch.bincount(ids, minlength=experts).unsqueeze(1)
    return bool(((got.double() - exact).abs() <= exact.abs() * 2**-8 + counts * 2**-24 * size).all())


# experts with no rows, one, a few and thousands: chunks that end inside an expert's rows, and experts with none
SKEWED = [0, 1, 37, 0, 4096, 3, 1000, 0]


@pytest.mark.parametrize("shape", [None, (64, 8, 64, 4), (16, 4, 128, 4)])
def test_rows_and_bias_dots_gather_the_rows_and_dot_them_on_the_gpu(cuda_only, shape):
    """expert_bias.rows_and_bias_dots on the GPU (GPT-OSS's width, 2880, which no column block divides;
    experts of no rows to thousands, at its launch shape and others): the rows are torch's index to
    the bit, each row's dot with its expert's bias within float32 summation of the exact, each
    expert's weighted rows' sum (the down bias's gradient) within float32 summation and one bf16
    rounding of the exact, an expert without rows exactly zero."""
    from megatrain import expert_bias
    gen = torch.Generator(device="cuda").manual_seed(0)
    counts = torch.tensor(SKEWED, device="cuda")
    ids = torch.repeat_interleave(torch.arange(len(SKEWED), device="cuda"), counts)
    g_out = (4 * torch.randn(ids.numel() // 4 + 1, 2880, generator=gen, device="cuda")).to(torch.bfloat16)
    b_down = torch.randn(len(SKEWED), 2880, generator=gen, device="cuda").to(torch.bfloat16)
    row_weights = torch.rand(ids.numel(), generator=gen, device="cuda").to(torch.bfloat16)
    tokens = torch.randint(0, g_out.shape[0], (ids.numel(),), generator=gen, device="cuda")
    rows, dots, sums = expert_bias.rows_and_bias_dots(g_out, tokens, b_down, counts, row_weights, sums=True,
                                                      shape=shape)
    assert torch.equal(rows, g_out[tokens])
    products = g_out[tokens].double() * b_down[ids].double()
    bound = g_out.shape[1] * 2**-24 * products.abs().sum(-1)
    assert ((dots.double() - products.sum(-1)).abs() <= bound).all()
    weighted = (rows.float() * row_weights.float().unsqueeze(-1)).to(torch.bfloat16)
    assert _sums_within_rounding(sums, weighted, ids, len(SKEWED)) and not sums[counts == 0].any()


@pytest.mark.parametrize("shape", [None, (64, 8, 64, 4), (16, 4, 128, 4)])
def test_gate_backward_takes_every_row_and_sums_each_experts_on_the_gpu(cuda_only, shape):
    """expert_bias.gate_backward on the GPU over experts of no rows to thousands (its chunks of one
    expert's rows, at its launch shape and others; GPT-OSS's width): every row's gradient within one
    bf16 rounding of the compiled passes' arithmetic in torch (a row the schedule missed would be
    left unwritten), the same bits with and without the sums and at every launch shape, h w within
    one rounding, each expert's sum of the gradient's rows (the up bias's gradient) within float32
    summation and one bf16 rounding of the exact, an expert without rows exactly zero."""
    from megatrain import expert_bias, lean_experts
    gen = torch.Generator(device="cuda").manual_seed(0)
    counts = torch.tensor(SKEWED, device="cuda")
    ids = torch.repeat_interleave(torch.arange(len(SKEWED), device="cuda"), counts)
    bf16 = lambda *size: (4 * torch.randn(*size, generator=gen, device="cuda")).to(torch.bfloat16)  # noqa: E731
    y, bias, through = bf16(ids.numel(), 2 * 2880), bf16(len(SKEWED), 2 * 2880), bf16(ids.numel(), 2880)
    w = torch.rand(ids.numel(), generator=gen, device="cuda").to(torch.bfloat16)
    d_y, dots, h_w, sums = expert_bias.gate_backward(y, bias, counts, through, w, 7.0, 1.702, sums=True, shape=shape)
    alone = expert_bias.gate_backward(y, bias, counts, through, w, 7.0, 1.702, sums=False)
    assert alone[3] is None and torch.equal(alone[0], d_y) and torch.equal(alone[2], h_w)
    x = (y.float() + bias[ids].float()).to(torch.bfloat16)
    want = lean_experts._clamped_gate_grad(x, (through.float() * w.float().unsqueeze(-1)).to(torch.bfloat16), 7.0, 1.702)
    h = lean_experts._clamped_gate(x.float(), 7.0, 1.702)
    for got, ref in ((d_y, want), (h_w, (h.to(torch.bfloat16).float() * w.float().unsqueeze(-1)).to(torch.bfloat16))):
        error = (got.float() - ref.float()).abs()
        assert (error <= ref.float().abs() * 2**-7).float().mean() > 0.999
        assert error.max() <= 2 * 2**-7 * ref.float().abs().max()
    products = through.double() * h.to(torch.bfloat16).double()
    assert ((dots.double() - products.sum(-1)).abs() <= 2 * 2**-7 * products.abs().sum(-1)).all()
    assert _sums_within_rounding(sums, d_y, ids, len(SKEWED)) and not sums[counts == 0].any()


def test_flex_kernel_options_keep_the_numbers_to_the_bit_on_the_gpu(cuda_only):
    """flex_kernel.OPTIONS on the GPU, as the library's flex attention takes them: at a shape of
    GPT-OSS's heads (8 query and 2 key-value heads of 64, bf16, 2 x 512 tokens: four of flex
    attention's blocks), each layer type's block mask (causal, a 128-token sliding window) with and
    without its options gives the same output, log-sum-exp and gradients of the queries, keys and
    values to the bit: the options skip work, not arithmetic."""
    import types
    from torch.nn.attention.flex_attention import create_block_mask
    from transformers.integrations.flex_attention import flex_attention_forward
    from megatrain import flex_kernel
    b, s, heads, kv_heads, width = 2, 512, 8, 2, 64
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rows(h):  # the engine's layout: (b, h, s, width) over (b, s, h, width) memory
        return torch.randn(b, s, h, width, generator=gen, device="cuda", dtype=torch.bfloat16).transpose(1, 2)

    q, k, v = rows(heads), rows(kv_heads), rows(kv_heads)
    grad = rows(heads).transpose(1, 2)  # the output's layout, (b, s, h, width)
    grad_lse = torch.randn(b, heads, s, generator=gen, device="cuda")
    masks = {"full_attention": lambda _b, _h, i, j: i >= j,
             "sliding_attention": lambda _b, _h, i, j: (i >= j) & (i - j < 128)}
    module = types.SimpleNamespace(training=True)
    for layer_type, mask_mod in masks.items():
        mask = create_block_mask(mask_mod, None, None, s, s, device="cuda")
        runs = []
        for options in (None, flex_kernel.OPTIONS[layer_type]):
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            out, lse = flex_attention_forward(module, *leaves, mask, scaling=0.125, kernel_options=options)
            torch.autograd.backward([out, lse], [grad, grad_lse])
            runs.append([out.detach(), lse.detach(), *(t.grad for t in leaves)])
        assert all(torch.equal(a, b) for a, b in zip(*runs)), layer_type


def test_flex_kernel_options_reach_the_library_and_train_alike_on_the_gpu(tmp_path, cuda_only, monkeypatch):
    """flex_kernel.py in the engine on the GPU: a tiny GPT-OSS (sliding and full layers alternating)
    trained on unpadded rows of 256 tokens, with and without the kernel options: each layer type's
    options reach the library's flex attention, and the runs track each other (losses within a bf16
    rounding, the updates' direction the same). Not to the bit: two trainings of this model in one
    process on the GPU were seen to differ by a rounding in a few thousand weights, options or none
    (docs/moe.md); the kernel test above holds the options' numbers to the bit."""
    from megatrain import flex_kernel, sinks
    start = {k: v.float() for k, v in
             tiny_checkpoint(tmp_path / "init", "tiny-gpt-oss", MOE["tiny-gpt-oss"]).state_dict().items()}
    seen = []
    library = sinks.library
    monkeypatch.setattr(sinks, "library", lambda module, *a, **kw: seen.append(
        (module.layer_idx, kw.get("kernel_options"))) or library(module, *a, **kw))
    tree = gpu_tree(tmp_path)
    tree["data"]["seq_len"] = 256
    options = flex_kernel.attention_kwargs
    runs = []
    for given in (False, True):
        monkeypatch.setattr(flex_kernel, "attention_kwargs", options if given else lambda *a: {})
        seen.clear()
        trainer = Trainer(load_config(base=tree))
        try:
            assert trainer.shape.config._attn_implementation == "flex_attention"
            losses = [trainer.train_step(mbs)["loss"]
                      for mbs in random_batches(2, 2, BATCH, 256, trainer.shape.vocab, pad=False)]
            runs.append((losses, store_params(trainer)))
            kinds = [trainer.shape.layer_type(i) for i in range(trainer.shape.num_layers)]
        finally:
            trainer.close()
        assert {i for i, _ in seen} == set(range(len(kinds))) and len(set(kinds)) == 2
        assert all(options == (flex_kernel.OPTIONS[kinds[i]] if given else None) for i, options in seen)
    (want_losses, _), (got_losses, _) = runs
    assert got_losses == pytest.approx(want_losses, rel=2**-8)
    assert_same_direction(start, runs)


def test_sinks_kernel_is_the_library_flex_attention_on_the_gpu(tmp_path, cuda_only):
    """engine.sinks_kernel: compiled (sinks.py) in a tiny GPT-OSS of bf16 with the library's flex
    attention, the library's model around it: the logits to the bit (the sinks' product is one
    rounding either way); the gradients (the factor's, summed over the head's width in another
    order, reaches the sinks and, through the log-sum-exp, the queries and keys) within two bf16
    roundings of the largest."""
    import contextlib
    from megatrain import sinks
    model = tiny_checkpoint(tmp_path / "init", "tiny-gpt-oss", MOE["tiny-gpt-oss"]).to("cuda", torch.bfloat16)
    model.set_attn_implementation("flex_attention")
    model.train()
    gen = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (2, 256), generator=gen, device="cuda")
    runs = []
    for applied in (False, True):
        model.zero_grad(set_to_none=True)
        with sinks.applied() if applied else contextlib.nullcontext():
            out = model(ids, labels=ids)
        out.loss.backward()
        runs.append((out.logits.detach(), {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}))
    (want_logits, want), (got_logits, got) = runs
    assert torch.equal(got_logits, want_logits)
    assert set(got) == set(want) and any(n.endswith("sinks") for n in got)
    for name in want:
        assert (got[name] - want[name]).abs().max() <= 2 * 2**-7 * want[name].abs().max(), name

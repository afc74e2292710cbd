"""Streamed training equals a fully resident `transformers` model trained with torch.optim.AdamW.

Both run in float32 on the CPU. Tolerances: losses and gradient norms differ only by summation
order (chunked loss, per-layer graphs), so rtol 1e-5.

Parameters after 3 AdamW steps at lr 1e-3: atol 2e-5, from the rounding it bounds. AdamW divides
the step's gradient g by sqrt(v) + eps, so a rounding difference d in g moves the update by at most
about 2 lr d / (|g| + eps): for an element whose gradient is itself rounding noise (|g| ~ d: the key
biases', softmax being shift-invariant; an expert's weight that a few routed rows cancel on), by up
to 2 lr d / eps. The two orders of summation differ by d of a few float32 ulps of the gradient
sums' terms, here d <= 3e-8, so with eps 1e-5 (both runs, make_trainer) three steps move such an
element at most 2 * 3e-3 * 3e-8 / 1e-5 = 1.8e-5 apart. With AdamW's default eps 1e-8 that bound is
1.8e-2: on an AMD EPYC one element of Mixtral's experts ended 2.8e-5 apart, and no tolerance that
still means anything separates that from a fault. A wrong gradient or a part updated twice moves
whole lr-sized steps (1e-3) on every element whose gradient is not noise.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

from helpers import Reference, random_batches, store_params, tiny_checkpoint
from megatrain.config import load_config
from megatrain.trainer import Trainer

SEQ, BATCH = 16, 2

CASES = {
    # preset, config overrides, K, micro-batches, clipping, padding, engine settings
    "qwen2-tied-K2-of-3-accum-clip-pad": ("tiny-qwen2", {}, 2, 2, 0.5, True, {}),
    "qwen2-mixed-sliding-layers": ("tiny-qwen2", {"use_sliding_window": True, "sliding_window": 6,
                                                  "max_window_layers": 1}, 1, 1, 1.0, True, {}),
    "llama-untied-K1-clip-pad": ("tiny-llama", {}, 1, 1, 0.5, True, {}),
    "llama-K4-deeper-than-model": ("tiny-llama", {"num_hidden_layers": 4}, 4, 1, 0.5, False, {}),
    "qwen3-tied-K3-divides-noclip": ("tiny-qwen3", {}, 3, 2, None, True, {}),
    "mistral-sliding-K2-untied": ("tiny-mistral", {}, 2, 1, 0.5, True, {}),
    "qwen2-one-buffer-sync-grads": ("tiny-qwen2", {}, 2, 2, 0.5, True, {"weight_buffers": 1, "grad_slabs": 0}),
    "llama-pad-token-row-noclip-accum": ("tiny-llama", {"pad_token_id": 3}, 1, 2, None, True, {}),
    "llama-offloaded-checkpoints-K2-accum": ("tiny-llama", {"num_hidden_layers": 5}, 2, 2, None, True,
                                             {"offload_checkpoints": True}),
    "llama-three-buffers-one-slab": ("tiny-llama", {"tie_word_embeddings": True}, 3, 2, 0.5, True,
                                     {"weight_buffers": 3, "grad_slabs": 1}),
    # embedding and layer 0 updated where they live (tied: inside the head's unit), clipped by the
    # norm computed on the device
    "qwen2-tied-device-tiles-clip-accum": ("tiny-qwen2", {}, 1, 2, 0.5, True, {"device_tiles": 2}),
    "llama-untied-all-device-tiles-noclip": ("tiny-llama", {}, 2, 1, None, True, {"device_tiles": 4}),
    "mistral-device-embedding-clip": ("tiny-mistral", {}, 1, 1, 0.5, True, {"device_tiles": 1}),
    # the MLP over 5 tokens at a time (not dividing the 32 of a micro-batch), forward and backward
    "qwen2-chunked-mlp-K2-accum": ("tiny-qwen2", {}, 2, 2, 0.5, True, {"mlp_chunk_tokens": 5}),
    "llama-chunked-mlp-device-tiles": ("tiny-llama", {}, 1, 1, None, True, {"mlp_chunk_tokens": 7, "device_tiles": 2}),
    # the last layers keep their forward graphs (no recompute): after K=2 blocks with offloaded
    # checkpoints, all layers, and with the chunked MLP and device tiles
    "llama-last-2-of-5-kept-K2-offload-accum": ("tiny-llama", {"num_hidden_layers": 5}, 2, 2, 0.5, True,
                                                {"no_recompute_layers": 2, "offload_checkpoints": True}),
    "qwen2-tied-all-kept-device-tiles-accum-noclip": ("tiny-qwen2", {}, 1, 2, None, True,
                                                      {"no_recompute_layers": 3, "device_tiles": 2}),
    "mistral-kept-chunked-mlp-device-tiles": ("tiny-mistral", {}, 3, 1, 0.5, True,
                                              {"no_recompute_layers": 1, "mlp_chunk_tokens": 5, "device_tiles": 2}),
    # mixtures of experts (4 experts, 2 per token): router, experts and their biases, attention
    # sinks, sliding and full layers alternating (GPT-OSS), the router's auxiliary loss (both tiny
    # presets ask for it); tests/engine/test_moe.py checks that these batches route to every expert
    "gpt-oss-K3-of-4-accum-clip-pad": ("tiny-gpt-oss", {}, 3, 2, 0.5, True, {}),
    "gpt-oss-K2-divides-kept-device-tiles-noclip": ("tiny-gpt-oss", {}, 2, 1, None, True,
                                                    {"no_recompute_layers": 1, "device_tiles": 2}),
    "gpt-oss-no-aux-K1-offloaded-accum-clip": ("tiny-gpt-oss", {"output_router_logits": False}, 1, 2, 0.5, True,
                                               {"offload_checkpoints": True}),
    "qwen3-moe-tied-K2-of-3-accum-clip-pad": ("tiny-qwen3-moe", {}, 2, 2, 0.5, True, {}),
    "qwen3-moe-sliding-K3-divides-kept-noclip": ("tiny-qwen3-moe", {"use_sliding_window": True, "sliding_window": 6},
                                                 3, 1, None, True, {"no_recompute_layers": 1}),
    # dense layers among the sparse ones (two tile layouts): the router's loss over the sparse layers alone
    "qwen3-moe-mlp-only-layers-K2-accum-clip": ("tiny-qwen3-moe", {"mlp_only_layers": [1]}, 2, 2, 0.5, True, {}),
    "qwen3-moe-sparse-step-K1-kept-device-tiles": ("tiny-qwen3-moe", {"decoder_sparse_step": 2}, 1, 1, None, True,
                                                   {"no_recompute_layers": 1, "device_tiles": 2}),
    # Mixtral: Qwen3-MoE's routing with the top-k weights renormalised always, untied, sliding on
    # every layer when the config sets a window
    "mixtral-K2-of-3-accum-clip-pad": ("tiny-mixtral", {}, 2, 2, 0.5, True, {}),
    "mixtral-sliding-no-aux-K1-kept-device-tiles": ("tiny-mixtral", {"sliding_window": 6, "output_router_logits": False},
                                                    1, 1, None, True, {"no_recompute_layers": 1, "device_tiles": 2}),
    # DeepSeek: latent attention, a dense layer before 3 MoE layers (two tile layouts, and templates),
    # 8 routed experts (2 per token, group-limited) beside a shared one; V3's sigmoid routing with its
    # correction bias (a float32 buffer, never trained) and scaling factor, V2's softmax routing (tied)
    "deepseek-v3-K2-of-4-accum-clip-pad": ("tiny-deepseek-v3", {}, 2, 2, 0.5, True, {}),
    "deepseek-v3-K3-of-4-kept-device-tiles-offloaded-noclip": ("tiny-deepseek-v3", {}, 3, 2, None, True,
                                                                {"no_recompute_layers": 1, "device_tiles": 3,
                                                                 "offload_checkpoints": True}),
    "deepseek-v3-one-buffer-sync-grads-K1": ("tiny-deepseek-v3", {}, 1, 1, 0.5, True,
                                            {"weight_buffers": 1, "grad_slabs": 0}),
    "deepseek-v2-tied-K2-of-4-accum-clip-pad": ("tiny-deepseek-v2", {}, 2, 2, 0.5, True, {}),
    # Phi-3: fused qkv and gate-up projections, partial rotary (tiny-phi3: 12 of 16 dimensions)
    "phi3-tied-K2-of-3-accum-clip-pad": ("tiny-phi3", {}, 2, 2, 0.5, True, {}),
    # Phi-3-128K's longrope: past original_max_position_embeddings (8 here) the long factors, scaled
    "phi3-longrope-K2-accum-clip": ("tiny-phi3", {"original_max_position_embeddings": 8,
                                                  "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0,
                                                                      "partial_rotary_factor": 0.75,
                                                                      "short_factor": [1.0] * 6,
                                                                      "long_factor": [1.5, 2.0, 3.0, 4.0, 6.0, 8.0]}},
                                    2, 2, 0.5, True, {}),
    "phi3-sliding-untied-K1-offloaded-kept-accum": ("tiny-phi3", {"sliding_window": 6, "tie_word_embeddings": False},
                                                    1, 2, None, True,
                                                    {"offload_checkpoints": True, "no_recompute_layers": 1}),
    # Gemma 2: soft-capped attention (eager on the CPU) and logits, (1 + weight) norms, the scaled
    # embedding (tied), GeGLU, sliding and full layers; Gemma 3: q and k norms, a rotary per layer type
    "gemma2-K2-of-3-accum-clip-pad": ("tiny-gemma2", {}, 2, 2, 0.5, True, {}),
    "gemma2-K1-kept-device-tiles-offloaded-noclip": ("tiny-gemma2", {}, 1, 2, None, True,
                                                     {"no_recompute_layers": 1, "device_tiles": 2,
                                                      "offload_checkpoints": True}),
    # a SiLU-gated Gemma still recomputes its MLP's output: its post-feedforward norm's backward reads it
    "gemma2-silu-K1-clip": ("tiny-gemma2", {"hidden_activation": "silu"}, 1, 1, 0.5, True, {}),
    "gemma3-K2-of-3-accum-clip-pad": ("tiny-gemma3", {}, 2, 2, 0.5, True, {}),
    "gemma3-K3-divides-kept-device-tiles-noclip": ("tiny-gemma3", {}, 3, 1, None, True,
                                                   {"no_recompute_layers": 1, "device_tiles": 2}),
    # the recomputed layers keep their attention (unpadded: padding recomputes it): all of them; Gemma 3's
    # full layer alone (its sliding ones, window 6 of 16, have a mask) beside a layer kept whole
    "qwen2-tied-kept-attention-K2-accum-clip": ("tiny-qwen2", {}, 2, 2, 0.5, False, {"keep_attention_layers": 3}),
    "gemma3-kept-attention-full-layer-kept-graph": ("tiny-gemma3", {}, 1, 2, None, False,
                                                    {"keep_attention_layers": 3, "no_recompute_layers": 1}),
    # both chosen by the plan against a stated device: every tile on the device, every layer kept
    "llama-auto-tiles-auto-kept-clip-accum": ("tiny-llama", {}, 1, 2, 0.5, True,
                                              {"device_tiles": "auto", "no_recompute_layers": "auto",
                                               "device_memory_gb": 1000}),
}


def make_trainer(tmp_path, preset, overrides, K, accum, clip, engine, lr=1e-3, steps=3, optim=None):
    cfg = load_config(base={
        "model": {"pretrained": str(tmp_path / "init")},
        "engine": {"device": "cpu", "checkpoint_every": K, "loss_chunk_tokens": 7, **engine},
        "optim": {"lr": lr, "eps": 1e-5, "weight_decay": 0.1, "max_grad_norm": clip, "warmup_steps": 0,
                  **(optim or {})},
        "data": {"seq_len": SEQ, "batch_size": BATCH, "grad_accum": accum},
        "steps": steps,
    })
    return cfg, Trainer(cfg)


def test_a_closed_trainer_gives_the_process_its_threads_back(tmp_path):
    """engine.optimizer_threads sets the process's torch threads for the run (the host AdamW is built
    and timed with them): a notebook's or a probe's work after `close` runs on its own count again."""
    tiny_checkpoint(tmp_path / "init", "tiny-qwen2", {})
    before = torch.get_num_threads()
    _, trainer = make_trainer(tmp_path, "tiny-qwen2", {}, 1, 1, None, {"optimizer_threads": before + 1})
    assert torch.get_num_threads() == before + 1
    trainer.close()
    assert torch.get_num_threads() == before


@pytest.mark.parametrize("case", list(CASES))
def test_streamed_training_matches_reference(tmp_path, case):
    train_and_compare(tmp_path, *CASES[case])


@pytest.mark.parametrize("engine", [{}, {"device_tiles": 2}], ids=["host", "device-tiles"])
def test_weight_decay_on_every_parameter_is_plain_adamw(tmp_path, engine):
    """optim.decay: all decays norms and biases too, as torch.optim.AdamW over model.parameters()
    (the default, matrices, is the reference of every other case)."""
    train_and_compare(tmp_path, "tiny-qwen2", {}, 2, 2, 0.5, True, engine, optim={"decay": "all", "weight_decay": 0.5})


def test_norms_over_token_chunks_match_reference(tmp_path, monkeypatch):
    """The decoder layers' norms over 5-token chunks (lean_norm.CHUNK, 64K tokens in real runs), with
    layers kept from recompute and the chunked MLP: still the reference's training."""
    import megatrain.lean_norm
    monkeypatch.setattr(megatrain.lean_norm, "CHUNK", 5)
    train_and_compare(tmp_path, "tiny-qwen2", {}, 1, 2, 0.5, True, {"no_recompute_layers": 1, "mlp_chunk_tokens": 7})


@pytest.mark.parametrize("preset, engine", [("tiny-qwen2", {"norm_kernel": "compiled"}),
                                            ("tiny-gpt-oss", {"norm_kernel": "compiled"}),
                                            ("tiny-qwen3", {"norm_kernel": "compiled"}),  # head norms: a second width
                                            ("tiny-qwen2", {"mlp_kernel": "compiled"}),
                                            ("tiny-qwen2", {"loss_kernel": "compiled"}),
                                            ("tiny-qwen2", {"rotary_kernel": "compiled"}),
                                            ("tiny-qwen3-moe", {"rotary_kernel": "compiled"}),  # head norms before it
                                            ("tiny-gpt-oss", {"rotary_kernel": "compiled"}),  # GPT-OSS's form
                                            ("tiny-gpt-oss", {"experts_kernel": "lean"}),
                                            ("tiny-qwen3-moe", {"experts_kernel": "lean"}),
                                            ("tiny-gpt-oss", {"mlp_kernel": "compiled", "experts_kernel": "lean"}),
                                            ("tiny-qwen3-moe", {"mlp_kernel": "compiled", "experts_kernel": "lean"}),
                                            ("tiny-mixtral", {"mlp_kernel": "compiled", "experts_kernel": "lean"}),
                                            ("tiny-deepseek-v3", {"mlp_kernel": "compiled", "experts_kernel": "lean"}),
                                            ("tiny-deepseek-v3", {"norm_kernel": "compiled"}),  # MLA's LoRA norms
                                            ("tiny-gemma2", {"norm_kernel": "compiled"}),  # (1 + weight) norms
                                            ("tiny-gemma2", {"loss_kernel": "compiled"})])  # soft-capped logits
def test_compiled_kernels_train_as_the_reference(tmp_path, preset, engine):
    """engine.norm_kernel, engine.mlp_kernel, engine.rotary_kernel and engine.loss_kernel: compiled (float32 on the CPU:
    the fused kernels' arithmetic in another order), and engine.experts_kernel: lean, its gate
    compiled or not, within the reference's tolerances, kept layers, the norms over token chunks and
    the recompute's unread down projection included."""
    import megatrain.lean_experts as lean_experts
    import megatrain.lean_norm as lean_norm
    import megatrain.loss as loss
    import megatrain.rotary as rotary
    import megatrain.swiglu as swiglu
    module, names = {"norm_kernel": (lean_norm, ("_compiled_forward", "_compiled_backward")),
                     "mlp_kernel": (swiglu, ("_compiled_product", "_compiled_grads")),
                     "loss_kernel": (loss, ("_compiled_cross_entropy",)),
                     "rotary_kernel": (rotary, ("_compiled_halves", "_compiled_halves_grad") if preset == "tiny-gpt-oss"
                                       else ("_compiled_rotate", "_compiled_rotate_grad")),
                     "experts_kernel": (lean_experts, ("_forward",))}[next(iter(engine))]
    if "experts_kernel" in engine and "mlp_kernel" in engine:  # a mixture of experts' compiled kernel: its gate
        module, names = lean_experts, ("_compiled_gate",)
    calls = dict.fromkeys(names, 0)

    def counted(name):
        kernel = getattr(module, name)

        def call(*args):
            calls[name] += 1
            return kernel(*args)
        return call
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(lean_norm, "CHUNK", 5)
        for name in calls:
            patch.setattr(module, name, counted(name))
        train_and_compare(tmp_path, preset, {"output_router_logits": False} if preset == "tiny-gpt-oss" else {},
                          2, 2, 0.5, True, {**engine, "no_recompute_layers": 1})
    assert all(calls.values()), calls  # the run used them


def train_and_compare(tmp_path, preset, overrides, K, accum, clip, pad, engine, optim=None, steps=3):
    model = tiny_checkpoint(tmp_path / "init", preset, overrides)
    cfg, trainer = make_trainer(tmp_path, preset, overrides, K, accum, clip, engine, optim=optim, steps=steps)
    reference = Reference(model, cfg.optim, cfg.steps)
    try:
        ref_norms, norms = [], []
        for step, mbs in enumerate(random_batches(cfg.steps, accum, BATCH, SEQ, trainer.shape.vocab, pad)):
            metrics = trainer.train_step(mbs)
            ref_loss, ref_norm = reference.step(mbs)
            torch.testing.assert_close(metrics["loss"], ref_loss, rtol=1e-5, atol=0)
            ref_norms.append(ref_norm)
            trainer.optimizer.flush()
            norms.append(trainer.optimizer.grad_norms[step])
        torch.testing.assert_close(norms, ref_norms, rtol=1e-5, atol=0)
        params = store_params(trainer)
        for name, ref in reference.model.state_dict().items():
            if name == "lm_head.weight" and trainer.shape.tied:
                continue
            torch.testing.assert_close(params[name], ref, rtol=0, atol=2e-5, msg=lambda m: f"{name}: {m}")
    finally:
        trainer.close()


def test_auto_settings_record_what_runs(tmp_path):
    """device_tiles and no_recompute_layers `auto` resolve before the store is built into the run's
    settings, which keep the numbers while the user's config keeps `auto`: all of them against a large
    stated device, none on the CPU without one."""
    tiny_checkpoint(tmp_path / "init", "tiny-llama")
    auto = {"device_tiles": "auto", "no_recompute_layers": "auto"}
    for stated, tiles, kept in ((1000, 4, 3), (None, 0, 0)):
        cfg, trainer = make_trainer(tmp_path, "tiny-llama", {}, 1, 1, None, {**auto, "device_memory_gb": stated})
        trainer.close()
        assert (trainer.settings.device_tiles, trainer.settings.no_recompute_layers) == (tiles, kept)
        assert (cfg.engine.device_tiles, cfg.engine.no_recompute_layers) == ("auto", "auto")
        assert (trainer.memory_plan.detail["device.device_tiles"] > 0) == (tiles > 0)


def test_gradients_match_reference(tmp_path):
    """The step gradients summed on the device over micro-batches are the reference's (a clipping
    threshold never reached keeps them in the tiles' gradient buffers, unscaled)."""
    model = tiny_checkpoint(tmp_path / "init", "tiny-llama")
    cfg, trainer = make_trainer(tmp_path, "tiny-llama", {}, 2, 2, 1e9, {}, lr=1e-12, steps=1)
    reference = Reference(model, cfg.optim, cfg.steps)
    try:
        mbs = random_batches(1, 2, BATCH, SEQ, trainer.shape.vocab, pad=True)[0]
        trainer.train_step(mbs)
        reference.step(mbs)
        trainer.optimizer.flush()
        for tile in trainer.store.tiles:
            views = tile.layout.views(tile.grad)
            for name, grad in zip(trainer.shape.hf_names(tile.name), views):
                ref = dict(reference.model.named_parameters())[name].grad
                torch.testing.assert_close(grad, ref, rtol=1e-4, atol=1e-7, msg=lambda m: f"{name}: {m}")
    finally:
        trainer.close()


def three_steps(tmp_path, accum: int, engine: dict):
    """Tiny Qwen2 (K=2, clipping, padding) trained 3 steps from the saved init: losses and weights."""
    _, trainer = make_trainer(tmp_path, "tiny-qwen2", {}, 2, accum, 0.5, engine)
    try:
        losses = [trainer.train_step(mbs)["loss"] for mbs in random_batches(3, accum, BATCH, SEQ, trainer.shape.vocab, True)]
        return losses, store_params(trainer)
    finally:
        trainer.close()


def test_recompute_skips_the_mlp_output_nothing_reads(tmp_path, monkeypatch):
    """With the chunked MLP, a recomputed block's last layer computes no MLP output (only its
    backward's root): per step, 4 layers' MLPs in the forward, 2 of 4 in the recompute (K=2),
    gate and up in 4 backwards; and training is bit-identical to computing the output."""
    import types

    import megatrain.chunked_mlp
    import megatrain.engine
    tiny_checkpoint(tmp_path / "init", "tiny-qwen2", {"num_hidden_layers": 4})
    calls = []
    counting = types.SimpleNamespace(silu=torch.nn.functional.silu,
                                     linear=lambda *a: calls.append(1) or torch.nn.functional.linear(*a))
    monkeypatch.setattr(megatrain.chunked_mlp, "F", counting)

    skipped = three_steps(tmp_path, 1, {"mlp_chunk_tokens": 5})
    chunks = -(-BATCH * SEQ // 5)
    assert len(calls) == 3 * chunks * (3 * 4 + 3 * 2 + 2 * 4)
    monkeypatch.setattr(megatrain.engine, "output_unused", contextlib.nullcontext)
    calls.clear()
    computed = three_steps(tmp_path, 1, {"mlp_chunk_tokens": 5})
    assert len(calls) == 3 * chunks * (3 * 4 + 3 * 4 + 2 * 4)
    torch.testing.assert_close(skipped, computed, rtol=0, atol=0)


def test_recompute_skips_the_down_projection_nothing_reads(tmp_path, monkeypatch):
    """Unchunked, a recomputed block's last layer leaves out its MLP's down projection (its
    output is only its backward's root): 2 blocks of 2 layers, 2 micro-batches, 3 steps: 12 left
    out; and training is bit-identical to computing it (float32 on the CPU)."""
    import megatrain.engine
    import megatrain.unread_mlp
    tiny_checkpoint(tmp_path / "init", "tiny-qwen2", {"num_hidden_layers": 4})
    left_out = []
    forward = megatrain.unread_mlp._UnreadLinear.forward
    monkeypatch.setattr(megatrain.unread_mlp._UnreadLinear, "forward",
                        staticmethod(lambda ctx, x, w: left_out.append(1) or forward(ctx, x, w)))

    skipped = three_steps(tmp_path, 2, {})
    assert len(left_out) == 3 * 2 * 2
    monkeypatch.setattr(megatrain.engine, "output_unused", contextlib.nullcontext)
    left_out.clear()
    computed = three_steps(tmp_path, 2, {})
    assert not left_out
    torch.testing.assert_close(skipped, computed, rtol=0, atol=0)


@pytest.mark.parametrize("preset", ["tiny-gpt-oss", "tiny-qwen3-moe"])
def test_recompute_skips_the_experts_down_projection_nothing_reads(tmp_path, monkeypatch, preset):
    """With the lean experts and their compiled gate, a recomputed block's last layer leaves out its
    experts' down projection and weighting (lean_experts._DownCombine): 2 blocks of 2 layers, 3
    steps: 6 left out; and training is bit-identical to computing them (float32 on the CPU)."""
    import megatrain.engine
    import megatrain.lean_experts
    from megatrain.unread_mlp import unread
    tiny_checkpoint(tmp_path / "init", preset, {"num_hidden_layers": 4})
    left_out = []
    forward = megatrain.lean_experts._DownCombine.forward
    monkeypatch.setattr(megatrain.lean_experts._DownCombine, "forward",
                        staticmethod(lambda ctx, *a: (unread() and left_out.append(1)) or forward(ctx, *a)))

    def trained():
        _, trainer = make_trainer(tmp_path, preset, {}, 2, 1, 0.5, {"mlp_kernel": "compiled", "experts_kernel": "lean"})
        try:
            losses = [trainer.train_step(mbs)["loss"] for mbs in random_batches(3, 1, BATCH, SEQ, trainer.shape.vocab, True)]
            return losses, store_params(trainer)
        finally:
            trainer.close()
    skipped = trained()
    assert len(left_out) == 3 * 2
    monkeypatch.setattr(megatrain.engine, "output_unused", contextlib.nullcontext)
    left_out.clear()
    computed = trained()
    assert not left_out
    torch.testing.assert_close(skipped, computed, rtol=0, atol=0)


@pytest.mark.parametrize("K", [1, 2])
@pytest.mark.parametrize("chunked", [True, False])
def test_hardware_flops_count_the_recompute_and_the_chunks(tmp_path, K, chunked):
    """Hardware FLOPs over model FLOPs: the recomputed layers' forward again (not the kept layer's)
    and, with the MLP chunked, every layer's gate and up projections again in its backward; less
    what the recompute of each block's last layer leaves out: its MLP (chunked) or the MLP's down
    projection."""
    tiny_checkpoint(tmp_path / "init", "tiny-llama", {"num_hidden_layers": 4})
    _, trainer = make_trainer(tmp_path, "tiny-llama", {}, K, 1, None,
                              {"mlp_chunk_tokens": 5 if chunked else None, "no_recompute_layers": 1})
    try:
        m = trainer.train_step(random_batches(1, 1, BATCH, SEQ, trainer.shape.vocab, False)[0])
    finally:
        trainer.close()
    h, f, v, L, n = 64, 128, 256, 4, SEQ  # tiny-llama: hidden, FFN, vocab; 4 layers; unpadded sequences
    recomputed, blocks = 3, {1: 3, 2: 2}[K]  # layers 0-2 (layer 3 kept): blocks [0], [1], [2] or [0, 1], [2]
    layer = 2 * h * h + h * h + 3 * h * f  # q and o; k and v at half the heads; the MLP
    model = BATCH * n * (6 * (layer * L + v * h) + 12 * L * h * n)
    again = 2 * layer * recomputed + 4 * recomputed * h * n
    chunks = 2 * (2 * h * f * L - 3 * h * f * blocks) if chunked else -2 * h * f * blocks
    assert m["hardware_tflops"] / m["model_tflops"] == pytest.approx((model + BATCH * n * (again + chunks)) / model, rel=1e-9)

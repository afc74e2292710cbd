"""The model families beside the Llama layout: stateless layer templates with each layer's own
behaviour, the FLOPs of fused projections and of Gemma's windows and tied head, the presets' published
shapes, Gemma's initial norms."""
from __future__ import annotations


import pytest
import torch

from helpers import shape_of
from megatrain.config import ModelConfig
from megatrain.shapes import ModelShape, load_hf_config
from megatrain.templates import Architecture


def test_templates_hold_no_weights_and_keep_per_layer_behaviour():
    hf = load_hf_config(ModelConfig(preset="tiny-qwen2", overrides={
        "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1, "num_hidden_layers": 4}))
    arch = Architecture(ModelShape(hf))
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer
    for i in range(4):
        template = arch.template(i)
        assert not list(template.module.parameters())
        with torch.device("meta"):
            fresh = Qwen2DecoderLayer(hf, i)
        assert template.module.self_attn.sliding_window == fresh.self_attn.sliding_window
        assert template.module.self_attn.layer_type == fresh.self_attn.layer_type
        assert template.module.self_attn.layer_idx == i
    assert arch.template(0) is not arch.template(1)  # full and sliding layers use different templates
    specs = arch.shape.layer_specs
    weights = [torch.randn(s.shape) for s in specs]
    module = arch.template(2).bind(weights)
    assert module.mlp.up_proj.weight is weights[[s.name for s in specs].index("mlp.up_proj.weight")]


def test_flops_count_fused_projections_as_the_ones_they_fuse():
    """Phi-3's qkv_proj and gate_up_proj are the q, k, v and gate, up matrices side by side: N counts
    them whole, 6 N + 12 L h s per token; an MLP that is not the separate gated one keeps its down
    projection in the recompute, so the hardware FLOPs add every recomputed layer whole."""
    from megatrain.metrics import model_flops
    from megatrain.schedule import Schedule
    s = shape_of("tiny-phi3")  # hidden 64, 4 heads of 16 (2 kv), FFN 128, vocab 256, 3 layers, tied
    h, kv, f, v = 64, 32, 128, 256
    layer = (h + 2 * kv) * h + h * h + 2 * f * h + f * h  # qkv, o, gate-up, down
    assert s.layer_matmul_params() == layer and s.matmul_params() == 3 * layer + v * h
    lengths = [16, 9]
    model = model_flops(s.matmul_params(), s.attention(), lengths)
    assert model == sum(n * (6 * s.matmul_params() + 12 * 3 * h * n) for n in lengths)
    again = sum(n * (2 * layer + 4 * h * n) for n in lengths)
    assert Schedule(3, 1, 0, 1).hardware_flops(s, None, lengths) == model + 3 * again


def test_flops_of_gemma_count_each_layers_window_and_the_tied_head_once():
    """Gemma 3: q, k, v, o and the GeGLU's three matrices a layer (its q and k norms, soft-capping and
    embedding scale are no matmul), the tied head once; sliding layers' attention counted against
    their window (6), the full layer's against the sequence."""
    from megatrain.metrics import model_flops
    s = shape_of("tiny-gemma3")  # hidden 64, 4 heads of 16 (2 kv), FFN 128, vocab 256, layers sliding-full-sliding
    h, kv, f, v = 64, 32, 128, 256
    layer = 2 * h * h + 2 * kv * h + 3 * h * f
    assert s.layer_matmul_params() == layer and s.matmul_params() == 3 * layer + v * h
    assert s.attention() == [(64, 6), (64, None), (64, 6)]
    n = 16
    assert model_flops(s.matmul_params(), s.attention(), [n]) == n * (6 * s.matmul_params() + 12 * 64 * (6 + n + 6))


@pytest.mark.parametrize("preset, total, layers", [("phi-3-mini", 3.82e9, 32), ("gemma-2-9b", 9.24e9, 42)])
def test_dense_presets_have_the_published_shapes(preset, total, layers):
    """Parameters as the model cards state them: Phi-3-mini 3.8B, Gemma 2 9B 9.24B (tied); N, the
    FLOPs formula's matmul weights, is everything but the norms and, untied, the embedding."""
    s = shape_of(preset)
    assert s.num_layers == layers and s.total_params() == pytest.approx(total, rel=1e-3)
    norms = sum(p.numel for p in s.layer_specs if not p.matmul) * layers + s.hidden
    assert s.matmul_params() == s.total_params() - norms - (0 if s.tied else s.vocab * s.hidden)
    if s.family == "gemma2":  # 16 heads of 256 (not the hidden size 3584), sliding first
        assert s.attention()[:2] == [(4096, 4096), (4096, None)] and s.config._attn_implementation != "sdpa"
    else:
        assert s.attention()[0] == (3072, 2047)


def test_random_init_of_gemma_zeroes_its_norms():
    """Gemma's norms scale by (1 + weight): a preset's seeded init sets them zero, as the library's
    init does (one would double every norm's output), the final norm's too; matrices N(0, 0.02)."""
    from megatrain.config import load_config
    from megatrain.trainer import Trainer
    trainer = Trainer(load_config(base={"model": {"preset": "tiny-gemma3"}, "engine": {"device": "cpu"},
                                        "data": {"seq_len": 16, "batch_size": 1}, "steps": 1}))
    try:
        layer, head = (dict(zip((s.name for s in t.layout.specs), t.master_views()))
                       for t in (trainer.store.layers[1], trainer.store.head))
    finally:
        trainer.close()
    for name in ("input_layernorm.weight", "post_feedforward_layernorm.weight", "self_attn.q_norm.weight"):
        assert not layer[name].any(), name
    assert not head["norm.weight"].any()
    assert 0.01 < float(layer["mlp.up_proj.weight"].std()) < 0.03

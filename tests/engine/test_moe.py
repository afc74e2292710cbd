"""Mixtures of experts (GPT-OSS, Qwen3-MoE, Mixtral) beyond the streamed-training cases of
test_engine_reference.py: the library's own loss, the routing those cases exercise, saving and
reloading, the FLOPs formula's active weights and windows, the presets and their plans, refusals.

Tolerances as in test_engine_reference.py: the loss differs from the library's by summation order
only (chunked cross-entropy, the router's statistics summed in another order), so rtol 1e-5.
"""
from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from helpers import random_batches, tiny_checkpoint, train_save_reload
from megatrain.cli import main
from megatrain.config import ModelConfig
from megatrain.metrics import model_flops
from megatrain.shapes import ModelShape, load_hf_config
from test_engine_reference import BATCH, SEQ, make_trainer

FAMILIES = ["tiny-gpt-oss", "tiny-qwen3-moe", "tiny-mixtral"]


def shape_of(preset: str, **overrides) -> ModelShape:
    return ModelShape(load_hf_config(ModelConfig(preset=preset, overrides=overrides)))


@pytest.mark.parametrize("preset", FAMILIES)
def test_loss_is_the_library_models_loss(tmp_path, preset):
    """With one micro-batch the step's loss is what the library's model returns for the same batch:
    the mean cross-entropy plus router_aux_loss_coef times its load-balancing loss."""
    model = tiny_checkpoint(tmp_path / "init", preset)
    mb = random_batches(1, 1, BATCH, SEQ, 256, pad=True)[0][0]
    with torch.no_grad():
        out = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, labels=mb.labels)
    assert out.aux_loss is not None and float(out.aux_loss) > 0
    _, trainer = make_trainer(tmp_path, preset, {}, 2, 1, None, {})
    try:
        loss = trainer.train_step([mb])["loss"]
    finally:
        trainer.close()
    torch.testing.assert_close(loss, float(out.loss), rtol=1e-5, atol=0)


@pytest.mark.parametrize("preset", FAMILIES)
def test_the_reference_cases_route_to_every_expert(tmp_path, preset):
    """The batches of test_engine_reference.py's MoE cases send tokens to every expert of every layer
    in their first step, so every expert's weights and biases are trained and compared there."""
    model = tiny_checkpoint(tmp_path / "init", preset)
    top_k = model.config.num_experts_per_tok
    for mb in random_batches(1, 2, BATCH, SEQ, 256, pad=True)[0]:
        with torch.no_grad():
            logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask,
                           output_router_logits=True).router_logits
        assert len(logits) == model.config.num_hidden_layers
        for layer in logits:
            picked = torch.topk(layer, top_k, dim=-1).indices.unique()
            assert len(picked) == layer.shape[-1]


@pytest.mark.parametrize("preset", FAMILIES)
def test_save_pretrained_round_trip(tmp_path, preset):
    """Trained weights saved and loaded by `from_pretrained` are ours to the bit; Qwen3-MoE's and
    Mixtral's experts are written one tensor per expert and projection, under their published names
    (Mixtral's `block_sparse_moe.experts.E.w1`, `w3`, `w2` and `block_sparse_moe.gate`), as the
    published checkpoints and the library write them (and the store loads them so: tiny_checkpoint
    writes that layout)."""
    tiny_checkpoint(tmp_path / "init", preset)
    _, trainer = make_trainer(tmp_path, preset, {}, 2, 2, 0.5, {}, steps=2)
    state = train_save_reload(trainer, random_batches(2, 2, BATCH, SEQ, 256, pad=True), tmp_path / "out")
    initial = AutoModelForCausalLM.from_pretrained(tmp_path / "init").state_dict()
    name = "model.layers.0.mlp.experts.down_proj"
    assert not torch.equal(initial[name], state[name])
    with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    if preset == "tiny-qwen3-moe":
        assert {"model.layers.0.mlp.experts.3.gate_proj.weight", "model.layers.0.mlp.experts.3.up_proj.weight",
                "model.layers.0.mlp.experts.3.down_proj.weight"} <= names
        assert not [n for n in names if n.endswith("gate_up_proj")]
    elif preset == "tiny-mixtral":
        stem = "model.layers.0.block_sparse_moe."
        assert {f"{stem}gate.weight", f"{stem}experts.3.w1.weight", f"{stem}experts.3.w3.weight",
                f"{stem}experts.3.w2.weight"} <= names
        assert not [n for n in names if ".mlp." in n]
    else:
        assert "model.layers.0.mlp.experts.gate_up_proj_bias" in names and "model.layers.0.self_attn.sinks" in names


def test_flops_count_top_k_experts_and_each_layers_window():
    """6 N + 12 sum_l a_l k_l per token: N the attention's and router's matrices, top-k of the experts'
    and the LM head; a_l heads x head_dim; k_l the sequence, or the window on a sliding layer."""
    s = shape_of("tiny-gpt-oss")  # h 64, 4 heads (2 kv) of 16, 4 experts of width 32, 2 per token, window 6
    h, e, k, f, v = 64, 4, 2, 32, 256
    attention = h * 64 + 2 * h * 32 + 64 * h  # q, k and v at half the heads, o
    router = e * h
    experts = e * (h * 2 * f + f * h)  # gate_up and down of every expert
    assert s.layer_matmul_params(active=False) == attention + router + experts
    assert s.layer_matmul_params() == attention + router + experts * k // e
    assert s.matmul_params() == 4 * (attention + router + experts * k // e) + v * h
    assert s.attention() == [(64, 6), (64, None), (64, 6), (64, None)]  # sliding first, alternating
    n = 16
    per_token = 6 * s.matmul_params() + 12 * (2 * 64 * 6 + 2 * 64 * n)
    assert model_flops(s.matmul_params(), s.attention(), [n, n]) == 2 * n * per_token
    # a dense model with heads x head_dim = hidden: the paper's 6N + 12 L h s
    d = shape_of("tiny-llama")
    assert model_flops(d.matmul_params(), d.attention(), [n]) == n * (6 * d.matmul_params() + 12 * 3 * 64 * n)


@pytest.mark.parametrize("preset,total,active,layers,experts,top_k", [
    ("gpt-oss-20b", 20.91e9, 3.61e9, 24, 32, 4),
    ("gpt-oss-120b", 116.83e9, 5.13e9, 36, 128, 4),
    ("qwen3-30b-a3b", 30.53e9, 3.04e9, 48, 128, 8),
    ("mixtral-8x7b", 46.70e9, 12.75e9, 32, 8, 2),
])
def test_presets_have_the_published_shapes(preset, total, active, layers, experts, top_k):
    """Parameters as the model cards state them (GPT-OSS: 21B / 3.6B active and 117B / 5.1B active;
    Qwen3-30B-A3B: 30.5B / 3.3B active, the 3.3B counting the 0.31B embedding, which we do not;
    Mixtral-8x7B: 46.7B / 12.9B active, the 12.9B counting the 0.13B embedding)."""
    s = shape_of(preset)
    assert (s.num_layers, s.experts, s.top_k) == (layers, experts, top_k)
    assert s.total_params() == pytest.approx(total, rel=1e-3)
    assert s.matmul_params() == pytest.approx(active, rel=1e-2)
    if s.family == "gpt_oss":
        assert s.attention()[:2] == [(64 * 64, 128), (64 * 64, None)]
        assert s.config.rope_parameters["rope_type"] == "yarn" and s.router_aux_coef == 0.0
    elif s.family == "qwen3_moe":
        assert s.attention()[0] == (32 * 128, None) and s.hidden == 2048
    else:
        assert s.attention()[0] == (4096, None) and s.router_aux_coef == 0.0


@pytest.mark.parametrize("preset", ["gpt-oss-20b", "gpt-oss-120b", "qwen3-30b-a3b", "mixtral-8x7b"])
def test_plan_prints_for_each_preset_without_allocating(preset, capsys):
    """`megatrain plan` of the full-size presets: the model's size and the memory plan, from meta
    tensors only (the host's resident memory does not grow by the model's gigabytes)."""
    import psutil
    before = psutil.Process().memory_info().rss
    assert main(["plan", f"model.preset={preset}", "engine.device=cpu", "engine.compute_dtype=bfloat16",
                 "data.seq_len=4096", "data.batch_size=1", "steps=1", "engine.host_memory_gb=4096"]) == 0
    out = capsys.readouterr().out
    assert "memory plan: host" in out and f"preset {preset}" in out
    assert psutil.Process().memory_info().rss - before < 2 << 30


def test_auto_attention_is_the_training_devices(monkeypatch):
    """GPT-OSS's `auto` attention follows engine.device, not whether this machine has a GPU: a
    plan made here for a GPU machine takes flex attention, a CPU run on a GPU machine eager
    attention, as on any CPU."""
    from megatrain.config import load_config
    from megatrain.planning import model_config

    def attention(device: str) -> str:
        cfg = load_config(None, [], base={"model": {"preset": "tiny-gpt-oss"}, "engine": {"device": device}})
        return model_config(cfg)._attn_implementation
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert (attention("cuda"), attention("cuda:1"), attention("auto")) == ("flex_attention", "flex_attention", "eager")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert (attention("cpu"), attention("auto")) == ("eager", "flex_attention")
    # asked for by name where the run trains on the CPU: refused (no FlexAttention backward there)
    cfg = load_config(None, [], base={"model": {"preset": "tiny-gpt-oss", "attn_implementation": "flex_attention"},
                                      "engine": {"device": "cpu"}})
    with pytest.raises(ValueError, match="flex_attention trains on a GPU only"):
        model_config(cfg)


@pytest.mark.skipif(torch.cuda.is_available(), reason="plans this machine's own GPU there")
def test_a_plan_for_a_gpu_machine_counts_no_eager_scores(capsys):
    """The whole GPT-OSS-20B at 8 x 4096 planned from this machine for an 80 GB GPU: it fits there
    (flex attention); planned with eager attention's score tensors it would need over 80 GiB."""
    args = ["plan", "model.preset=gpt-oss-20b", "data.seq_len=4096", "data.batch_size=8", "steps=1",
            "engine.checkpoint_every=1", "engine.host_memory_gb=400", "engine.device_memory_gb=80"]
    assert main([*args, "engine.device=cuda"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("fits the stated machine")


def test_refusals_name_the_setting():
    with pytest.raises(ValueError, match="model.attn_implementation: gpt_oss has no SDPA"):
        load_hf_config(ModelConfig(preset="tiny-gpt-oss", attn_implementation="sdpa"))
    with pytest.raises(ValueError, match=r"router_jitter_noise > 0 is not supported \(set overrides.router_jitter_noise: 0\)"):
        shape_of("tiny-mixtral", router_jitter_noise=0.01)
    from megatrain.templates import Architecture
    with pytest.raises(ValueError, match="engine.mlp_chunk_tokens"):
        Architecture(shape_of("tiny-qwen3-moe"), mlp_chunk=8)


def test_hardware_flops_recompute_the_active_weights_of_the_recomputed_layers():
    """The schedule's hardware FLOPs for a mixture of experts: the model's, plus one forward of each
    recomputed layer at its active weights and own window; the experts' output is computed in full."""
    from megatrain.metrics import recompute_flops
    from megatrain.schedule import Schedule
    s = shape_of("tiny-gpt-oss")
    lengths = [16, 9]
    model = model_flops(s.matmul_params(), s.attention(), lengths)
    again = recompute_flops(3 * s.layer_matmul_params(), s.attention(range(3)), lengths)  # layers 0-2
    assert again == sum(n * (2 * 3 * s.layer_matmul_params() + 4 * 64 * (6 + n + 6)) for n in [16, 9])
    assert Schedule(4, 2, 1, 1).hardware_flops(s, None, lengths) == model + again


def test_random_init_is_the_librarys_kind():
    """A preset's seeded init (no checkpoint): matrices, GPT-OSS's sinks and router bias N(0, 0.02),
    expert and attention biases zero, norms one; the same on every layer's tile."""
    from megatrain.config import load_config
    from megatrain.trainer import Trainer
    trainer = Trainer(load_config(base={"model": {"preset": "tiny-gpt-oss"}, "engine": {"device": "cpu"},
                                        "data": {"seq_len": 16, "batch_size": 1}, "steps": 1}))
    try:
        tile = trainer.store.layers[1]
        values = dict(zip((s.name for s in tile.layout.specs), tile.master_views()))
    finally:
        trainer.close()
    for name in ("self_attn.sinks", "mlp.router.bias", "mlp.router.weight", "mlp.experts.gate_up_proj"):
        assert 0.01 < float(values[name].std()) < 0.03, name
    for name in ("mlp.experts.gate_up_proj_bias", "mlp.experts.down_proj_bias", "self_attn.q_proj.bias"):
        assert not values[name].any(), name
    assert (values["input_layernorm.weight"] == 1).all()

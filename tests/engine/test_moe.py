"""Mixtures of experts (GPT-OSS, Qwen3-MoE, Mixtral, DeepSeek) beyond the streamed-training cases of
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

from helpers import random_batches, settings, tiny_checkpoint, train_save_reload
from megatrain.cli import main
from megatrain.config import ModelConfig
from megatrain.metrics import model_flops
from megatrain.shapes import ModelShape, load_hf_config
from megatrain.store import tile_bytes
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
    ("deepseek-v3", 671.03e9, 36.62e9, 61, 256, 8),
    ("deepseek-v2-lite", 15.71e9, 2.45e9, 27, 64, 6),
])
def test_presets_have_the_published_shapes(preset, total, active, layers, experts, top_k):
    """Parameters as the model cards state them (GPT-OSS: 21B / 3.6B active and 117B / 5.1B active;
    Qwen3-30B-A3B: 30.5B / 3.3B active, the 3.3B counting the 0.31B embedding, which we do not;
    Mixtral-8x7B: 46.7B / 12.9B active, the 12.9B counting the 0.13B embedding; DeepSeek-V3: 671B /
    37B active, the 37B counting the 0.93B embedding; DeepSeek-V2-Lite: 15.7B / 2.4B active)."""
    s = shape_of(preset)
    assert (s.num_layers, s.experts, s.top_k) == (layers, experts, top_k)
    assert s.total_params() == pytest.approx(total, rel=1e-3)
    assert s.matmul_params() == pytest.approx(active, rel=1e-2)
    if s.family == "gpt_oss":
        assert s.attention()[:2] == [(64 * 64, 128), (64 * 64, None)]
        assert s.config.rope_parameters["rope_type"] == "yarn" and s.router_aux_coef == 0.0
    elif s.family == "qwen3_moe":
        assert s.attention()[0] == (32 * 128, None) and s.hidden == 2048
    elif s.family == "deepseek_v3":  # 128 heads of 192 (queries, keys) and 128 (values)
        assert s.attention()[0] == (128 * (192 + 128) // 2, None) and s.layout_of[2:4] == [0, 1]
    elif s.family == "deepseek_v2":
        assert s.attention()[0] == (16 * (192 + 128) // 2, None) and s.layout_of[:2] == [0, 1]
    else:
        assert s.attention()[0] == (4096, None) and s.router_aux_coef == 0.0


@pytest.mark.parametrize("preset", ["gpt-oss-20b", "gpt-oss-120b", "qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v2-lite"])
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
    recomputed layer at its active weights and own window; the experts' output computed in full, or,
    with the lean experts' compiled gate, left out of each recomputed block's last layer."""
    from megatrain.metrics import recompute_flops
    from megatrain.schedule import Schedule
    s = shape_of("tiny-gpt-oss")
    lengths = [16, 9]
    model = model_flops(s.matmul_params(), s.attention(), lengths)
    again = recompute_flops(3 * s.layer_matmul_params(), s.attention(range(3)), lengths)  # layers 0-2
    assert again == sum(n * (2 * 3 * s.layer_matmul_params() + 4 * 64 * (6 + n + 6)) for n in [16, 9])
    assert Schedule(4, 2, 1, 1).hardware_flops(s, None, lengths) == model + again
    # with the lean experts' compiled gate the last layers of the two recomputed blocks (1 and 2)
    # leave their top-k experts' down projections out
    down = s.top_k * s.config.intermediate_size * s.hidden
    assert Schedule(4, 2, 1, 1).hardware_flops(s, None, lengths, (), True) == model + again - 2 * sum(2 * n * down for n in lengths)


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



def test_deepseek_v3_routes_by_its_correction_bias(tmp_path):
    """The tiny checkpoints' correction biases (tiny_checkpoint draws them nonzero) change which
    experts the library's router picks, so the reference cases (test_engine_reference.py, whose
    state_dict comparison includes them) hold the engine to routing by them. The library keeps each a
    float32 buffer beside the parameters, which its optimizer never moves (nor does the engine's)."""
    model = tiny_checkpoint(tmp_path / "init", "tiny-deepseek-v3")
    gate = model.model.layers[1].mlp.gate
    assert "model.layers.1.mlp.gate.e_score_correction_bias" not in dict(model.named_parameters())
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        biased = gate(x)[2].sort(dim=-1).values
        gate.e_score_correction_bias.zero_()
        plain = gate(x)[2].sort(dim=-1).values
    assert not torch.equal(biased, plain)


@pytest.mark.parametrize("preset", ["tiny-deepseek-v3", "tiny-deepseek-v2"])
def test_deepseek_save_pretrained_round_trip(tmp_path, preset):
    """DeepSeek's experts are saved one tensor per expert and projection (its checkpoints' layout, the
    library's conversion mapping of Qwen2-MoE), its dense first layer as a dense MLP; V3's correction
    biases in float32 whatever the saved dtype, as the library keeps them; `from_pretrained` loads
    it all back to the bit."""
    tiny_checkpoint(tmp_path / "init", preset)
    _, trainer = make_trainer(tmp_path, preset, {}, 2, 2, 0.5, {}, steps=2)
    state = train_save_reload(trainer, random_batches(2, 2, BATCH, SEQ, 256, pad=True), tmp_path / "out")
    initial = AutoModelForCausalLM.from_pretrained(tmp_path / "init").state_dict()
    assert not torch.equal(initial["model.layers.1.mlp.experts.down_proj"], state["model.layers.1.mlp.experts.down_proj"])
    with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert {"model.layers.0.mlp.gate_proj.weight", "model.layers.1.mlp.experts.7.up_proj.weight",
            "model.layers.1.mlp.shared_experts.down_proj.weight", "model.layers.1.mlp.gate.weight"} <= names
    assert not [n for n in names if n.endswith("gate_up_proj")]
    if preset == "tiny-deepseek-v3":
        bias = "model.layers.3.mlp.gate.e_score_correction_bias"
        assert torch.equal(state[bias], initial[bias])  # never trained
        _, trainer = make_trainer(tmp_path, preset, {}, 2, 1, None, {})
        try:
            trainer.save_pretrained(tmp_path / "bf16", dtype="bfloat16")
        finally:
            trainer.close()
        with safe_open(str(tmp_path / "bf16" / "model.safetensors"), framework="pt") as f:
            assert f.get_slice(bias).get_dtype() == "F32" and torch.equal(f.get_tensor(bias), initial[bias])
            assert f.get_slice("model.layers.3.mlp.gate.weight").get_dtype() == "BF16"


def test_deepseek_flops_count_mla_top_k_and_shared_experts():
    """N: MLA's projections (q's LoRA pair, the joint kv projection with the rotary key, kv's
    up-projection, o), the router, top-k of the routed experts and every shared expert on the MoE
    layers, the dense MLP on the first_k_dense_replace layers; a_l: heads x (qk_head_dim + v_head_dim) / 2."""
    s = shape_of("tiny-deepseek-v3")  # h 64, 4 heads, q rank 32, kv rank 16, 16 + 8 query-key, 16 value dims
    h, heads, qk, v_dim, e, k, f, vocab = 64, 4, 24, 16, 8, 2, 32, 256
    attention = h * 32 + 32 * heads * qk + h * (16 + 8) + 16 * heads * (16 + v_dim) + heads * v_dim * h
    dense = attention + 3 * h * 128
    moe = attention + e * h + k * 3 * h * f + 3 * h * f  # router, 2 of 8 experts, 1 shared expert
    assert [s.layer_matmul_params(i) for i in range(4)] == [dense, moe, moe, moe]
    assert s.layer_matmul_params(1, active=False) == moe + (e - k) * 3 * h * f
    assert s.matmul_params() == dense + 3 * moe + vocab * h
    assert s.attention() == [(heads * (qk + v_dim) // 2, None)] * 4
    n = 16
    assert model_flops(s.matmul_params(), s.attention(), [n]) == n * (6 * s.matmul_params() + 12 * 4 * 80 * n)
    v2 = shape_of("tiny-deepseek-v2")  # q_lora_rank null: one query projection
    assert v2.layer_matmul_params(1) == moe - (h * 32 + 32 * heads * qk) + h * heads * qk


def test_layers_of_two_layouts_have_their_own_tiles_and_the_plan_the_largest():
    """DeepSeek's dense first layer and its MoE layers: a tile each of its own layout (the store's
    bytes their sum), one template per layout, and the plan's per-layer device buffers sized by the
    largest layer (the MoE one); the correction biases counted on the device."""
    from megatrain.memory import plan
    from megatrain.store import HostStore, Layout
    from megatrain.templates import Architecture
    s = shape_of("tiny-deepseek-v3")
    dense, moe = (Layout.of(specs).numel for specs in s.layer_layouts)
    assert s.layout_of == [0, 1, 1, 1] and dense < moe and Layout.of(s.layer_specs).numel == moe
    cfg = settings(s, compute="float32")
    store = HostStore(s, cfg, torch.device("cpu"))
    assert [t.layout.numel for t in store.layers] == [dense, moe, moe, moe]
    assert [len(b) for b in store.buffers] == [0, 1, 1, 1] and store.buffers[1][0].dtype == torch.float32
    assert HostStore.nbytes(s, cfg) == (sum(tile_bytes(t.layout.numel, cfg.master, cfg.compute, False, False)
                                            for t in store.tiles), 3 * 8 * 4)
    arch = Architecture(s)
    assert arch.template(0) is not arch.template(1) and arch.template(1) is arch.template(3)
    p = plan(s, cfg)
    assert p.detail["device.layer_grads"] == moe * 4 and p.detail["device.device_tiles"] == 3 * 8 * 4

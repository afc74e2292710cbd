"""Named model shapes: the paper's Qwen2.5 models, Phi-3-mini, Gemma 2 9B, GPT-OSS, Qwen3-MoE,
Mixtral, DeepSeek-V3 and DeepSeek-V2-Lite, and tiny configs of every supported family.

Each entry is a `transformers` config dict (random init: only the shape matters for speed); the
mixtures of experts carry their published config.json's values.
"""
from __future__ import annotations

from typing import Any

_QWEN25 = dict(model_type="qwen2", vocab_size=152064, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
               max_position_embeddings=32768, tie_word_embeddings=False, hidden_act="silu")


def _qwen25(hidden: int, ffn: int, layers: int, heads: int, kv: int, **extra: Any) -> dict[str, Any]:
    return {**_QWEN25, "hidden_size": hidden, "intermediate_size": ffn, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv, **extra}


# openai/gpt-oss-20b and -120b config.json: the same layer but for the experts (32 and 128) and depth
# (24 and 36); sliding (128 tokens) and full attention alternate, sliding first (the library's default
# layer_types); YaRN rotary to 131072 positions
_GPT_OSS = dict(model_type="gpt_oss", vocab_size=201088, hidden_size=2880, intermediate_size=2880,
                num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_experts_per_tok=4,
                sliding_window=128, attention_bias=True, rms_norm_eps=1e-5, hidden_act="silu",
                max_position_embeddings=131072, rope_theta=150000.0, tie_word_embeddings=False,
                rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                              "original_max_position_embeddings": 4096, "truncate": False},
                router_aux_loss_coef=0.9, output_router_logits=False, pad_token_id=199999, eos_token_id=200002)
# Qwen/Qwen3-30B-A3B config.json (intermediate_size is the dense MLP's, which no layer of it has)
_QWEN3_30B_A3B = dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                      moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                      num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                      decoder_sparse_step=1, mlp_only_layers=[], rms_norm_eps=1e-6, rope_theta=1_000_000.0,
                      max_position_embeddings=40960, tie_word_embeddings=False, hidden_act="silu",
                      router_aux_loss_coef=0.001, output_router_logits=False, use_sliding_window=False,
                      sliding_window=None, max_window_layers=48, bos_token_id=151643, eos_token_id=151645)
# mistralai/Mixtral-8x7B-v0.1 config.json
_MIXTRAL_8X7B = dict(model_type="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                     num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, num_local_experts=8,
                     num_experts_per_tok=2, rms_norm_eps=1e-5, rope_theta=1_000_000.0, max_position_embeddings=32768,
                     sliding_window=None, tie_word_embeddings=False, hidden_act="silu", router_aux_loss_coef=0.02,
                     output_router_logits=False, router_jitter_noise=0.0, bos_token_id=1, eos_token_id=2)
# microsoft/Phi-3-mini-4k-instruct config.json
_PHI3_MINI = dict(model_type="phi3", vocab_size=32064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=32, rms_norm_eps=1e-5, rope_theta=10000.0,
                  max_position_embeddings=4096, original_max_position_embeddings=4096, sliding_window=2047,
                  tie_word_embeddings=False, hidden_act="silu", pad_token_id=32000, bos_token_id=1, eos_token_id=32000)
# google/gemma-2-9b config.json: soft-capping of attention scores (50) and logits (30), 4096-token windows
_GEMMA2_9B = dict(model_type="gemma2", vocab_size=256000, hidden_size=3584, intermediate_size=14336,
                  num_hidden_layers=42, num_attention_heads=16, num_key_value_heads=8, head_dim=256,
                  query_pre_attn_scalar=256, sliding_window=4096, attn_logit_softcapping=50.0,
                  final_logit_softcapping=30.0, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=8192,
                  hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True, pad_token_id=0, bos_token_id=2,
                  eos_token_id=1)
# deepseek-ai/DeepSeek-V3 config.json (its multi-token-prediction layer, num_nextn_predict_layers,
# is no layer of the library's causal LM: not trained) and DeepSeek-V2-Lite's; YaRN rotary to 163840
_DEEPSEEK_YARN = {"rope_type": "yarn", "factor": 40.0, "beta_fast": 32.0, "beta_slow": 1.0,
                  "original_max_position_embeddings": 4096}
_DEEPSEEK_V3 = dict(model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
                    moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128,
                    n_shared_experts=1, n_routed_experts=256, num_experts_per_tok=8, n_group=8, topk_group=4,
                    routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=3, q_lora_rank=1536,
                    kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, rope_theta=10000.0,
                    rope_scaling={**_DEEPSEEK_YARN, "mscale": 1.0, "mscale_all_dim": 1.0},
                    max_position_embeddings=163840, rms_norm_eps=1e-6, hidden_act="silu", tie_word_embeddings=False,
                    bos_token_id=0, eos_token_id=1)
_DEEPSEEK_V2_LITE = dict(model_type="deepseek_v2", vocab_size=102400, hidden_size=2048, intermediate_size=10944,
                         moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16,
                         num_key_value_heads=16, n_shared_experts=2, n_routed_experts=64, num_experts_per_tok=6,
                         topk_method="greedy", routed_scaling_factor=1.0, first_k_dense_replace=1, q_lora_rank=None,
                         kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                         rope_theta=10000.0, rope_scaling={**_DEEPSEEK_YARN, "mscale": 0.707, "mscale_all_dim": 0.707},
                         max_position_embeddings=163840, rms_norm_eps=1e-6, hidden_act="silu",
                         tie_word_embeddings=False, bos_token_id=100000, eos_token_id=100001)

_TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, hidden_act="silu")
# Gemma's configs name the activation hidden_activation (gelu_pytorch_tanh by default)
_TINY_GEMMA = {k: v for k, v in _TINY.items() if k != "hidden_act"}

PRESETS: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": _qwen25(896, 4864, 24, 14, 2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-1.5b": _qwen25(1536, 8960, 28, 12, 2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-3b": _qwen25(2048, 11008, 36, 16, 2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-7b": _qwen25(3584, 18944, 28, 28, 4),
    "qwen2.5-14b": _qwen25(5120, 13824, 48, 40, 8),
    "qwen2.5-32b": _qwen25(5120, 27648, 64, 40, 8),
    "qwen2.5-72b": _qwen25(8192, 29568, 80, 64, 8),
    "phi-3-mini": _PHI3_MINI,
    "gemma-2-9b": _GEMMA2_9B,
    "gpt-oss-20b": {**_GPT_OSS, "num_hidden_layers": 24, "num_local_experts": 32},
    "gpt-oss-120b": {**_GPT_OSS, "num_hidden_layers": 36, "num_local_experts": 128},
    "qwen3-30b-a3b": _QWEN3_30B_A3B,
    "mixtral-8x7b": _MIXTRAL_8X7B,
    "deepseek-v3": _DEEPSEEK_V3,
    "deepseek-v2-lite": _DEEPSEEK_V2_LITE,
    "tiny-llama": {**_TINY, "model_type": "llama", "tie_word_embeddings": False},
    "tiny-qwen2": {**_TINY, "model_type": "qwen2", "tie_word_embeddings": True},
    "tiny-qwen3": {**_TINY, "model_type": "qwen3", "head_dim": 16, "tie_word_embeddings": True},
    "tiny-mistral": {**_TINY, "model_type": "mistral", "sliding_window": 8, "tie_word_embeddings": False},
    # fused qkv and gate-up projections; rotary over three quarters of each head (Phi-4-mini's
    # partial_rotary_factor, a phi3 model); Phi-3's pad token (32000) lies outside the tiny vocabulary
    "tiny-phi3": {**_TINY, "model_type": "phi3", "partial_rotary_factor": 0.75, "pad_token_id": None,
                  "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": True},
    # four experts, two per token; the router's auxiliary loss on (weighted 0.1 so that it shows)
    "tiny-gpt-oss": {**_TINY, "model_type": "gpt_oss", "num_hidden_layers": 4, "head_dim": 16, "intermediate_size": 32,
                     "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 6,
                     "output_router_logits": True, "router_aux_loss_coef": 0.1, "tie_word_embeddings": False,
                     "rope_scaling": {"rope_type": "yarn", "factor": 16.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                      "original_max_position_embeddings": 16, "truncate": False}},
    "tiny-qwen3-moe": {**_TINY, "model_type": "qwen3_moe", "head_dim": 16, "moe_intermediate_size": 32,
                       "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True,
                       "output_router_logits": True, "router_aux_loss_coef": 0.1, "tie_word_embeddings": True},
    # Gemma: four norms a layer, (1 + weight) norms, the embedding scaled by sqrt(hidden), GeGLU,
    # sliding and full layers alternating (Gemma 2's layer_types, sliding first; Gemma 3's set here, its
    # default pattern being five sliding to one full); Gemma 2's soft-capping of attention scores and
    # final logits, its caps small enough to bend the tiny model's (published: 50 and 30); Gemma 3's
    # q and k norms and its local and global rotary bases
    "tiny-gemma2": {**_TINY_GEMMA, "model_type": "gemma2", "head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 6,
                    "attn_logit_softcapping": 1.0, "final_logit_softcapping": 0.5, "tie_word_embeddings": True},
    "tiny-gemma3": {**_TINY_GEMMA, "model_type": "gemma3_text", "head_dim": 16, "query_pre_attn_scalar": 16,
                    "sliding_window": 6, "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
                    "tie_word_embeddings": True},
    # DeepSeek: latent attention (q and kv LoRA projections and their norms, rotary on 8 of each head's
    # 24 query-key dimensions, values of 16), layer 0 dense (first_k_dense_replace) and the others 8
    # routed experts, 2 per token from the best 2 of 4 groups, beside a shared expert; V3's sigmoid
    # routing with its correction bias and scaling, V2's softmax routing limited to groups
    "tiny-deepseek-v3": {**_TINY, "model_type": "deepseek_v3", "num_hidden_layers": 4, "num_key_value_heads": 4,
                         "first_k_dense_replace": 1, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 4,
                         "topk_group": 2, "n_shared_experts": 1, "moe_intermediate_size": 32, "q_lora_rank": 32,
                         "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
                         "routed_scaling_factor": 2.5, "norm_topk_prob": True, "tie_word_embeddings": False},
    "tiny-deepseek-v2": {**_TINY, "model_type": "deepseek_v2", "num_hidden_layers": 4, "num_key_value_heads": 4,
                         "first_k_dense_replace": 1, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 4,
                         "topk_group": 2, "topk_method": "group_limited_greedy", "n_shared_experts": 1,
                         "moe_intermediate_size": 32, "q_lora_rank": None, "kv_lora_rank": 16,
                         "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
                         "routed_scaling_factor": 1.0, "tie_word_embeddings": True},
    "tiny-mixtral": {**_TINY, "model_type": "mixtral", "intermediate_size": 32, "num_local_experts": 4,
                     "num_experts_per_tok": 2, "output_router_logits": True, "router_aux_loss_coef": 0.1,
                     "tie_word_embeddings": False},
}


def preset(name: str) -> dict[str, Any]:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known: {sorted(PRESETS)}")
    return dict(PRESETS[name])

"""Named model shapes: the paper's Qwen2.5 models and tiny configs of every supported family.

Each entry is a `transformers` config dict (random init: only the shape matters for speed).
"""
from __future__ import annotations

from typing import Any

_QWEN25 = dict(model_type="qwen2", vocab_size=152064, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
               max_position_embeddings=32768, tie_word_embeddings=False, hidden_act="silu")


def _qwen25(hidden: int, ffn: int, layers: int, heads: int, kv: int, **extra: Any) -> dict[str, Any]:
    return {**_QWEN25, "hidden_size": hidden, "intermediate_size": ffn, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv, **extra}


_TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, hidden_act="silu")

PRESETS: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": _qwen25(896, 4864, 24, 14, 2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-1.5b": _qwen25(1536, 8960, 28, 12, 2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-3b": _qwen25(2048, 11008, 36, 16, 2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-7b": _qwen25(3584, 18944, 28, 28, 4),
    "qwen2.5-14b": _qwen25(5120, 13824, 48, 40, 8),
    "qwen2.5-32b": _qwen25(5120, 27648, 64, 40, 8),
    "qwen2.5-72b": _qwen25(8192, 29568, 80, 64, 8),
    "tiny-llama": {**_TINY, "model_type": "llama", "tie_word_embeddings": False},
    "tiny-qwen2": {**_TINY, "model_type": "qwen2", "tie_word_embeddings": True},
    "tiny-qwen3": {**_TINY, "model_type": "qwen3", "head_dim": 16, "tie_word_embeddings": True},
    "tiny-mistral": {**_TINY, "model_type": "mistral", "sliding_window": 8, "tie_word_embeddings": False},
}


def preset(name: str) -> dict[str, Any]:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known: {sorted(PRESETS)}")
    return dict(PRESETS[name])

"""flash-attn 1.x's import path for Ratel's gpt_model.py, served by torch (see flash_attention.py)."""

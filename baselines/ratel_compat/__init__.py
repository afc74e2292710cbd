"""The run-time compatibility layer between Ratel's artifact (torch 2.0, flash-attn 1.0.4, Python 3.10)
and a newer stack (torch 2.11, no flash-attn, Python 3.12). Nothing of Ratel is in here.

This directory is put first on the PYTHONPATH of Ratel's processes (main.py and the optimizer process
it spawns), so its top-level modules are seen there as:

  flash_attn.flash_attention  FlashAttention, flash-attn 1.0.4's module, on torch's SDPA
  sitecustomize               run by `site` at start-up: ratel_patches.install(), and faulthandler on
                              SIGUSR1 (the suite runner asks a late point's processes for their stacks)
  ratel_patches               import hooks that adapt the checkout's modules as they load
  ratel_probe                 the environment check run before main.py (baselines/ratel.py)

Inside this repository the same files are `baselines.ratel_compat.*`, which is how the tests import them.
"""
from pathlib import Path

PATH = Path(__file__).resolve().parent

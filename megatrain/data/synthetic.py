"""Uniform random tokens: for benchmarks and tests."""
from __future__ import annotations

import torch

from megatrain.batch import Batch
from megatrain.config import DataConfig


class SyntheticSource:
    """Uniform random tokens, a fixed function of (seed, batch index)."""

    nbytes = 0

    def __init__(self, cfg: DataConfig, vocab: int):
        self.cfg, self.vocab = cfg, vocab
        self.position = 0

    def next(self) -> Batch:
        index = 0 if self.cfg.repeat_batch else self.position
        gen = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + index)
        self.position += 1
        ids = torch.randint(0, self.vocab, (self.cfg.batch_size, self.cfg.seq_len), generator=gen)
        return Batch(ids, ids.clone())

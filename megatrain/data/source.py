"""Batches from tokenised examples: one seeded permutation per epoch, rows padded to the longest
of their batch, or several examples packed into one row.

Packed rows keep examples apart by their positions: each example's position_ids restart at 0 and
no attention mask is given, which is how `transformers` (masking_utils.find_packed_sequence_indices)
recognises packed sequences and builds a mask with no attention across them; rotary embeddings
read the same positions. An example's first token is never a target (nothing before it in its
row is its context). The padding at the end of a packed row has position 0 at every token: each
is a sequence of one, attending to itself alone (an example of one token has no target, so none
is kept, and `Batch.sequence_lengths` can tell padding from examples).

`position` (batches drawn) is saved with the training state; the order is a function of the seed
and the epoch, so a resumed run continues with the same data.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from megatrain.batch import Batch
from megatrain.config import DataConfig
from megatrain.data.pipeline import Examples
from megatrain.loss import IGNORE


class FileSource:
    """Training batches, reshuffled each epoch."""

    def __init__(self, cfg: DataConfig, examples: Examples, pad_id: int):
        self.cfg, self.examples, self.pad_id = cfg, examples, pad_id
        self.position = 0
        self._epochs: list[np.ndarray] = []  # rows drawn before each epoch, cumulative
        self._plan: tuple[int, np.ndarray, np.ndarray] | None = None  # (epoch, order, row bounds)

    @property
    def nbytes(self) -> int:
        """Host bytes of the examples and one epoch's order."""
        return self.examples.nbytes + 2 * 8 * len(self.examples)

    def rows_per_epoch(self) -> int:
        return len(self._epoch(0)[2]) - 1

    def steps_for(self, epochs: float) -> int:
        """Optimizer steps that draw `epochs` passes over the data (the first epoch's rows)."""
        return max(1, math.ceil(epochs * self.rows_per_epoch() / (self.cfg.batch_size * self.cfg.grad_accum)))

    def _epoch(self, epoch: int) -> tuple[int, np.ndarray, np.ndarray]:
        """The epoch's order of examples and where its rows begin in it [rows + 1]."""
        if self._plan is None or self._plan[0] != epoch:
            gen = torch.Generator().manual_seed(self.cfg.seed + epoch)
            order = torch.randperm(len(self.examples), generator=gen).numpy()
            bounds = (pack(self.examples.lengths[order], self.cfg.seq_len) if self.cfg.packing
                      else np.arange(len(order) + 1))
            self._plan = (epoch, order, bounds)
        return self._plan

    def _row(self, k: int) -> np.ndarray:
        """The examples of the k-th row drawn since the start."""
        epoch = 0
        while True:  # rows per epoch vary only with packing; each epoch's count is computed once
            if epoch == len(self._epochs):
                self._epochs.append(len(self._epoch(epoch)[2]) - 1)
            if k < self._epochs[epoch]:
                break
            k -= self._epochs[epoch]
            epoch += 1
        _, order, bounds = self._epoch(epoch)
        return order[bounds[k]: bounds[k + 1]]

    def next(self) -> Batch:
        b = self.cfg.batch_size
        rows = [self._row(self.position * b + j) for j in range(b)]
        self.position += 1
        return collate(self.examples, rows, self.pad_id, self.cfg.packing)


class EvalSource:
    """The held-out examples in their order, in batches of data.batch_size rows."""

    def __init__(self, cfg: DataConfig, examples: Examples, pad_id: int):
        self.cfg, self.examples, self.pad_id = cfg, examples, pad_id
        order = np.arange(len(examples))
        bounds = pack(examples.lengths, cfg.seq_len) if cfg.packing else np.arange(len(order) + 1)
        self.rows = [order[bounds[k]: bounds[k + 1]] for k in range(len(bounds) - 1)]

    @property
    def nbytes(self) -> int:
        return self.examples.nbytes

    def batches(self):
        b = self.cfg.batch_size
        for lo in range(0, len(self.rows), b):
            yield collate(self.examples, self.rows[lo: lo + b], self.pad_id, self.cfg.packing)


def pack(lengths: np.ndarray, seq_len: int) -> np.ndarray:
    """Row bounds [rows + 1] packing examples in the given order, greedily: an example starts a
    new row when it does not fit in the current one."""
    bounds, used = [0], 0
    for k, n in enumerate(lengths.tolist()):
        if used + n > seq_len:
            bounds.append(k)
            used = 0
        used += n
    bounds.append(len(lengths))
    return np.asarray(bounds, dtype=np.int64)


def collate(ex: Examples, rows: list[np.ndarray], pad_id: int, packed: bool) -> Batch:
    """Rows of examples as one micro-batch, padded to its longest row."""
    width = max(int(ex.lengths[r].sum()) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    positions = torch.zeros((len(rows), width), dtype=torch.long) if packed else None
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        at = 0
        for k in row.tolist():
            lo, n = int(ex.starts[k]), int(ex.lengths[k])
            tok = torch.from_numpy(ex.tokens[lo: lo + n].astype(np.int64))
            ids[i, at: at + n] = tok
            target = torch.from_numpy(ex.targets[lo: lo + n].copy())
            target[0] = False  # nothing in the row before it is its context
            labels[i, at: at + n] = tok.masked_fill(~target, IGNORE)
            mask[i, at: at + n] = 1
            if packed:
                positions[i, at: at + n] = torch.arange(n)
            at += n
    if packed:
        return Batch(ids, labels, None, positions)
    return Batch(ids, labels, mask)

"""Batches from tokenised examples: one seeded permutation per epoch, rows padded to the longest
of their batch (rounded up to data.pad_to_multiple_of, at most seq_len, where the batch is padded
at all), or several examples packed into one row.

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
        return collate(self.examples, rows, self.pad_id, self.cfg.packing, width_of(self.cfg))


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
            yield collate(self.examples, self.rows[lo: lo + b], self.pad_id, self.cfg.packing, width_of(self.cfg))


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


def width_of(cfg: DataConfig):
    """The width a batch whose longest row has n tokens is padded to: n rounded up to
    data.pad_to_multiple_of, at most data.seq_len (no row is longer)."""
    m = cfg.pad_to_multiple_of
    return lambda n: n if m is None else max(n, min(-(-n // m) * m, cfg.seq_len))


def collate(ex: Examples, rows: list[np.ndarray], pad_id: int, packed: bool, width_for=lambda n: n) -> Batch:
    """Rows of examples as one micro-batch [B, S], padded to `width_for` its longest row where the
    batch has a mask anyway (packed rows, rows of several lengths); rows all of one length stay
    unpadded, so their attention needs no mask (padding would add one).
    Vectorised: every token's source in the flat arrays and destination in the batch are computed
    at once."""
    order = np.concatenate(rows)  # the examples, row after row
    n = ex.lengths[order].astype(np.int64)
    row_of = np.repeat(np.arange(len(rows)), [len(r) for r in rows])
    begin = np.cumsum(n) - n  # where each example begins among all the batch's tokens
    first = np.cumsum([0] + [len(r) for r in rows[:-1]])  # each row's first example
    within = begin - begin[first][row_of]  # where each example begins in its row
    longest = int((within + n).max())
    width = width_for(longest) if packed or np.bincount(row_of, weights=n).min() < longest else longest
    at = np.arange(int(n.sum())) - np.repeat(begin, n)  # each token's position in its example
    src = np.repeat(ex.starts[order], n) + at
    dst = np.repeat(row_of * width + within, n) + at
    tokens = ex.tokens[src].astype(np.int64)
    target = ex.targets[src] & (at > 0)  # an example's first token has no context in the row
    ids = np.full(len(rows) * width, pad_id, dtype=np.int64)
    labels = np.full(len(rows) * width, IGNORE, dtype=np.int64)
    ids[dst] = tokens
    labels[dst] = np.where(target, tokens, IGNORE)
    shape = (len(rows), width)
    if packed:
        positions = np.zeros(len(rows) * width, dtype=np.int64)
        positions[dst] = at
        return Batch(torch.from_numpy(ids).view(shape), torch.from_numpy(labels).view(shape), None,
                     torch.from_numpy(positions).view(shape))
    mask = np.zeros(len(rows) * width, dtype=np.int64)
    mask[dst] = 1
    return Batch(torch.from_numpy(ids).view(shape), torch.from_numpy(labels).view(shape),
                 torch.from_numpy(mask).view(shape))

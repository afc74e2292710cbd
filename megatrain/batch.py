"""The unit of work the data gives the engine."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Batch:
    """One micro-batch on the host: token ids and labels [B, S] (-100: no loss), optional mask [B, S].

    Packed rows (data/source.py) carry position_ids [B, S] instead of a mask: positions restart at
    0 with each example, which keeps examples apart in attention (transformers' masking_utils); the
    padding after a row's last example has position 0 at every token."""
    input_ids: torch.Tensor
    labels: torch.Tensor
    attention_mask: torch.Tensor | None = None
    position_ids: torch.Tensor | None = None

    def sequence_lengths(self) -> list[int]:
        """Tokens of each sequence, padding left out (the FLOPs formula counts per sequence)."""
        if self.position_ids is not None:
            flat = self.position_ids.reshape(-1)
            starts = torch.nonzero(flat == 0).reshape(-1).tolist()  # every row starts at position 0
            ends = starts[1:] + [flat.numel()]
            return [e - s for s, e in zip(starts, ends) if e - s > 1]  # a sequence of one is padding
        mask = self.attention_mask if self.attention_mask is not None else torch.ones_like(self.input_ids)
        return [int(n) for n in mask.sum(dim=1)]

    def token_mask(self) -> torch.Tensor | None:
        """1 for each token of a sequence, 0 for padding, [B, S]; None where no token is padding.
        Packed rows have no mask: their padding is each token that starts a sequence of one (position
        0, followed by position 0 or the row's end), as `sequence_lengths` counts it."""
        if self.position_ids is None:
            return self.attention_mask
        starts = self.position_ids == 0
        alone = starts & torch.cat([starts[:, 1:], torch.ones_like(starts[:, :1])], dim=1)
        return None if not alone.any() else (~alone).to(self.input_ids.dtype)

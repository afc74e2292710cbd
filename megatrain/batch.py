"""The unit of work the data gives the engine."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Batch:
    """One micro-batch on the host: token ids and labels [B, S] (-100: no loss), optional mask [B, S]."""
    input_ids: torch.Tensor
    labels: torch.Tensor
    attention_mask: torch.Tensor | None = None

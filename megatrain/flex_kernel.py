"""Flex attention's kernel options on the layers of a plain micro-batch (no padding, no packing).

The library's flex attention passes `kernel_options` to torch's compiled kernel
(torch.nn.attention.flex_attention.FlexKernelOptions). Two of them are promises about the block
mask that let the kernel skip work: a query block's visited key blocks are consecutive
(BLOCKS_ARE_CONTIGUOUS: it steps to the next block instead of reading its index), and every query
sees a key in each block it visits first (ROWS_GUARANTEED_SAFE: no guard for rows that see nothing).
On rows with neither padding nor packing, a causal mask keeps both (a query's first block holds key
0) and a sliding window the first only (its first visited block holds none of a window's last
queries' keys: NaN with the second). The arithmetic is the same, so outputs and gradients are the
defaults' to the bit; at GPT-OSS-20B's shape the causal attention's forward and backward ran 5-7%
faster, the sliding window's 3% (the flex_options probe). Padding and packing leave rows that see
nothing and examples whose blocks start later, so those micro-batches keep the defaults.
"""
from __future__ import annotations

FLEX = "flex_attention"
OPTIONS = {"full_attention": {"ROWS_GUARANTEED_SAFE": True, "BLOCKS_ARE_CONTIGUOUS": True},
           "sliding_attention": {"BLOCKS_ARE_CONTIGUOUS": True}}


def attention_kwargs(implementation: str, layer_type: str, plain: bool) -> dict:
    """What a layer's call adds for its attention: its layer type's options where the model's
    attention is flex attention and the micro-batch is plain (no padding, no packing); else nothing."""
    if implementation == FLEX and plain and layer_type in OPTIONS:
        return {"kernel_options": OPTIONS[layer_type]}
    return {}

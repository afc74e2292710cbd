"""Flex attention's kernel options (flex_kernel.py): which layers and micro-batches get them, and
that the engine hands them to the attention of exactly those layers' calls."""
from __future__ import annotations

import pytest
import torch
from transformers.models.gpt_oss import modeling_gpt_oss

from megatrain import flex_kernel
from megatrain.batch import Batch
from megatrain.config import load_config
from megatrain.trainer import Trainer


SAFE, CONTIGUOUS = "ROWS_GUARANTEED_SAFE", "BLOCKS_ARE_CONTIGUOUS"


@pytest.mark.parametrize("implementation,layer_type,plain,given", [
    ("flex_attention", "full_attention", True, {SAFE, CONTIGUOUS}),
    ("flex_attention", "sliding_attention", True, {CONTIGUOUS}),  # a window's first block: none of its keys
    ("flex_attention", "full_attention", False, None),  # padding or packing: a row may attend to nothing
    ("flex_attention", "sliding_attention", False, None),
    ("sdpa", "full_attention", True, None),
    ("eager", "sliding_attention", True, None),
])
def test_options_only_for_flex_attention_on_plain_rows_safe_only_where_causal(implementation, layer_type, plain,
                                                                              given):
    got = flex_kernel.attention_kwargs(implementation, layer_type, plain)
    assert got == ({"kernel_options": dict.fromkeys(given, True)} if given else {})


def test_the_engine_hands_the_options_to_full_layers_of_plain_micro_batches(monkeypatch):
    """A tiny GPT-OSS (sliding and full layers alternating) on the CPU, its eager attention standing
    in for flex attention: each attention call of a step (forward and recompute) sees its layer type's
    options on a plain micro-batch, and none on a padded or packed one."""
    monkeypatch.setattr(flex_kernel, "FLEX", "eager")
    seen = []

    def spy(module, *args, kernel_options=None, **kwargs):
        seen.append((module.layer_idx, kernel_options))
        return eager(module, *args, **kwargs)

    eager = modeling_gpt_oss.eager_attention_forward
    monkeypatch.setattr(modeling_gpt_oss, "eager_attention_forward", spy)
    S = 16
    trainer = Trainer(load_config(base={"model": {"preset": "tiny-gpt-oss"}, "engine": {"device": "cpu"},
                                        "data": {"seq_len": S, "batch_size": 2}, "steps": 3}))
    ids = torch.randint(0, trainer.shape.vocab, (2, S), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, S // 2:] = 0
    positions = torch.cat([torch.arange(S // 2), torch.arange(S // 2)]).expand(2, S)
    batches = {"plain": Batch(ids, ids), "padded": Batch(ids, ids.masked_fill(mask == 0, -100), mask),
               "packed": Batch(ids, ids, position_ids=positions)}
    assert len({trainer.shape.layer_type(i) for i in range(trainer.shape.num_layers)}) == 2
    try:
        for name, batch in batches.items():
            seen.clear()
            trainer.train_step([batch])
            assert {i for i, _ in seen} == set(range(trainer.shape.num_layers)), name
            for index, options in seen:
                kind = trainer.shape.layer_type(index)
                assert options == (flex_kernel.OPTIONS[kind] if name == "plain" else None), (name, index)
    finally:
        trainer.close()

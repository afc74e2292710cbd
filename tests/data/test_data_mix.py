"""data.mix: datasets drawn in proportion to their weights, stopping as datasets'
interleave_datasets does (first_exhausted: nothing repeated; all_exhausted: everything used),
repeats referenced rather than copied, held-out examples taken from each dataset before the mix."""
from __future__ import annotations

import numpy as np
import pytest

from megatrain.config import DataConfig
from megatrain.data import make_sources
from test_data import save, write
from tiny_tokenizer import byte_tokenizer

pytest.importorskip("datasets")


def sources(tmp_path, sizes: dict[str, int]) -> dict[str, str]:
    """A file per name of `sizes` examples, each response naming its file."""
    return {name: write(tmp_path, [{"prompt": f"q{k}", "response": name} for k in range(n)], f"{name}.jsonl")
            for name, n in sizes.items()}


def drawn(src, tok) -> dict[str, int]:
    """How many examples of each file the source holds (by the response that names the file)."""
    e = src.examples
    texts = [tok.decode(e.tokens[s: s + n].tolist()) for s, n in zip(e.starts, e.lengths)]
    return {name: sum(t.endswith(f"\n{name}</s>") for t in texts) for name in ("alpha", "beta")}


@pytest.mark.parametrize("stopping, weights, expected", [
    ("first_exhausted", (1, 1), {"alpha": 2, "beta": 2}),  # beta's 2 bound it: 2 of alpha's 6
    ("all_exhausted", (1, 1), {"alpha": 6, "beta": 6}),  # beta's 2 three times each
    ("first_exhausted", (3, 1), {"alpha": 6, "beta": 2}),
    ("all_exhausted", (1, 3), {"alpha": 6, "beta": 18}),
])
def test_mixing_by_weight(tmp_path, stopping, weights, expected):
    tok = byte_tokenizer()
    files = sources(tmp_path, {"alpha": 6, "beta": 2})
    cfg = DataConfig(mix=dict(zip(files.values(), weights)), mix_stopping=stopping, format="instruction", seq_len=64)
    src, _ = make_sources(cfg, 300, save(tmp_path, tok))
    assert drawn(src, tok) == expected
    tokens = 6 * len("<q0\nalpha>") + 2 * len("<q0\nbeta>")  # a token a byte, BOS and EOS one each
    assert src.examples.tokens.size == tokens  # an example drawn twice is referenced twice, stored once
    again, _ = make_sources(cfg, 300, save(tmp_path, tok))
    assert np.array_equal(again.examples.starts, src.examples.starts)  # seeded


def test_held_out_examples_come_from_each_dataset_before_the_mix(tmp_path):
    tok = byte_tokenizer()
    files = sources(tmp_path, {"alpha": 10, "beta": 10})
    cfg = DataConfig(mix={files["alpha"]: 1, files["beta"]: 3}, mix_stopping="all_exhausted", format="instruction",
                     seq_len=64, eval_fraction=0.2)
    src, held = make_sources(cfg, 300, save(tmp_path, tok))
    assert drawn(held, tok) == {"alpha": 2, "beta": 2}
    assert not set(src.examples.starts.tolist()) & set(held.examples.starts.tolist())
    assert drawn(src, tok) == {"alpha": 8, "beta": 24}


def test_mix_settings_are_checked(tmp_path):
    files = sources(tmp_path, {"alpha": 2, "beta": 2})
    with pytest.raises(ValueError, match="data.source file reads data.path, or data.mix .*: give one"):
        DataConfig(path=files["alpha"], mix={files["beta"]: 1})
    with pytest.raises(ValueError, match="data.mix: the weight of .*beta.jsonl must be a positive number, not -1"):
        DataConfig(mix={files["alpha"]: 1, files["beta"]: -1})
    with pytest.raises(ValueError, match="data.mix 'nowhere.jsonl' does not exist"):
        DataConfig(mix={"nowhere.jsonl": 1})
    with pytest.raises(ValueError, match="data.subset, data.split and data.eval_split name a part of one dataset"):
        DataConfig(mix={files["alpha"]: 1}, split="test")

"""One training example as the model gets it, its targets marked: `megatrain data`, to see what a
format and a chat template make of the data before training on it."""
from __future__ import annotations

import numpy as np

from megatrain.config import TrainConfig
from megatrain.data.pipeline import Examples

OPEN, CLOSE = "[[", "]]"  # around each run of target tokens, as the tests' expected renders


def marked(examples: Examples, index: int, tok) -> str:
    """Example `index` decoded, each run of consecutive target tokens between OPEN and CLOSE."""
    start, length = int(examples.starts[index]), int(examples.lengths[index])
    ids = examples.tokens[start: start + length].tolist()
    targets = examples.targets[start: start + length]
    # the runs of equal target flags: each decoded alone, so a marker falls between tokens
    edges = [0, *(np.flatnonzero(np.diff(targets.astype(np.int8))) + 1).tolist(), length]
    out = []
    for lo, hi in zip(edges, edges[1:]):
        text = tok.decode(ids[lo:hi], skip_special_tokens=False)
        out.append(f"{OPEN}{text}{CLOSE}" if targets[lo] else text)
    return "".join(out)


def show(cfg: TrainConfig, index: int) -> str:
    """The data's summary and training example `index` with its targets marked."""
    from megatrain.data import load_tokenizer, make_sources
    from megatrain.shapes import ModelShape, load_hf_config
    if cfg.data.source != "file":
        raise ValueError("megatrain data shows data from a file or the Hub: set data.path (or data.mix)")
    vocab = ModelShape(load_hf_config(cfg.model)).vocab
    train, held = make_sources(cfg.data, vocab, cfg.model.pretrained)
    examples = train.examples
    if not 0 <= index < len(examples):
        raise ValueError(f"--example {index}: the training data has examples 0 to {len(examples) - 1}")
    tok = load_tokenizer(cfg.data.tokenizer or cfg.model.pretrained, cfg.data.chat_template)
    dropped = {k: v for k, v in examples.dropped.items() if v}
    start, length = int(examples.starts[index]), int(examples.lengths[index])
    learned = int(examples.targets[start + 1: start + length].sum())  # an example's first token is never predicted
    return "\n".join([
        f"data: {cfg.data.path or cfg.data.mix} ({cfg.data.format}): {len(examples):,} training examples"
        + (f", {len(held.examples):,} held out" if held else "")
        + (f"; left out: {dropped}" if dropped else "")
        + f"; cut to data.seq_len {cfg.data.seq_len}: {examples.truncated:,}",
        f"example {index}: {length} tokens, {learned} of them targets, marked {OPEN} {CLOSE}:",
        marked(examples, index, tok)])

"""Training data: formats (formats.py), files to compact tokenised examples (pipeline.py),
batches (source.py), and synthetic tokens (synthetic.py).

    train, held_out = make_sources(cfg, vocab, tokenizer_dir)
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from megatrain.config import DataConfig
from megatrain.data.source import EvalSource, FileSource
from megatrain.data.synthetic import SyntheticSource

__all__ = ["EvalSource", "FileSource", "SyntheticSource", "load_tokenizer", "make_source", "make_sources"]


def load_tokenizer(path: str | None, chat_template: str | None = None):
    """The fast tokenizer at `path`, with the chat template of `chat_template` (data.chat_template:
    a .jinja file or a tokenizer's directory) where one is given."""
    if path is None:
        raise ValueError("data.tokenizer: a tokenizer (a local directory or a Hub model id) is needed to read text data")
    from transformers import AutoTokenizer
    if not Path(path).is_dir():
        raise ValueError(f"data.tokenizer: {path} {'is not a directory' if Path(path).exists() else 'does not exist'} "
                         f"(a local tokenizer's: tokenizer.json, tokenizer_config.json)")
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"data.tokenizer: cannot load a tokenizer from {path}: {e}") from None
    if not tok.is_fast:
        raise ValueError(f"data.tokenizer: {path} has no fast tokenizer (tokenizer.json), which the data needs")
    if chat_template:
        tok.chat_template = _chat_template(chat_template)
    return tok


def _chat_template(path: str) -> str:
    if Path(path).is_file():
        return Path(path).read_text()
    from transformers import AutoTokenizer
    try:
        template = AutoTokenizer.from_pretrained(path).chat_template
    except (OSError, ValueError) as e:
        raise ValueError(f"data.chat_template: cannot load a tokenizer from {path}: {e}") from None
    if not isinstance(template, str):  # None, or several named templates
        raise ValueError(f"data.chat_template: the tokenizer in {path} has no single chat template")
    return template


def make_sources(cfg: DataConfig, vocab: int, tokenizer_dir: str | None
                 ) -> tuple[FileSource | SyntheticSource, EvalSource | None]:
    """The training source and the held-out set (None without data.eval_path or eval_fraction)."""
    if cfg.source == "synthetic":
        return SyntheticSource(cfg, vocab), None
    from megatrain.data import pipeline
    tok = load_tokenizer(cfg.tokenizer or tokenizer_dir, cfg.chat_template)
    pad = next(t for t in (tok.pad_token_id, tok.eos_token_id, 0) if t is not None)

    def read(path: str, setting: str, subset: str | None, split: str | None):
        name = path if split is None else f"{path} (split {split})"
        rows = pipeline.load_rows(path, setting, subset, split)
        return pipeline.examples(pipeline.tokenize(rows, cfg, tok, name), cfg, vocab, name)

    def hold_out(examples: pipeline.Examples, name: str) -> tuple[pipeline.Examples, pipeline.Examples]:
        order = np.random.default_rng(cfg.seed).permutation(len(examples))
        cut = max(1, round(cfg.eval_fraction * len(examples)))
        if cut >= len(examples):
            raise ValueError(f"data.eval_fraction {cfg.eval_fraction} leaves no training example of {len(examples)} "
                             f"in {name}")
        return examples.subset(np.sort(order[cut:])), examples.subset(np.sort(order[:cut]))

    held = None
    if cfg.mix:  # each dataset's held-out part taken before the mix, which may repeat examples
        parts = [read(path, f"data.mix {path}", None, None) for path in cfg.mix]
        if cfg.eval_fraction:
            parts, held_parts = zip(*(hold_out(p, name) for p, name in zip(parts, cfg.mix)))
            held = pipeline.concat(list(held_parts))
        examples = pipeline.mix(list(parts), list(cfg.mix.values()), cfg.mix_stopping, cfg.seed)
    else:
        examples = read(cfg.path, "data.path", cfg.subset, cfg.split)
        if cfg.eval_fraction:
            examples, held = hold_out(examples, cfg.path)
    if cfg.eval_path:
        held = read(cfg.eval_path, "data.eval_path", None, None)
    elif cfg.eval_split:
        held = read(cfg.path, "data.eval_split", cfg.subset, cfg.eval_split)
    return FileSource(cfg, examples, pad), (EvalSource(cfg, held, pad) if held is not None else None)


def make_source(cfg: DataConfig, vocab: int, tokenizer_dir: str | None) -> FileSource | SyntheticSource:
    """The training source alone (the harness's systems read it)."""
    return make_sources(cfg, vocab, tokenizer_dir)[0]

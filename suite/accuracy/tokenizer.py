"""A tokenizer for the generated problems, built from their text (no downloads).

Words, single digits (so that numbers are spelled digit by digit, which arithmetic needs), single
whitespace characters and single punctuation marks are tokens; decoding concatenates them, so the
text comes back exactly. A MetaMathQA run uses the pretrained model's own tokenizer instead.
"""
from __future__ import annotations

import re
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIALS = ["<pad>", "<eos>", "<unk>"]
PIECE = r"[A-Za-z]+|\d|\s|[^A-Za-z\d\s]"


def build(texts: list[str], path: str | Path) -> PreTrainedTokenizerFast:
    """A word/digit-level tokenizer covering every piece of `texts`, saved at `path`."""
    pieces = sorted({piece for text in texts for piece in re.findall(PIECE, text)})
    vocab = {token: i for i, token in enumerate(SPECIALS + pieces)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(PIECE), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")
    fast.save_pretrained(path)
    return fast

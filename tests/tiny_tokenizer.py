"""A word-level tokenizer built on the spot (no downloads), with a chat template."""
from __future__ import annotations

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

WORDS = ["<pad>", "<eos>", "<unk>", "user:", "assistant:", "what", "is", "two", "plus", "three", "five",
         "the", "answer", "hello", "world", "a", "b", "c"]
CHAT = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} <eos> {% endfor %}"


def save_tokenizer(path) -> PreTrainedTokenizerFast:
    vocab = {w: i for i, w in enumerate(WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")
    fast.chat_template = CHAT
    fast.save_pretrained(path)
    return fast

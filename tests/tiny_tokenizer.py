"""A word-level tokenizer built on the spot (no downloads), with a chat template."""
from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
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


FIXTURES = Path(__file__).parent / "fixtures" / "chat_templates"
# per family: the published chat template (tests/fixtures), the special tokens it uses, and the
# tokens the real vocabulary adds whole but not as special ones (Qwen's tool and think tags)
QWEN_TOOLS = ["<tool_call>", "</tool_call>"]
QWEN3_TAGS = [*QWEN_TOOLS, "<tool_response>", "</tool_response>", "<think>", "</think>"]
ADDED = {"qwen2.5": QWEN_TOOLS, "qwen3": QWEN3_TAGS}
FAMILIES = {
    "llama3": ("llama3.jinja", dict(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>"),
               ["<|start_header_id|>", "<|end_header_id|>", "<|end_of_text|>"]),
    "llama3.1": ("llama3.1.jinja", dict(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>"),
                 ["<|start_header_id|>", "<|end_header_id|>", "<|end_of_text|>"]),
    "qwen2": ("qwen2.jinja", dict(eos_token="<|im_end|>", pad_token="<|endoftext|>"), ["<|im_start|>"]),
    "qwen2.5": ("qwen2.5.jinja", dict(eos_token="<|im_end|>", pad_token="<|endoftext|>"), ["<|im_start|>"]),
    "qwen3": ("qwen3.jinja", dict(eos_token="<|im_end|>", pad_token="<|endoftext|>"), ["<|im_start|>"]),
    "mistral-v0.3": ("mistral-v0.3.jinja", dict(bos_token="<s>", eos_token="</s>", unk_token="<unk>"),
                     ["[INST]", "[/INST]"]),
    "chatml-generation": ("chatml-generation.jinja", dict(eos_token="<|im_end|>"), ["<|im_start|>"]),
}


def byte_tokenizer(family: str | None = None, merges: list[tuple[str, str]] = (("Ġ", "P"), ("Ġ", "R"))):
    """A byte-level BPE tokenizer (one token per byte, plus `merges`) with a family's special
    tokens and published chat template: every text tokenizes, with offsets, as in the real ones."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=list(merges)))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    if family is None:
        return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    template, named, extra = FAMILIES[family]
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, additional_special_tokens=extra, **named)
    fast.add_tokens(ADDED.get(family, []))
    fast.chat_template = (FIXTURES / template).read_text()
    return fast

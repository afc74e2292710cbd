"""Training data: micro-batches of token ids and labels, from local files or synthetic tokens.

Files load through `datasets` (json, jsonl, parquet, txt). Formats:
  text         one text field; documents are tokenized, joined with EOS and packed into seq_len
  instruction  prompt and response fields; the prompt is masked out of the labels
  chat         a list of {role, content} messages; only assistant turns carry labels
Instruction and chat examples are padded to seq_len (padding masked out of attention and loss)
and truncated to it. A source's `position` (batches drawn) is saved with the training state, so
a resumed run continues with the same data.
"""
from __future__ import annotations

from pathlib import Path

import torch

from megatrain.config import DataConfig
from megatrain.batch import Batch
from megatrain.loss import IGNORE

_LOADERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".txt": "text"}


class SyntheticSource:
    """Uniform random tokens, a fixed function of (seed, batch index): for benchmarks and tests."""

    def __init__(self, cfg: DataConfig, vocab: int):
        self.cfg, self.vocab = cfg, vocab
        self.position = 0

    def next(self) -> Batch:
        index = 0 if self.cfg.repeat_batch else self.position
        gen = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + index)
        self.position += 1
        ids = torch.randint(0, self.vocab, (self.cfg.batch_size, self.cfg.seq_len), generator=gen)
        return Batch(ids, ids.clone())


class FileSource:
    """Examples tokenized once up front; batches drawn in a seeded order, reshuffled each epoch."""

    def __init__(self, cfg: DataConfig, vocab: int, tokenizer_dir: str | None):
        self.cfg = cfg
        suffix = Path(cfg.path).suffix
        if suffix not in _LOADERS:
            raise ValueError(f"data.path: unsupported file type {suffix!r}; use one of {sorted(_LOADERS)}")
        if tokenizer_dir is None:
            raise ValueError("data.tokenizer: a local tokenizer directory is needed to read text data")
        from datasets import load_dataset
        from transformers import AutoTokenizer
        try:
            self.tok = AutoTokenizer.from_pretrained(tokenizer_dir)
        except (OSError, ValueError) as e:
            raise ValueError(f"data.tokenizer: cannot load a tokenizer from {tokenizer_dir}: {e}") from None
        rows = load_dataset(_LOADERS[suffix], data_files=str(cfg.path), split="train")
        needed = {"text": [cfg.text_field if suffix != ".txt" else "text"],
                  "instruction": [cfg.prompt_field, cfg.response_field],
                  "chat": [cfg.messages_field]}[cfg.format]
        missing = [c for c in needed if c not in rows.column_names]
        if missing:
            raise ValueError(f"data: {cfg.path} lacks column(s) {missing} needed by format {cfg.format!r}; "
                             f"it has {rows.column_names}")
        if len(rows) == 0:
            raise ValueError(f"data: {cfg.path} holds no examples")
        formats = {"text": self._text, "instruction": self._instruction, "chat": self._chat}
        examples = formats[cfg.format](rows, needed)
        if not examples:
            raise ValueError(f"data: {cfg.path} yields no sequence of {cfg.seq_len} tokens")
        too_big = max(int(i.max()) for i, _, _ in examples)
        if too_big >= vocab:
            raise ValueError(f"data: token id {too_big} is outside the model's vocabulary of {vocab}")
        self.examples = examples
        self.position = 0

    def _text(self, rows, fields) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
        eos = self.tok.eos_token_id
        stream: list[int] = []
        for text in rows[fields[0]]:
            stream += self.tok(text, add_special_tokens=False)["input_ids"] + ([eos] if eos is not None else [])
        n = self.cfg.seq_len
        out = []
        for lo in range(0, len(stream) - n + 1, n):
            ids = torch.tensor(stream[lo: lo + n])
            out.append((ids, ids.clone(), n))
        return out

    def _instruction(self, rows, fields) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
        eos = self.tok.eos_token_id
        out = []
        for prompt, response in zip(rows[fields[0]], rows[fields[1]]):
            p = self.tok(prompt, add_special_tokens=False)["input_ids"]
            r = self.tok(response, add_special_tokens=False)["input_ids"] + ([eos] if eos is not None else [])
            out.append(self._pad(p + r, [IGNORE] * len(p) + r))
        return out

    def _chat(self, rows, fields) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
        if self.tok.chat_template is None:
            raise ValueError("data.format chat needs a tokenizer with a chat template")
        out = []
        for messages in rows[fields[0]]:
            ids: list[int] = []
            labels: list[int] = []
            for k in range(len(messages)):
                # the template applied to growing prefixes: each turn's new tokens, labelled by role
                text = self.tok.apply_chat_template(messages[: k + 1], tokenize=False)
                full = self.tok(text, add_special_tokens=False)["input_ids"]
                new = full[len(ids):]
                ids = full
                labels += new if messages[k]["role"] == "assistant" else [IGNORE] * len(new)
            out.append(self._pad(ids, labels))
        return out

    def _pad(self, ids: list[int], labels: list[int]) -> tuple[torch.Tensor, torch.Tensor, int]:
        n = self.cfg.seq_len
        ids, labels = ids[:n], labels[:n]
        pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else 0
        fill = n - len(ids)
        return torch.tensor(ids + [pad] * fill), torch.tensor(labels + [IGNORE] * fill), len(ids)

    def next(self) -> Batch:
        b = self.cfg.batch_size
        picks = [self._order(self.position * b + k) for k in range(b)]
        self.position += 1
        ids = torch.stack([self.examples[i][0] for i in picks])
        labels = torch.stack([self.examples[i][1] for i in picks])
        lengths = torch.tensor([self.examples[i][2] for i in picks])
        mask = (torch.arange(ids.shape[1]) < lengths[:, None]).long()
        return Batch(ids, labels, mask)

    def _order(self, k: int) -> int:
        n = len(self.examples)
        epoch, index = divmod(k, n)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(self.cfg.seed + epoch))
        return int(perm[index])


def make_source(cfg: DataConfig, vocab: int, tokenizer_dir: str | None):
    if cfg.source == "synthetic":
        return SyntheticSource(cfg, vocab)
    return FileSource(cfg, vocab, cfg.tokenizer or tokenizer_dir)

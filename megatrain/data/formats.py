"""Examples as token ids and a target flag per token, by data format.

Every example becomes `input_ids` and `targets` (1: the loss learns this token, 0: context only),
or a `problem` saying why it cannot be used. Formats:
  text         one text field; documents end with EOS (the pipeline joins and cuts them into seq_len)
  instruction  prompt and response fields; alpaca: instruction (+ input) and output
  chat         a list of {role, content} messages; sharegpt: `conversations` of {from, value}

Chat masks. Only the assistant's content and its end-of-turn token are targets: never a role
header, a system or user message, or text the template adds (Qwen3's empty think block). Where the
template marks the assistant's tokens itself ({% generation %} blocks), its mask is used
(`apply_chat_template(return_assistant_tokens_mask=True)`). Otherwise the conversation is rendered
once and each assistant message is found in the rendered text, in order, as its content (or the
content trimmed, which Llama 3 and Mistral templates do) followed by optional whitespace and a
special token (the end of its turn; user messages are found the same way, so that a reply is never
taken from a user's text); the tokens covering it are the targets, and the next special
token too. Each example is checked: a token that spans content and template text (other than
whitespace), an assistant message not found, or targets that do not decode to the content make
the example unmaskable (reported with its index), never silently mislabelled; so is a reply the
template rewrites beyond trimming (Qwen3 takes a `<think>` block out of the turns before the last
user message). Rendering the whole conversation once is what the model sees; diffing renders of
growing prefixes is wrong for every template that renders an earlier turn differently once later
turns follow (Qwen3 adds an empty think block only to the turns after the last user message;
Mistral v0.3 puts the system message into the last user turn only, so a chat that ends with a
reply is rendered without it, as the published template does).

Instruction data goes through the chat template (the prompt as the user's turn, the response as
the assistant's) when the tokenizer has one (data.template: auto or chat), else through the plain
template: BOS (if the tokenizer has one) + prompt + data.separator + response + EOS, where the
response and EOS are the targets; prompt and response are tokenized apart, as at generation.
"""
from __future__ import annotations

import bisect
import re
from typing import Any

import numpy as np

from megatrain.config import DataConfig

ALPACA = ("instruction", "input", "output")
SHAREGPT = "conversations"
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system"}
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")


def columns(cfg: DataConfig) -> list[str]:
    """The fields a format reads."""
    return {"text": [cfg.text_field], "instruction": [cfg.prompt_field, cfg.response_field],
            "alpaca": list(ALPACA), "chat": [cfg.messages_field], "sharegpt": [SHAREGPT]}[cfg.format]


def uses_chat_template(cfg: DataConfig, tok) -> bool:
    if cfg.format in ("chat", "sharegpt"):
        return True
    if cfg.format == "text" or cfg.template == "plain":
        return False
    return cfg.template == "chat" or tok.chat_template is not None


def encode(rows: dict[str, list], cfg: DataConfig, tok) -> dict[str, list]:
    """A batch of rows (column -> values) as input_ids, targets and problem ('' when usable)."""
    n = len(next(iter(rows.values())))
    if cfg.format == "text":
        eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
        ids = [x + eos for x in tok(rows[cfg.text_field], add_special_tokens=False)["input_ids"]]
        return {"input_ids": ids, "targets": [[1] * len(x) for x in ids], "problem": [""] * n}
    if cfg.format in ("instruction", "alpaca"):
        prompts, responses = _instructions(rows, cfg)
        if not uses_chat_template(cfg, tok):
            return _plain(prompts, responses, cfg, tok)
        convs: list[Any] = [[{"role": "user", "content": p}, {"role": "assistant", "content": r}]
                            for p, r in zip(prompts, responses)]
    elif cfg.format == "sharegpt":
        convs = [_sharegpt(c) for c in rows[SHAREGPT]]
    else:
        convs = [_messages(c) for c in rows[cfg.messages_field]]
    return encode_chats(convs, tok)


def _instructions(rows: dict[str, list], cfg: DataConfig) -> tuple[list[str], list[str]]:
    if cfg.format == "instruction":
        return [str(p) for p in rows[cfg.prompt_field]], [str(r) for r in rows[cfg.response_field]]
    instruction, extra, output = (rows[c] for c in ALPACA)
    # Alpaca's layout: the input, where there is one, follows the instruction after a blank line
    prompts = [f"{i}\n\n{x}" if x else str(i) for i, x in zip(instruction, extra)]
    return prompts, [str(o) for o in output]


def _plain(prompts: list[str], responses: list[str], cfg: DataConfig, tok) -> dict[str, list]:
    bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    p_ids = tok([p + cfg.separator for p in prompts], add_special_tokens=False)["input_ids"]
    r_ids = tok(responses, add_special_tokens=False)["input_ids"]
    ids, targets = [], []
    for p, r in zip(p_ids, r_ids):
        ids.append(bos + p + r + eos)
        targets.append([0] * (len(bos) + len(p)) + [1] * (len(r) + len(eos)))
    return {"input_ids": ids, "targets": targets, "problem": [""] * len(ids)}


def _messages(conv) -> list[dict] | str:
    """A chat example's messages, or why they are unusable."""
    if not isinstance(conv, list) or not conv:
        return "the messages are not a non-empty list"
    for m in conv:
        if not isinstance(m, dict) or "role" not in m or not isinstance(m.get("content"), str):
            return "a message lacks a role or a string content"
    # datasets fills keys that other rows have with None (a column of structs): drop them
    return [{k: v for k, v in m.items() if v is not None} for m in conv]


def _sharegpt(conv) -> list[dict] | str:
    if not isinstance(conv, list) or not conv:
        return "the conversations are not a non-empty list"
    out = []
    for m in conv:
        role = SHAREGPT_ROLES.get(m.get("from")) if isinstance(m, dict) else None
        if role is None or not isinstance(m.get("value"), str):
            return f"a turn's 'from' must be one of {sorted(SHAREGPT_ROLES)} with a string 'value'; got {m!r}"
        out.append({"role": role, "content": m["value"]})
    return out


def encode_chats(convs: list[list[dict] | str], tok) -> dict[str, list]:
    """Conversations as ids and exact assistant masks (see the module's docstring)."""
    # numpy rows: datasets writes them to Arrow without a Python object per token
    ids = [np.empty(0, dtype=np.int32) for _ in convs]
    targets = [np.empty(0, dtype=bool) for _ in convs]
    problems = [c if isinstance(c, str) else "" for c in convs]
    good = [k for k, c in enumerate(convs) if not isinstance(c, str)]
    if not good:
        return {"input_ids": ids, "targets": targets, "problem": problems}
    if tok.chat_template is None:
        raise ValueError("data.tokenizer: this format needs a tokenizer with a chat template "
                         "(or data.template: plain for instruction data)")
    rendered: list[str | None] = [None] * len(convs)
    for k in good:  # one by one: a template that raises on one example names that example
        try:
            rendered[k] = tok.apply_chat_template(convs[k], tokenize=False)
        except Exception as e:  # jinja's TemplateError and whatever the template raises
            problems[k] = f"the chat template refused it: {e}"
    good = [k for k in good if rendered[k] is not None]
    if _GENERATION.search(tok.chat_template):
        for k in good:
            enc = tok.apply_chat_template(convs[k], tokenize=True, return_dict=True,
                                          return_assistant_tokens_mask=True)
            ids[k] = np.asarray(enc["input_ids"], dtype=np.int32)
            targets[k] = np.asarray(enc["assistant_masks"], dtype=bool)
        return {"input_ids": ids, "targets": targets, "problem": problems}
    enc = tok([rendered[k] for k in good], add_special_tokens=False, return_offsets_mapping=True)
    special = _special_strings(tok)
    special_ids = set(tok.convert_tokens_to_ids(sorted(special)))
    for j, k in enumerate(good):
        tids, offsets = enc["input_ids"][j], enc["offset_mapping"][j]
        try:
            mask = _mask(convs[k], rendered[k], tids, offsets, special, special_ids, tok)
        except _Unmaskable as e:
            problems[k] = str(e)
            continue
        ids[k], targets[k] = np.asarray(tids, dtype=np.int32), np.asarray(mask, dtype=bool)
    return {"input_ids": ids, "targets": targets, "problem": problems}


class _Unmaskable(Exception):
    pass


def _special_strings(tok) -> set[str]:
    out = {t.content for t in tok.added_tokens_decoder.values() if t.special}
    return out | set(tok.all_special_tokens)


def _find(text: str, content: str, start: int, special: set[str]) -> tuple[int, int] | None:
    """Where `content` (or it trimmed) is rendered at or after `start`, followed by whitespace and
    a special token (the end of its turn): that tells a message from the same characters in a
    role header or the system prompt."""
    for candidate in dict.fromkeys((content, content.strip())):
        if not candidate:
            continue
        at = text.find(candidate, start)
        while at >= 0:
            end = at + len(candidate)
            rest = text[end:].lstrip()
            if any(rest.startswith(s) for s in special):
                return at, end
            at = text.find(candidate, at + 1)
    return None


def _mask(messages: list[dict], text: str, ids: list[int], offsets: list[tuple[int, int]],
          special: set[str], special_ids: set[int], tok) -> list[int]:
    mask = [0] * len(ids)
    starts = [s for s, _ in offsets]
    ends = [e for _, e in offsets]
    cursor = 0
    for turn, m in enumerate(messages):
        assistant = m["role"] == "assistant"
        if not assistant and m["role"] != "user":
            # system and tool messages carry no target; templates move or drop them (Mistral
            # v0.3 renders the system message only in the last user turn)
            continue
        if not m["content"].strip():
            continue  # an empty reply teaches nothing
        span = _find(text, m["content"], cursor, special)
        if span is None:
            raise _Unmaskable(f"message {turn} ({m['role']}) is not rendered verbatim by the chat template")
        lo, hi = span
        cursor = hi
        if not assistant:
            continue
        # the tokens overlapping [lo, hi): offsets ascend, so the first and the last one can spill over
        first = bisect.bisect_right(ends, lo)
        last = bisect.bisect_left(starts, hi) - 1
        if first > last:
            raise _Unmaskable(f"message {turn}: no token covers the assistant's content")
        for i in (first, last):
            s, e = offsets[i]
            if text[s:lo].strip() or text[hi:e].strip():
                raise _Unmaskable(f"message {turn}: token {i} spans the assistant's content and template text")
        mask[first: last + 1] = [1] * (last + 1 - first)
        decoded = tok.backend_tokenizer.decode(ids[first: last + 1], skip_special_tokens=False)
        if "".join(decoded.split()) != "".join(text[lo:hi].split()):
            raise _Unmaskable(f"message {turn}: the tokens of the assistant's content do not decode to it")
        # the end of turn: whitespace tokens, then the special token the model must learn to emit
        i = last + 1
        while i < len(ids) and ids[i] not in special_ids and not text[offsets[i][0]:offsets[i][1]].strip():
            mask[i] = 1
            i += 1
        if i == len(ids) or ids[i] not in special_ids:
            raise _Unmaskable(f"message {turn}: no end-of-turn token follows the assistant's content")
        mask[i] = 1
        cursor = max(cursor, offsets[i][1])
    return mask

"""Examples as token ids and a target flag per token, by data format.

Every example becomes `input_ids` and `targets` (1: the loss learns this token, 0: context only),
or a `problem` saying why it cannot be used, and the `row` it comes from. Formats:
  text         one text field; documents end with EOS (the pipeline joins and cuts them into seq_len)
  instruction  prompt and response fields; alpaca: instruction (+ input) and output, after the
               turns of its optional `system` and `history` columns (chat templates only)
  chat         a list of {role, content} messages (an assistant's may carry `tool_calls` and its
               thinking as `reasoning_content`; `tool` messages answer calls), with the row's
               tools (data.tools_field) rendered by the template; sharegpt: `conversations` of
               {from, value} (LlamaFactory's function_call and observation turns too), with
               optional `system` and `tools` columns

Chat masks. The targets are what the model generates in each assistant turn: its content, its
thinking and its tool calls as the template renders them, and its end-of-turn token; never a role
header, a system, user or tool message, or text the template adds (Qwen3's empty think block).
Where the template marks the assistant's tokens itself ({% generation %} blocks), its mask is used
(`apply_chat_template(return_assistant_tokens_mask=True)`), and a conversation whose tools, thinking
or tool calls it does not render is refused. Otherwise the conversation is rendered
once and each assistant turn is found in the rendered text, in order:
- a turn of content alone, as its content (or the content trimmed, which Llama 3 and Mistral
  templates do) followed by optional whitespace and a special token (the end of its turn; user
  messages are found the same way, so that a reply is never taken from a user's text); the tokens
  covering it are the targets, and the next special token too;
- a turn with tool calls or thinking, or whose content is not rendered verbatim, as the template
  renders it when generated: the render of the conversation up to it with the generation prompt,
  and what the render with the turn adds to that, through its last special token (its end of
  turn), less the text the template adds to any reply there (Qwen3's empty think block). The
  thinking and every tool call must be in it, and the row's tools in the prompt, or the example
  is refused (a template without tools or thinking would drop them silently). Where the whole
  render begins with that prompt and reply (with or without that text), the reply's tokens there
  are the targets; else (Qwen3 drops the thinking of the turns before the last user message, in
  content or as `reasoning_content`) the turn becomes an example of its own, the prompt it
  answered and its reply, the reply the only target, and the whole conversation trains the other
  turns. So a turn with thinking or tool calls is trained in exactly the context the template
  gives it when it is generated. A turn of content alone is labelled in the whole render, which is what the model
sees: diffing renders of growing prefixes for every turn would split most chats, since templates
render earlier turns differently once later turns follow (Qwen3 adds an empty think block only to
the turns after the last user message; Mistral v0.3 puts the system message into the last user
turn only, so a chat that ends with a reply is rendered without it, as the published template does).
Each example is checked: a token that spans the reply and template text (other than whitespace),
a user message not found, or targets that do not decode to the reply make it unmaskable
(reported with its row), never silently mislabelled.

Instruction data goes through the chat template (the prompt as the user's turn, the response as
the assistant's) when the tokenizer has one (data.template: auto or chat), else through the plain
template: BOS (if the tokenizer has one) + prompt + data.separator + response + EOS, where the
response and EOS are the targets; prompt and response are tokenized apart, as at generation.
"""
from __future__ import annotations

import bisect
import json
import re
from typing import Any

import numpy as np

from megatrain.config import DataConfig

ALPACA = ("instruction", "input", "output")
ALPACA_CONTEXT = ("system", "history")  # optional columns: read where the data has them
SHAREGPT = "conversations"
# LlamaFactory's tool turns: function_call (the call as JSON) and observation (its result)
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system", "function_call": "assistant", "observation": "tool"}
SHAREGPT_CONTEXT = ("system", "tools")  # optional columns: read where the data has them
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


def encode(rows: dict[str, list], cfg: DataConfig, tok, indices: list[int] | None = None) -> dict[str, list]:
    """A batch of rows (column -> values; `indices`: their numbers in the dataset) as input_ids,
    targets, problem ('' when usable) and row (the row an example comes from: a chat may make one
    example per assistant turn)."""
    n = len(next(iter(rows.values())))
    indices = list(range(n)) if indices is None else list(indices)
    if cfg.format == "text":
        eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
        ids = [x + eos for x in tok(rows[cfg.text_field], add_special_tokens=False)["input_ids"]]
        return {"input_ids": ids, "targets": [[1] * len(x) for x in ids], "problem": [""] * n, "row": indices}
    if cfg.format in ("instruction", "alpaca"):
        prompts, responses = _instructions(rows, cfg)
        context = [_alpaca_context(rows, k) for k in range(n)] if cfg.format == "alpaca" else [[]] * n
        if not uses_chat_template(cfg, tok):
            out = {**_plain(prompts, responses, cfg, tok), "row": indices}
            if cfg.targets == "all":
                out["targets"] = [[1] * len(x) for x in out["targets"]]
            for k in (k for k, c in enumerate(context) if c):  # the plain template has no place for them
                out["input_ids"][k], out["targets"][k] = [], []
                out["problem"][k] = context[k] if isinstance(context[k], str) else \
                    "its system and history need a chat template (data.template: chat, or data.chat_template)"
            return out
        convs: list[Any] = [c if isinstance(c, str) else [*c, {"role": "user", "content": p}, {"role": "assistant", "content": r}]
                            for c, p, r in zip(context, prompts, responses)]
    elif cfg.format == "sharegpt":
        convs = [_sharegpt(c, rows["system"][k] if "system" in rows else None) for k, c in enumerate(rows[SHAREGPT])]
    else:
        convs = [_messages(c) for c in rows[cfg.messages_field]]
    column = {"chat": cfg.tools_field, "sharegpt": "tools"}.get(cfg.format)
    tools = [_tools(t) for t in rows[column]] if column in rows else None
    return encode_chats(convs, tok, tools, indices, cfg.targets)


def _instructions(rows: dict[str, list], cfg: DataConfig) -> tuple[list[str], list[str]]:
    if cfg.format == "instruction":
        return [str(p) for p in rows[cfg.prompt_field]], [str(r) for r in rows[cfg.response_field]]
    instruction, extra, output = (rows[c] for c in ALPACA)
    # Alpaca's layout: the input, where there is one, follows the instruction after a blank line
    prompts = [f"{i}\n\n{x}" if x else str(i) for i, x in zip(instruction, extra)]
    return prompts, [str(o) for o in output]


def _alpaca_context(rows: dict[str, list], k: int) -> list[dict] | str:
    """Row k's turns before its instruction, from Alpaca's optional `system` and `history`
    ([prompt, response] pairs, LlamaFactory's layout) columns, or why they are unusable."""
    system = rows["system"][k] if "system" in rows else None
    history = rows["history"][k] if "history" in rows else None
    if system is not None and not isinstance(system, str):
        return f"its system is {system!r}, not a string"
    turns = [{"role": "system", "content": system}] if system else []
    for pair in history or []:
        if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(x, str) for x in pair)):
            return f"its history must be a list of [prompt, response] pairs of strings, not {history!r}"
        turns += [{"role": "user", "content": pair[0]}, {"role": "assistant", "content": pair[1]}]
    return turns


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
    out = []
    for turn, m in enumerate(conv):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            return f"message {turn} lacks a role"
        m = _without_nulls(m)
        if not isinstance(m.setdefault("content", ""), str):  # a tool call's turn may have none
            return f"message {turn}: its content is not a string"
        if isinstance(m.get("tool_calls"), list):
            m["tool_calls"] = [_call(c) for c in m["tool_calls"]]
        out.append(m)
    return out


def _without_nulls(value):
    """`value` without the null entries of its mappings, at every depth: datasets reads a column of
    mappings as one Arrow struct, filling the keys that other rows have with null (a tool's
    parameters, a call's arguments), which a template would render as `null`."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def _call(call):
    """A tool call with its arguments as an object: OpenAI's layout keeps them as a JSON string,
    which templates that write `arguments | tojson` (Qwen2.5's) would quote once more."""
    if not isinstance(call, dict):
        return call
    inner = call.get("function", call)
    if isinstance(inner, dict) and isinstance(inner.get("arguments"), str):
        try:
            arguments = json.loads(inner["arguments"])
        except json.JSONDecodeError:
            return call
        if isinstance(arguments, dict):
            inner = {**inner, "arguments": arguments}
            return {**call, "function": inner} if "function" in call else inner
    return call


def _tools(value) -> list[dict] | str | None:
    """A conversation's tools (a list of JSON schemas, or that list as a JSON string), or why they
    are unusable."""
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else None
        except json.JSONDecodeError as e:
            return f"its tools are not JSON ({e})"
    if value is not None and not isinstance(value, list):
        return "its tools are not a list"
    return _without_nulls(value) or None


def _sharegpt(conv, system=None) -> list[dict] | str:
    """ShareGPT's turns (and its optional `system` column) as messages, or why they are unusable."""
    if not isinstance(conv, list) or not conv:
        return "the conversations are not a non-empty list"
    out = [{"role": "system", "content": system}] if isinstance(system, str) and system else []
    for m in conv:
        role = SHAREGPT_ROLES.get(m.get("from")) if isinstance(m, dict) else None
        if role is None or not isinstance(m.get("value"), str):
            return f"a turn's 'from' must be one of {sorted(SHAREGPT_ROLES)} with a string 'value'; got {m!r}"
        if m["from"] != "function_call":
            out.append({"role": role, "content": m["value"]})
            continue
        try:
            call = json.loads(m["value"])
        except json.JSONDecodeError:
            call = None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return f"a function_call's value must be a JSON object with a name and arguments; got {m['value']!r}"
        out.append({"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": call}]})
    return out


def encode_chats(convs: list[list[dict] | str], tok, tools: list | None = None,
                 rows: list[int] | None = None, learn: str = "assistant") -> dict[str, list]:
    """Conversations (with their tools) as ids and exact assistant targets, one example each or,
    where the template renders a turn differently once later turns follow, one more example per
    such turn (see the module's docstring); `rows` numbers the conversations; `learn` is
    data.targets: every assistant turn, the last one only, or every token of the render."""
    rows = list(range(len(convs))) if rows is None else rows
    tools = tools or [None] * len(convs)
    made: list[list[tuple]] = [[] for _ in convs]  # each conversation's examples, in order

    def add(k: int, ids=(), targets=(), problem: str = "") -> None:
        # numpy rows: datasets writes them to Arrow without a Python object per token
        made[k].append((np.asarray(ids, dtype=np.int32), np.asarray(targets, dtype=bool), problem, rows[k]))

    def result() -> dict[str, list]:
        columns = list(zip(*(example for examples in made for example in examples)))
        return dict(zip(("input_ids", "targets", "problem", "row"), map(list, columns)))

    good = []
    for k, conv in enumerate(convs):
        why = conv if isinstance(conv, str) else tools[k] if isinstance(tools[k], str) else ""
        if why:
            add(k, problem=why)
        else:
            good.append(k)
    if not good:
        return result()
    if tok.chat_template is None:
        raise ValueError("data.tokenizer: this format needs a tokenizer with a chat template, or one from "
                         "data.chat_template (or data.template: plain for instruction data)")
    rendered: dict[int, str] = {}
    for k in good:  # one by one: a template that raises on one example names that example
        try:
            rendered[k] = _render(tok, convs[k], tools[k])
        except _Unmaskable as e:
            add(k, problem=str(e))
    good = [k for k in good if k in rendered]
    if _GENERATION.search(tok.chat_template):
        for k in good:
            try:  # the template's marks cover what it renders: what it leaves out is refused, not lost
                _check_tools(tools[k], rendered[k])
                for turn, m in enumerate(convs[k]):
                    if m["role"] == "assistant":
                        _check_rendered(m, turn, rendered[k])
            except _Unmaskable as e:
                add(k, problem=str(e))
                continue
            enc = tok.apply_chat_template(convs[k], tools=tools[k], tokenize=True, return_dict=True,
                                          return_assistant_tokens_mask=True)
            mask = np.asarray(enc["assistant_masks"], dtype=bool)
            if learn == "all":
                mask[:] = True
            elif learn == "last_turn" and mask.any():  # the last turn is the last run of marked tokens
                begins = np.flatnonzero(mask & ~np.concatenate([[False], mask[:-1]]))
                mask[: begins[-1]] = False
            add(k, enc["input_ids"], mask)
        return result()
    enc = tok([rendered[k] for k in good], add_special_tokens=False, return_offsets_mapping=True)
    special = _special_strings(tok)
    special_ids = set(tok.convert_tokens_to_ids(sorted(special)))
    for j, k in enumerate(good):
        ids, offsets = enc["input_ids"][j], enc["offset_mapping"][j]
        try:
            mask, alone = _mask(convs[k], tools[k], rendered[k], ids, offsets, special, special_ids, tok,
                                learn == "last_turn")
            if learn == "all":  # the render as it is: a turn standing alone would learn its prompt twice
                mask, alone = [1] * len(ids), []
            examples = [_turn_alone(prompt, reply, turn, tok) for turn, prompt, reply in alone]
        except _Unmaskable as e:
            add(k, problem=str(e))
            continue
        if any(mask) or not alone:  # a chat all of whose turns stand alone needs no whole render
            add(k, ids, mask)
        for ids_alone, mask_alone in examples:
            add(k, ids_alone, mask_alone)
    return result()


class _Unmaskable(Exception):
    pass


REASONING = ("reasoning_content", "reasoning", "thinking")  # the fields templates render a turn's thinking from


def _render(tok, messages: list[dict], tools: list | None, prompt: bool = False) -> str:
    try:
        return tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=prompt)
    except Exception as e:  # jinja's TemplateError and whatever the template raises
        raise _Unmaskable(f"the chat template refused it: {e}") from None


def _special_strings(tok) -> set[str]:
    out = {t.content for t in tok.added_tokens_decoder.values() if t.special}
    return out | set(tok.all_special_tokens)


def _squash(text: str) -> str:
    return "".join(text.split())


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


def _structured(m: dict) -> bool:
    """Whether the template renders this assistant turn from more than its content."""
    return bool(m.get("tool_calls")) or any(isinstance(m.get(f), str) and m[f].strip() for f in REASONING)


def _reply(messages: list[dict], turn: int, tools: list | None, tok, special: set[str]) -> tuple[str, str, str]:
    """Assistant turn `turn` as the model generates it: the render of the conversation up to it
    with the generation prompt; the text the template puts into any reply there, whatever the
    message holds (Qwen3's empty think block: template text, never a target, as for a turn of content
    alone; '' for most templates); and the rest of what the render with the turn adds, through its
    end-of-turn token (the last special token it adds)."""
    prompt = _render(tok, messages[:turn], tools, prompt=True)
    added, lead = _added(messages, turn, prompt, tools, tok), ""
    end = _end(added, special)
    if not added[:end].strip():
        raise _Unmaskable(f"message {turn}: no end-of-turn token follows the assistant's reply")
    reply = added[:end]
    try:
        empty = _added([*messages[:turn], {"role": "assistant", "content": ""}], turn, prompt, tools, tok)
    except _Unmaskable:  # a template that refuses an empty reply: no text known to precede every reply
        empty = ""
    body = empty[:_start_of_end(empty, special)]
    if body.strip() and reply.startswith(body):
        lead, reply = body, reply[len(body):]
    _check_rendered(messages[turn], turn, reply)
    return prompt, lead, reply


def _check_rendered(m: dict, turn: int, text: str) -> None:
    """Assistant message `m`'s thinking and tool calls are in `text`, its render."""
    for name in REASONING:
        if isinstance(m.get(name), str) and _squash(m[name]) not in _squash(text):
            raise _Unmaskable(f"message {turn}: the chat template does not render its {name}")
    for call in m.get("tool_calls") or []:
        name = (call.get("function", call) if isinstance(call, dict) else {}).get("name")
        if not isinstance(name, str) or name not in text:
            raise _Unmaskable(f"message {turn}: the chat template does not render its tool call {call!r}")


def _check_tools(tools: list | None, text: str) -> None:
    """Every tool's name is in `text`, the conversation's render."""
    for tool in tools or []:
        name = (tool.get("function", tool) if isinstance(tool, dict) else {}).get("name")
        if not isinstance(name, str) or name not in text:
            raise _Unmaskable(f"the chat template does not render its tool {name or tool!r} (data.tools_field)")


def _added(messages: list[dict], turn: int, prompt: str, tools: list | None, tok) -> str:
    """What the render of messages[:turn + 1] adds to `prompt` (the render before the turn, with
    the generation prompt)."""
    full = _render(tok, messages[: turn + 1], tools)
    if not full.startswith(prompt):
        raise _Unmaskable(f"message {turn}: the chat template renders the conversation before it differently "
                          f"once it is answered, so the prompt it answers is not defined")
    return full[len(prompt):]


def _end(text: str, special: set[str]) -> int:
    """Where the last special token in `text` ends (0 without one)."""
    return max((text.rfind(s) + len(s) for s in special if s in text), default=0)


def _start_of_end(text: str, special: set[str]) -> int:
    """Where the last special token in `text` begins (0 without one)."""
    return max((text.rfind(s) for s in special if s in text), default=0)


def _cover(text: str, offsets: list[tuple[int, int]], starts: list[int], ends: list[int], lo: int, hi: int,
           turn: int) -> tuple[int, int]:
    """The first and last token overlapping text[lo:hi]; a token that also covers template text
    other than whitespace makes the turn unmaskable."""
    first = bisect.bisect_right(ends, lo)
    last = bisect.bisect_left(starts, hi) - 1
    if first > last:
        raise _Unmaskable(f"message {turn}: no token covers the assistant's reply")
    for i in (first, last):
        s, e = offsets[i]
        if text[s:lo].strip() or text[hi:e].strip():
            raise _Unmaskable(f"message {turn}: token {i} spans the assistant's reply and template text")
    return first, last


def _check_decodes(ids: list[int], text: str, tok, turn: int) -> None:
    if _squash(tok.backend_tokenizer.decode(ids, skip_special_tokens=False)) != _squash(text):
        raise _Unmaskable(f"message {turn}: the tokens of the assistant's reply do not decode to it")


def _turn_alone(prompt: str, reply: str, turn: int, tok) -> tuple[list[int], list[int]]:
    """An example of its own for one assistant turn: the prompt it answers and its reply, the reply
    the only target."""
    text = prompt + reply
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    first, last = _cover(text, offsets, [s for s, _ in offsets], [e for _, e in offsets], len(prompt), len(text), turn)
    _check_decodes(ids[first: last + 1], reply, tok, turn)
    return ids, [0] * first + [1] * (last + 1 - first) + [0] * (len(ids) - last - 1)


def _mask(messages: list[dict], tools: list | None, text: str, ids: list[int], offsets: list[tuple[int, int]],
          special: set[str], special_ids: set[int], tok, last_only: bool = False
          ) -> tuple[list[int], list[tuple[int, str, str]]]:
    """The targets in the conversation's render `text`, and the assistant turns it does not
    render as they are generated (turn, prompt, reply), which become examples of their own;
    `last_only`: the last assistant turn's targets only, the earlier turns context."""
    _check_tools(tools, text)
    mask = [0] * len(ids)
    starts = [s for s, _ in offsets]
    ends = [e for _, e in offsets]
    alone = []
    cursor = 0
    learned = [t for t, m in enumerate(messages) if m["role"] == "assistant" and (m["content"].strip() or _structured(m))]
    for turn, m in enumerate(messages):
        assistant = m["role"] == "assistant"
        if not assistant and m["role"] != "user":
            # system and tool messages carry no target; templates move or drop them (Mistral
            # v0.3 renders the system message only in the last user turn)
            continue
        if assistant and turn not in (learned[-1:] if last_only else learned):
            continue  # an empty reply teaches nothing; with last_only, an earlier reply is context
        if not assistant and not m["content"].strip():
            continue
        span = None if assistant and _structured(m) else _find(text, m["content"], cursor, special)
        if not assistant:
            if span is None:
                raise _Unmaskable(f"message {turn} ({m['role']}) is not rendered verbatim by the chat template")
            cursor = span[1]
            continue
        if span is None:
            # not its content alone: the turn as generated (its thinking, its tool calls), in the
            # whole render if it is there, else an example of its own (Qwen3 drops an earlier
            # turn's thinking once a later user message follows)
            prompt, lead, reply = _reply(messages, turn, tools, tok, special)
            # the whole render holds the turn after its prompt, with the template's lead (the
            # last turn) or without (an earlier one: Qwen3 adds its empty think block to the last only)
            at = next((len(c) for c in (prompt + lead, prompt) if text.startswith(c + reply)), None)
            if at is None:
                alone.append((turn, prompt + lead, reply))
                continue
            first, last = _cover(text, offsets, starts, ends, at, at + len(reply), turn)
            _check_decodes(ids[first: last + 1], reply, tok, turn)
            mask[first: last + 1] = [1] * (last + 1 - first)
            cursor = at + len(reply)
            continue
        lo, hi = span
        first, last = _cover(text, offsets, starts, ends, lo, hi, turn)
        mask[first: last + 1] = [1] * (last + 1 - first)
        _check_decodes(ids[first: last + 1], text[lo:hi], tok, turn)
        # the end of turn: whitespace tokens, then the special token the model must learn to emit
        i = last + 1
        while i < len(ids) and ids[i] not in special_ids and not text[offsets[i][0]:offsets[i][1]].strip():
            mask[i] = 1
            i += 1
        if i == len(ids) or ids[i] not in special_ids:
            raise _Unmaskable(f"message {turn}: no end-of-turn token follows the assistant's content")
        mask[i] = 1
        cursor = max(hi, offsets[i][1])
    return mask, alone

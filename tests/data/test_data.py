"""The data: exact chat masks for the published templates of every supported family (checked
token by token against hand-written renders), the instruction, Alpaca and ShareGPT layouts, what is
truncated, dropped or refused, the compact pipeline and its cache, batches and packing."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from megatrain.batch import Batch
from megatrain.config import DataConfig
from megatrain.data import SyntheticSource, make_sources
from megatrain.data.formats import encode, encode_chats
from megatrain.data.source import pack
from tiny_tokenizer import byte_tokenizer, save_tokenizer

pytest.importorskip("datasets")  # the GPU image lacks it; CI and CPU setups have it

CHAT = [{"role": "user", "content": "What is the capital of France?"}, {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Italy?"}, {"role": "assistant", "content": "Rome."}]
SYSTEM = [{"role": "system", "content": "You are terse."}]
Q = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
Q2 = "<|im_start|>user\nAnd of Italy?<|im_end|>\n<|im_start|>assistant\n"
L = ("<|start_header_id|>user<|end_header_id|>\n\nWhat is the capital of France?<|eot_id|>"
     "<|start_header_id|>assistant<|end_header_id|>\n\n[[Paris.<|eot_id|>]]"
     "<|start_header_id|>user<|end_header_id|>\n\nAnd of Italy?<|eot_id|>"
     "<|start_header_id|>assistant<|end_header_id|>\n\n[[Rome.<|eot_id|>]]")
L31 = "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"

# The render of each published template with the targets in [[ ]]: hand-checked against the
# templates' text (tests/fixtures/chat_templates). Qwen3 renders the empty think block in the last
# turn only, and it is no target; Mistral v0.3 drops the system message unless the last message is
# the user's, and its assistant turns begin with a space, which the first target token carries.
EXPECTED = {
    ("qwen2.5", False): "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
                        f"<|im_end|>\n{Q}[[Paris.<|im_end|>]]\n{Q2}[[Rome.<|im_end|>]]\n",
    ("qwen2.5", True): f"<|im_start|>system\nYou are terse.<|im_end|>\n{Q}[[Paris.<|im_end|>]]\n{Q2}[[Rome.<|im_end|>]]\n",
    ("qwen2", False): "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
                      f"{Q}[[Paris.<|im_end|>]]\n{Q2}[[Rome.<|im_end|>]]\n",
    ("qwen3", False): f"{Q}[[Paris.<|im_end|>]]\n{Q2}<think>\n\n</think>\n\n[[Rome.<|im_end|>]]\n",
    ("qwen3", True): f"<|im_start|>system\nYou are terse.<|im_end|>\n{Q}[[Paris.<|im_end|>]]\n"
                     f"{Q2}<think>\n\n</think>\n\n[[Rome.<|im_end|>]]\n",
    ("llama3", False): "<|begin_of_text|>" + L,
    ("llama3", True): "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>" + L,
    ("llama3.1", False): L31 + "<|eot_id|>" + L,
    ("llama3.1", True): L31 + "You are terse.<|eot_id|>" + L,
    ("mistral-v0.3", False): "<s>[INST] What is the capital of France?[/INST][[ Paris.</s>]][INST] And of Italy?[/INST][[ Rome.</s>]]",
    ("mistral-v0.3", True): "<s>[INST] What is the capital of France?[/INST][[ Paris.</s>]][INST] And of Italy?[/INST][[ Rome.</s>]]",
    ("chatml-generation", True): f"<|im_start|>system\nYou are terse.<|im_end|>\n{Q}[[Paris.<|im_end|>]]\n{Q2}[[Rome.<|im_end|>]]\n",
}


def row(out: dict, k: int) -> tuple[list[int], list[int]]:
    return [int(i) for i in out["input_ids"][k]], [int(t) for t in out["targets"][k]]


def expected_tokens(tok, marked: str) -> tuple[list[int], list[int]]:
    """Token ids of the render and, token by token, whether it lies inside [[ ]]."""
    text, spans = "", []
    for piece in re.split(r"(\[\[.*?\]\])", marked, flags=re.S):
        if piece.startswith("[["):
            spans.append((len(text), len(text) + len(piece) - 4))
            piece = piece[2:-2]
        text += piece
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    inside = [int(any(lo <= s and e <= hi for lo, hi in spans)) for s, e in enc["offset_mapping"]]
    return enc["input_ids"], inside


@pytest.mark.parametrize("family,system", sorted(EXPECTED), ids=lambda v: str(v))
def test_chat_masks_of_published_templates(family, system):
    tok = byte_tokenizer(family)
    out = encode_chats([(SYSTEM if system else []) + CHAT], tok)
    assert out["problem"] == [""]
    ids, targets = expected_tokens(tok, EXPECTED[family, system])
    assert row(out, 0)[0] == ids
    assert row(out, 0)[1] == targets, [(tok.decode([i]), t) for i, t in zip(ids, out["targets"][0])]


def test_a_first_target_token_carrying_the_turns_space():
    """Mistral's ' Paris.': the merged token 'ĠP' starts with the template's space, as the model
    generates it after [/INST]; it is the first target."""
    tok = byte_tokenizer("mistral-v0.3")
    out = encode_chats([CHAT], tok)
    first = list(out["targets"][0]).index(1)
    assert tok.convert_ids_to_tokens(int(out["input_ids"][0][first])) == "ĠP"


def test_role_header_characters_are_never_taken_for_a_reply():
    """A reply 'a' also appears in 'assistant' of its header: only the one before the end of turn is a target."""
    tok = byte_tokenizer("qwen2.5")
    conv = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "a"}]
    out = encode_chats([conv], tok)
    ids, targets = expected_tokens(tok, "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a "
                                        "helpful assistant.<|im_end|>\n<|im_start|>user\na<|im_end|>\n"
                                        "<|im_start|>assistant\n[[a<|im_end|>]]\n")
    assert row(out, 0) == (ids, targets)


def test_a_template_that_changes_the_reply_is_refused_with_the_index():
    tok = byte_tokenizer("qwen2.5")
    tok.chat_template = tok.chat_template.replace("message.content + '<|im_end|>'", "message.content | upper + '<|im_end|>'")
    out = encode_chats([[{"role": "user", "content": "HI"}, {"role": "assistant", "content": "HELLO"}], CHAT], tok)
    assert out["problem"][0] == ""
    assert "message 1 (assistant) is not rendered verbatim" in out["problem"][1] or \
           "message 0 (user) is not rendered verbatim" in out["problem"][1]


def write(tmp_path, rows, name="d.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


def save(tmp_path, tok):
    tok.save_pretrained(tmp_path / "tok")
    return str(tmp_path / "tok")


def test_unmaskable_examples_stop_the_run_or_are_dropped_and_counted(tmp_path):
    tok = byte_tokenizer("qwen2.5")
    tok.chat_template = tok.chat_template.replace("message.content + '<|im_end|>'", "message.content | upper + '<|im_end|>'")
    path = write(tmp_path, [{"messages": [{"role": "user", "content": "HI"}, {"role": "assistant", "content": "HELLO"}]},
                            {"messages": CHAT}])
    cfg = dict(source="file", path=path, format="chat", seq_len=256)
    with pytest.raises(ValueError, match=r"1 example\(s\) .* cannot be labelled exactly \(example 1: message 0 .*unmaskable: drop"):
        make_sources(DataConfig(**cfg), 300, save(tmp_path, tok))
    src, _ = make_sources(DataConfig(**cfg, unmaskable="drop"), 300, save(tmp_path, tok))
    assert len(src.examples) == 1 and src.examples.dropped["unmaskable"] == 1


def test_instruction_through_the_chat_template(tmp_path):
    tok = byte_tokenizer("qwen2.5")
    out = encode({"prompt": ["What is the capital of France?"], "response": ["Paris."]},
                 DataConfig(format="instruction"), tok)
    ids, targets = expected_tokens(tok, "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a "
                                        f"helpful assistant.<|im_end|>\n{Q}[[Paris.<|im_end|>]]\n")
    assert row(out, 0) == (ids, targets)


def test_plain_template_has_bos_separator_and_eos():
    tok = byte_tokenizer()  # no chat template: BOS prompt \n response EOS
    out = encode({"prompt": ["Add 2 and 3."], "response": ["5"]}, DataConfig(format="instruction"), tok)
    ids, targets = expected_tokens(tok, "<s>Add 2 and 3.\n[[5</s>]]")
    assert row(out, 0) == (ids, targets)
    forced = encode({"prompt": ["Q"], "response": ["A"]}, DataConfig(format="instruction", template="plain",
                                                                   separator=" => "), byte_tokenizer("qwen2.5"))
    assert byte_tokenizer("qwen2.5").decode(forced["input_ids"][0]) == "Q => A<|im_end|>"


def test_alpaca_keeps_its_input():
    tok = byte_tokenizer()
    rows = {"instruction": ["Sum the numbers.", "Say hi."], "input": ["2, 3", ""], "output": ["5", "hi"]}
    out = encode(rows, DataConfig(format="alpaca"), tok)
    assert row(out, 0) == expected_tokens(tok, "<s>Sum the numbers.\n\n2, 3\n[[5</s>]]")
    assert row(out, 1) == expected_tokens(tok, "<s>Say hi.\n[[hi</s>]]")
    chat = encode(rows, DataConfig(format="alpaca"), byte_tokenizer("llama3"))
    assert byte_tokenizer("llama3").decode(chat["input_ids"][0]).startswith(
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nSum the numbers.\n\n2, 3<|eot_id|>")


def test_sharegpt_layout(tmp_path):
    tok = byte_tokenizer("qwen3")
    turns = [{"from": "human", "value": m["content"]} if m["role"] == "user" else {"from": "gpt", "value": m["content"]}
             for m in CHAT]
    out = encode({"conversations": [turns, [{"from": "robot", "value": "x"}]]}, DataConfig(format="sharegpt"), tok)
    assert row(out, 0) == expected_tokens(tok, EXPECTED["qwen3", False])
    assert "'from' must be one of" in out["problem"][1]
    path = write(tmp_path, [{"conversations": [{"from": "system", "value": "You are terse."}, *turns]}])
    src, _ = make_sources(DataConfig(source="file", path=path, format="sharegpt", seq_len=256, pad_to_multiple_of=None),
                          300, save(tmp_path, tok))
    b = src.next()
    assert (b.input_ids[0].tolist(), b.labels[0].ne(-100).long().tolist()) == expected_tokens(tok, EXPECTED["qwen3", True])


def test_truncation_drops_and_counts(tmp_path):
    tok = byte_tokenizer()
    rows = [{"prompt": "x" * 30, "response": "yy"},  # 1 + 31 prompt tokens + 3: over 16
            {"prompt": "ab", "response": "cd"},  # 7 tokens
            {"prompt": "a" * 15, "response": "b"}]  # 1 + 16 + 2: truncated to 16 leaves no target
    path = write(tmp_path, rows)
    cfg = dict(source="file", path=path, format="instruction", seq_len=16)
    src, _ = make_sources(DataConfig(**cfg), 300, save(tmp_path, tok))
    assert sorted(src.examples.lengths.tolist()) == [7] and src.examples.dropped == {"unmaskable": 0, "no_target": 0, "cut_off": 2}
    rows[0] = {"prompt": "x", "response": "y" * 30}  # truncated, keeps targets
    src, _ = make_sources(DataConfig(**{**cfg, "path": write(tmp_path, rows)}), 300, save(tmp_path, tok))
    assert sorted(src.examples.lengths.tolist()) == [7, 16] and src.examples.dropped["cut_off"] == 1
    src, _ = make_sources(DataConfig(**{**cfg, "path": write(tmp_path, rows)}, overlong="drop"), 300, save(tmp_path, tok))
    assert src.examples.lengths.tolist() == [7] and src.examples.dropped == {"unmaskable": 0, "overlong": 2, "no_target": 0, "cut_off": 0}


def test_nothing_left_to_learn_says_why(tmp_path):
    """A file none of whose examples has a target within seq_len is refused with the reason each was
    left out: nothing to learn at all (a chat without an assistant message) is not a short seq_len."""
    tok_dir = save(tmp_path, byte_tokenizer("qwen2.5"))
    path = write(tmp_path, [{"messages": CHAT[:1]}, {"messages": [{**CHAT[0], "role": "robot"}, CHAT[0]]}])
    with pytest.raises(ValueError, match=r"left to learn from: 2 have nothing to learn \(a chat without an assistant"):
        make_sources(DataConfig(source="file", path=path, format="chat", seq_len=256), 300, tok_dir)
    path = write(tmp_path, [{"messages": CHAT[:2]}, {"messages": CHAT[:1]}])
    with pytest.raises(ValueError, match=r"1 have nothing to learn .*; 1 have their targets only past data.seq_len 16"):
        make_sources(DataConfig(source="file", path=path, format="chat", seq_len=16), 300, tok_dir)


def test_pipeline_is_compact_cached_and_accepts_folders(tmp_path, monkeypatch):
    tok_dir = save(tmp_path, byte_tokenizer("qwen2.5"))
    rows = [{"messages": CHAT[:2]}, {"messages": CHAT}] * 5
    (tmp_path / "shards").mkdir()
    write(tmp_path / "shards", rows[:4], "a.jsonl")
    write(tmp_path / "shards", rows[4:], "b.jsonl")
    cfg = DataConfig(source="file", path=str(tmp_path / "shards"), format="chat", seq_len=256, batch_size=3)
    src, _ = make_sources(cfg, 300, tok_dir)
    assert len(src.examples) == 10 and src.examples.tokens.dtype == np.uint16 and src.examples.targets.dtype == bool
    assert src.examples.nbytes == src.examples.tokens.size * 3 + 10 * 12
    # a second run reads datasets' cache: the encoder is not called again
    from megatrain.data import formats
    monkeypatch.setattr(formats, "encode", lambda *a, **k: pytest.fail("tokenised again"))
    again, _ = make_sources(cfg, 300, tok_dir)
    assert np.array_equal(again.examples.tokens, src.examples.tokens)
    monkeypatch.undo()
    import datasets
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    disk, _ = make_sources(DataConfig(source="file", path=str(tmp_path / "saved"), format="chat", seq_len=256), 300, tok_dir)
    assert np.array_equal(disk.examples.tokens, src.examples.tokens)


def test_batches_padded_to_their_longest_one_permutation_per_epoch(tmp_path):
    tok_dir = save(tmp_path, byte_tokenizer())
    rows = [{"prompt": "p" * k, "response": "r"} for k in range(1, 8)]  # 7 examples of 5..11 tokens
    cfg = DataConfig(source="file", path=write(tmp_path, rows), format="instruction", seq_len=64, batch_size=3, seed=5,
                     pad_to_multiple_of=None)
    src, _ = make_sources(cfg, 300, tok_dir)
    seen = []
    for _ in range(7):  # 21 rows: three epochs of 7
        b = src.next()
        lengths = b.attention_mask.sum(1)
        assert b.input_ids.shape[1] == int(lengths.max())  # padded to the longest of the batch
        seen += [int(n) for n in lengths]
    for epoch in range(3):
        assert sorted(seen[7 * epoch: 7 * epoch + 7]) == list(range(5, 12))
    assert seen[:7] != seen[7:14]  # reshuffled
    again, _ = make_sources(cfg, 300, tok_dir)
    again.position = src.position = 4  # a resumed run draws the same batches
    assert torch.equal(again.next().input_ids, src.next().input_ids)


def test_batch_widths_rounded_up_to_the_multiple_at_most_seq_len(tmp_path):
    """Each batch is padded to its longest row rounded up to data.pad_to_multiple_of, never past
    data.seq_len: a run meets a handful of widths, not one per batch."""
    tok_dir = save(tmp_path, byte_tokenizer())
    rows = [{"prompt": "p" * k, "response": "r"} for k in range(1, 8)]  # 7 examples of 5..11 tokens
    cfg = dict(source="file", path=write(tmp_path, rows), format="instruction", batch_size=3)
    for seq_len, multiple in ((64, 4), (10, 8)):  # 10: an 11-token example is cut to 10, no batch wider
        src, ev = make_sources(DataConfig(**cfg, seq_len=seq_len, pad_to_multiple_of=multiple, eval_fraction=0.3),
                               300, tok_dir)
        for b in [src.next() for _ in range(4)] + list(ev.batches()):
            longest = int(b.attention_mask.sum(1).max())
            assert b.input_ids.shape[1] == min(-(-longest // multiple) * multiple, seq_len)
            assert (b.labels[:, longest:] == -100).all() and (b.attention_mask[:, longest:] == 0).all()
    # rows all of one length need no mask: left unpadded (one row a batch here)
    one, _ = make_sources(DataConfig(**{**cfg, "batch_size": 1}, seq_len=64, pad_to_multiple_of=8), 300, tok_dir)
    for b in [one.next() for _ in range(7)]:
        assert bool(b.attention_mask.all())  # the engine then passes no mask
    with pytest.raises(ValueError, match="data.pad_to_multiple_of must be at least 1"):
        DataConfig(pad_to_multiple_of=0)


def test_packing_keeps_examples_apart(tmp_path):
    tok_dir = save(tmp_path, byte_tokenizer())
    rows = [{"prompt": "p" * k, "response": "r"} for k in range(1, 8)]
    cfg = DataConfig(source="file", path=write(tmp_path, rows), format="instruction", seq_len=16, batch_size=2,
                     packing=True)
    src, _ = make_sources(cfg, 300, tok_dir)
    assert src.rows_per_epoch() < 7
    b = src.next()
    assert b.attention_mask is None and b.position_ids.shape == b.input_ids.shape
    for row_pos, row_labels in zip(b.position_ids, b.labels):
        starts = (row_pos == 0).nonzero().reshape(-1)
        assert (row_labels[starts] == -100).all()  # an example's first token is never a target
    rows = [src._row(k) for k in range(2)]
    assert sorted(b.sequence_lengths()) == sorted(src.examples.lengths[np.concatenate(rows)].tolist())
    assert pack(np.array([5, 5, 7, 3, 16]), 16).tolist() == [0, 2, 4, 5]
    # the padding after a row's last example, what a mixture of experts' router loss leaves out
    lengths = src.examples.lengths
    for row, ids, mask in zip(rows, b.input_ids, b.token_mask()):
        assert mask.tolist() == [1] * int(lengths[row].sum()) + [0] * (len(ids) - int(lengths[row].sum()))


def test_token_mask_is_the_attention_mask_or_none():
    """Unpacked rows: their attention mask; packed rows without padding: None (every token counts)."""
    ids = torch.ones(2, 4, dtype=torch.int64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    assert Batch(ids, ids, mask).token_mask() is mask and Batch(ids, ids).token_mask() is None
    assert Batch(ids, ids, None, torch.tensor([[0, 1, 0, 1], [0, 1, 2, 3]])).token_mask() is None
    packed = Batch(ids, ids, None, torch.tensor([[0, 1, 0, 0], [0, 1, 2, 3]]))
    assert packed.token_mask().tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]


def test_text_is_joined_and_cut(tmp_path):
    save_tokenizer(tmp_path / "tok")
    path = write(tmp_path, [{"text": "hello world"}, {"text": "a b c"}])
    src, _ = make_sources(DataConfig(source="file", path=path, seq_len=4), 64, str(tmp_path / "tok"))
    assert len(src.examples) == 1  # 7 tokens with the eos tokens: one full sequence of 4
    assert src.next().input_ids[0].tolist() == [13, 14, 1, 15]


def test_token_outside_vocab_is_refused(tmp_path):
    save_tokenizer(tmp_path / "tok")
    path = write(tmp_path, [{"text": "c c c c c"}])
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        make_sources(DataConfig(source="file", path=path, seq_len=4), 10, str(tmp_path / "tok"))


def test_held_out_split(tmp_path):
    tok_dir = save(tmp_path, byte_tokenizer())
    rows = [{"prompt": "p" * k, "response": "r"} for k in range(1, 11)]
    path = write(tmp_path, rows)
    src, held = make_sources(DataConfig(source="file", path=path, format="instruction", seq_len=64, batch_size=2,
                                        eval_fraction=0.3), 300, tok_dir)
    assert len(src.examples) == 7 and len(held.examples) == 3
    assert not set(src.examples.starts.tolist()) & set(held.examples.starts.tolist())
    assert sum(b.input_ids.shape[0] for b in held.batches()) == 3
    _, other = make_sources(DataConfig(source="file", path=path, format="instruction", seq_len=64,
                                       eval_path=write(tmp_path, rows[:4], "e.jsonl")), 300, tok_dir)
    assert len(other.examples) == 4


def test_synthetic_source_is_deterministic_and_repeatable():
    cfg = DataConfig(seq_len=8, batch_size=2, seed=3)
    a, b = SyntheticSource(cfg, 100), SyntheticSource(cfg, 100)
    first = a.next()
    assert torch.equal(first.input_ids, b.next().input_ids)
    assert not torch.equal(first.input_ids, a.next().input_ids)
    same = SyntheticSource(DataConfig(seq_len=8, batch_size=2, repeat_batch=True), 100)
    assert torch.equal(same.next().input_ids, same.next().input_ids)

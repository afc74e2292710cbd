"""Alpaca's optional `system` and `history` columns rendered as the turns before the instruction
(checked token by token against Qwen2.5's published template), refused where the plain template has
no place for them; the chat-template override (data.chat_template) from a .jinja file or another
tokenizer, used for the data and saved with the model; data.targets: every assistant turn, the last
one, or every token."""
from __future__ import annotations

import os

import pytest

from helpers import tiny_checkpoint
from megatrain.config import DataConfig, load_config
from megatrain.data import make_sources
from megatrain.data.formats import encode
from test_data import CHAT, EXPECTED, SYSTEM, expected_tokens, row, write
from tiny_tokenizer import FIXTURES, byte_tokenizer

pytest.importorskip("datasets")

ALPACA = {"instruction": ["Sum the numbers.", "Say hi."], "input": ["2, 3", ""], "output": ["5", "hi"],
          "system": ["You are terse.", ""], "history": [[["Hi", "Hello."]], []]}


def test_alpaca_system_and_history_are_the_turns_before_the_instruction():
    tok = byte_tokenizer("qwen2.5")
    out = encode(ALPACA, DataConfig(format="alpaca"), tok)
    assert out["problem"] == ["", ""]
    assert row(out, 0) == expected_tokens(tok, "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                                               "<|im_start|>assistant\n[[Hello.<|im_end|>]]\n<|im_start|>user\nSum the "
                                               "numbers.\n\n2, 3<|im_end|>\n<|im_start|>assistant\n[[5<|im_end|>]]\n")
    assert row(out, 1) == expected_tokens(tok, "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a "
                                               "helpful assistant.<|im_end|>\n<|im_start|>user\nSay hi.<|im_end|>\n"
                                               "<|im_start|>assistant\n[[hi<|im_end|>]]\n")
    plain = encode(ALPACA, DataConfig(format="alpaca"), byte_tokenizer())  # no chat template: the plain one
    assert plain["problem"][0].startswith("its system and history need a chat template")
    assert plain["problem"][1] == "" and row(plain, 1) == expected_tokens(byte_tokenizer(), "<s>Say hi.\n[[hi</s>]]")
    bad = encode({**ALPACA, "history": [[["Hi"]], None]}, DataConfig(format="alpaca"), tok)
    assert bad["problem"][0].startswith("its history must be a list of [prompt, response] pairs")


def test_the_pipeline_reads_alpaca_context_columns(tmp_path):
    tok = byte_tokenizer("qwen2.5")
    tok.save_pretrained(tmp_path / "tok")
    rows = [dict(zip(ALPACA, values)) for values in zip(*ALPACA.values())]
    src, _ = make_sources(DataConfig(path=write(tmp_path, rows), format="alpaca", seq_len=512), 300, str(tmp_path / "tok"))
    first = src.examples.starts.tolist().index(0)
    assert sum(src.examples.targets[:src.examples.lengths[first]]) == len(tok("Hello.<|im_end|>5<|im_end|>")["input_ids"])


def test_a_chat_template_from_a_file_or_another_tokenizer(tmp_path):
    """A tokenizer without a template (a base model's) renders chats with data.chat_template."""
    base = byte_tokenizer("qwen2.5")
    base.chat_template = None
    base.save_pretrained(tmp_path / "base")
    path = write(tmp_path, [{"messages": CHAT}])
    with pytest.raises(ValueError, match="this format needs a tokenizer with a chat template"):
        make_sources(DataConfig(path=path, format="chat", seq_len=512), 300, str(tmp_path / "base"))
    byte_tokenizer("qwen2.5").save_pretrained(tmp_path / "instruct")
    expected = expected_tokens(base, EXPECTED["qwen2.5", False])
    for template in (str(FIXTURES / "qwen2.5.jinja"), str(tmp_path / "instruct")):
        src, _ = make_sources(DataConfig(path=path, format="chat", seq_len=512, chat_template=template), 300,
                              str(tmp_path / "base"))
        assert (src.examples.tokens.tolist(), src.examples.targets.astype(int).tolist()) == expected
    with pytest.raises(ValueError, match="data.chat_template 'nowhere.jinja' does not exist"):
        DataConfig(path=path, format="chat", chat_template="nowhere.jinja")
    with pytest.raises(ValueError, match="data.chat_template renders chats: .*not format text"):
        DataConfig(path=path, chat_template=str(FIXTURES / "qwen2.5.jinja"))


def test_the_saved_model_carries_the_template_it_was_trained_with(tmp_path):
    from megatrain.trainer import Trainer
    tiny_checkpoint(tmp_path / "init", "tiny-qwen2", {"vocab_size": 300})
    base = byte_tokenizer("qwen2.5")
    base.chat_template = None
    base.save_pretrained(tmp_path / "init")
    template = FIXTURES / "qwen2.5.jinja"
    cfg = load_config(base={"model": {"pretrained": str(tmp_path / "init")}, "engine": {"device": "cpu"},
                            "data": {"path": write(tmp_path, [{"messages": CHAT}]), "format": "chat", "seq_len": 256,
                                     "chat_template": str(template)},
                            "steps": 1, "output_dir": str(tmp_path / "out")})
    trainer = Trainer(cfg)
    try:
        trainer.fit(log=open(os.devnull, "w"), progress=False)
    finally:
        trainer.close()
    from transformers import AutoTokenizer
    assert AutoTokenizer.from_pretrained(tmp_path / "out" / "model").chat_template == template.read_text()


@pytest.mark.parametrize("family", ["qwen2.5", "chatml-generation"])
def test_targets_last_turn_or_all(family):
    """data.targets: last_turn learns the last reply only (the template's own marks too), all every token."""
    tok = byte_tokenizer(family)
    conv = (SYSTEM if family == "chatml-generation" else []) + CHAT
    marked = EXPECTED[family, family == "chatml-generation"]
    last = encode({"messages": [conv]}, DataConfig(format="chat", targets="last_turn"), tok)
    assert row(last, 0) == expected_tokens(tok, marked.replace("[[Paris.<|im_end|>]]", "Paris.<|im_end|>"))
    every = encode({"messages": [conv]}, DataConfig(format="chat", targets="all"), tok)
    plain = marked.replace("[[", "").replace("]]", "")
    assert row(every, 0) == expected_tokens(tok, f"[[{plain}]]")


def test_targets_last_turn_makes_no_example_of_an_earlier_turn():
    """Qwen3 drops the first turn's thinking: with last_turn that turn is context, not an example."""
    tok = byte_tokenizer("qwen3")
    conv = [CHAT[0], {"role": "assistant", "reasoning_content": "It is Paris.", "content": "Paris."}, *CHAT[2:]]
    assert len(encode({"messages": [conv]}, DataConfig(format="chat"), tok)["input_ids"]) == 2
    out = encode({"messages": [conv]}, DataConfig(format="chat", targets="last_turn"), tok)
    assert row(out, 0) == expected_tokens(tok, EXPECTED["qwen3", False].replace("[[Paris.<|im_end|>]]", "Paris.<|im_end|>"))
    plain = encode({"prompt": ["Add 2 and 3."], "response": ["5"]}, DataConfig(format="instruction", targets="all"),
                   byte_tokenizer())
    assert row(plain, 0) == expected_tokens(byte_tokenizer(), "[[<s>Add 2 and 3.\n5</s>]]")
    with pytest.raises(ValueError, match="data.targets applies to chat, sharegpt, instruction and alpaca data"):
        DataConfig(targets="all")


@pytest.mark.parametrize("name, families", [("demo-chat", ["qwen2.5", "llama3", "mistral-v0.3", "qwen3"]),
                                            ("demo-tools", ["qwen2.5", "qwen3", "llama3.1"]), ("demo-reasoning", ["qwen3"])])
def test_the_demo_data_is_labelled_whole(tmp_path, name, families):
    """Every row of the shipped demo files (data/) is labelled by the templates its README names;
    Qwen3 trains a two-turn reasoning chat's first turn alone."""
    path = FIXTURES.parents[2] / "data" / f"{name}.jsonl"
    rows = len(path.read_text().splitlines())
    two_turns = sum(line.count('"role": "user"') == 2 for line in path.read_text().splitlines())
    for family in families:
        byte_tokenizer(family).save_pretrained(tmp_path / family)
        src, _ = make_sources(DataConfig(path=str(path), format="chat", seq_len=2048), 300, str(tmp_path / family))
        assert not any(src.examples.dropped.values())
        assert len(src.examples) == rows + (two_turns if name == "demo-reasoning" else 0)

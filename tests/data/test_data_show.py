"""`megatrain data`: an example printed with its targets marked (the render the tests expect, to
the character), the data's summary with the examples cut to seq_len counted, its refusals."""
from __future__ import annotations

import pytest

from helpers import tiny_checkpoint
from megatrain.cli import main
from megatrain.config import DataConfig
from megatrain.data import make_sources
from megatrain.data.show import marked
from test_data import CHAT, EXPECTED, write
from tiny_tokenizer import byte_tokenizer

pytest.importorskip("datasets")


@pytest.mark.parametrize("family", ["qwen2.5", "llama3", "mistral-v0.3"])
def test_an_example_is_its_render_with_the_targets_marked(tmp_path, family):
    tok = byte_tokenizer(family)
    tok.save_pretrained(tmp_path / "tok")
    src, _ = make_sources(DataConfig(path=write(tmp_path, [{"messages": CHAT}]), format="chat", seq_len=512), 300,
                          str(tmp_path / "tok"))
    assert marked(src.examples, 0, tok) == EXPECTED[family, False]


def test_the_command_prints_the_summary_and_an_example(tmp_path, capsys):
    tiny_checkpoint(tmp_path / "init", "tiny-qwen2", {"vocab_size": 300})
    byte_tokenizer("qwen2.5").save_pretrained(tmp_path / "init")
    long = [CHAT[0], {"role": "assistant", "content": "Paris. " * 40}]
    path = write(tmp_path, [{"messages": CHAT}, {"messages": long}, {"messages": CHAT[:1]}])
    run = [f"model.pretrained={tmp_path / 'init'}", f"data.path={path}", "data.format=chat", "data.seq_len=200"]
    assert main(["data", *run]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"data: {path} (chat): 2 training examples; left out: {{'no_target': 1}}; cut to data.seq_len 200: 1"
    tokens = len(byte_tokenizer("qwen2.5")(EXPECTED["qwen2.5", False].replace("[[", "").replace("]]", ""))["input_ids"])
    targets = len(byte_tokenizer("qwen2.5")("Paris.<|im_end|>Rome.<|im_end|>")["input_ids"])
    assert out[1] == f"example 0: {tokens} tokens, {targets} of them targets, marked [[ ]]:"
    assert "\n".join(out[2:]) == EXPECTED["qwen2.5", False]
    assert main(["data", *run, "--example", "2"]) == 2
    assert "--example 2: the training data has examples 0 to 1" in capsys.readouterr().err
    assert main(["data", f"model.pretrained={tmp_path / 'init'}"]) == 2
    assert "megatrain data shows data from a file or the Hub: set data.path (or data.mix)" in capsys.readouterr().err

"""Tool calling and reasoning data, labelled per published chat template (Qwen2.5's, Qwen3's and
Llama 3.1's, tools included: tests/fixtures/chat_templates) and checked token by token against hand-written
renders: the tools rendered into the prompt, an assistant's tool call and its thinking (a
`reasoning_content` field or inline <think> in the content) learned as targets, a turn the template
renders differently once later turns follow trained alone in the context it was generated in, and
what a template cannot render refused with the example's row."""
from __future__ import annotations

import json

import pytest

from megatrain.config import DataConfig
from megatrain.data import make_sources
from megatrain.data.formats import encode
from test_data import expected_tokens, row, write
from tiny_tokenizer import byte_tokenizer

pytest.importorskip("datasets")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ASK = {"role": "user", "content": "What is the weather in Paris?"}
# OpenAI's layout: the arguments as a JSON string, no content
CALL = {"role": "assistant", "content": None,
        "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
RESULT = {"role": "tool", "content": '{"temp": 21}'}
ANSWER = {"role": "assistant", "content": "It is 21 degrees in Paris."}
TOOLS_PROMPT = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with "
                f"function signatures within <tools></tools> XML tags:\n<tools>\n{json.dumps(WEATHER)}\n</tools>\n\n"
                "For each function call, return a json object with function name and arguments within "
                "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
                "<args-json-object>}\n</tool_call><|im_end|>\n")
TOOL_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOL_TURNS = ("<|im_start|>user\nWhat is the weather in Paris?<|im_end|>\n<|im_start|>assistant\n"
              f"[[{TOOL_CALL}<|im_end|>]]\n<|im_start|>user\n<tool_response>\n{{\"temp\": 21}}\n</tool_response>"
              "<|im_end|>\n<|im_start|>assistant\n")
Q1 = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
Q2 = "<|im_start|>user\nAnd of Italy?<|im_end|>\n<|im_start|>assistant\n"


def chat(*messages) -> list[dict]:
    return [dict(m) for m in messages]


def encode_chats(convs: list[list[dict]], tok, tools: list | None = None) -> dict[str, list]:
    """Conversations as a chat dataset's rows give them, with a tools column where `tools` is given."""
    rows = {"messages": convs} | ({"tools": tools} if tools is not None else {})
    return encode(rows, DataConfig(format="chat"), tok)


def test_qwen2_5_renders_the_tools_and_learns_the_tool_call():
    tok = byte_tokenizer("qwen2.5")
    out = encode_chats([chat(ASK, CALL, RESULT, ANSWER)], tok, [[WEATHER]])
    assert out["problem"] == [""]
    expected = ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.\n\n"
                + TOOLS_PROMPT + TOOL_TURNS + "[[It is 21 degrees in Paris.<|im_end|>]]\n")
    assert row(out, 0) == expected_tokens(tok, expected)


def test_llama3_1_puts_the_tools_into_the_first_user_message_and_learns_the_call():
    tok = byte_tokenizer("llama3.1")
    out = encode_chats([chat(ASK, CALL, RESULT, ANSWER)], tok, [[WEATHER]])
    assert out["problem"] == [""]
    header = "<|start_header_id|>{}<|end_header_id|>\n\n"
    # the published template writes a tool's result with tojson: a string comes out quoted
    expected = ("<|begin_of_text|>" + header.format("system") + "Environment: ipython\nCutting Knowledge Date: "
                "December 2023\nToday Date: 26 Jul 2024\n\n<|eot_id|>" + header.format("user")
                + "Given the following functions, please respond with a JSON for a function call with its proper "
                "arguments that best answers the given prompt.\n\nRespond in the format {\"name\": function name, "
                "\"parameters\": dictionary of argument name and its value}.Do not use variables.\n\n"
                + json.dumps(WEATHER, indent=4) + "\n\nWhat is the weather in Paris?<|eot_id|>" + header.format("assistant")
                + '[[{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>]]' + header.format("ipython")
                + json.dumps(RESULT["content"]) + "<|eot_id|>" + header.format("assistant")
                + "[[It is 21 degrees in Paris.<|eot_id|>]]")
    assert row(out, 0) == expected_tokens(tok, expected)


def test_qwen3_learns_thinking_and_tool_calls_of_one_query():
    """Both assistant turns answer the last user query: Qwen3 renders their thinking in place, so
    one example holds both, each with its thinking a target."""
    tok = byte_tokenizer("qwen3")
    call = {**CALL, "reasoning_content": "I need the weather."}
    answer = {**ANSWER, "reasoning_content": "21 is mild."}
    out = encode_chats([chat({"role": "system", "content": "Be brief."}, ASK, call, RESULT, answer)], tok, [[WEATHER]])
    assert out["problem"] == [""]
    turns = TOOL_TURNS.replace(f"[[{TOOL_CALL}", f"[[<think>\nI need the weather.\n</think>\n\n{TOOL_CALL}")
    expected = (f"<|im_start|>system\nBe brief.\n\n{TOOLS_PROMPT}{turns}"
                "[[<think>\n21 is mild.\n</think>\n\nIt is 21 degrees in Paris.<|im_end|>]]\n")
    assert row(out, 0) == expected_tokens(tok, expected)


def test_qwen3_empty_think_block_is_template_text_around_tool_calls_too():
    """Without thinking, Qwen3 adds an empty think block to the last turn only: as for a reply of
    content alone, it is no target, and a tool call before the last turn is learned in place."""
    tok = byte_tokenizer("qwen3")
    out = encode_chats([chat(ASK, CALL, RESULT, ANSWER), chat(ASK, CALL)], tok, [[WEATHER], [WEATHER]])
    assert out["problem"] == ["", ""] and out["row"] == [0, 1]
    system = f"<|im_start|>system\n{TOOLS_PROMPT}"
    assert row(out, 0) == expected_tokens(tok, f"{system}{TOOL_TURNS}<think>\n\n</think>\n\n"
                                               "[[It is 21 degrees in Paris.<|im_end|>]]\n")
    ask = TOOL_TURNS[: TOOL_TURNS.index("[[")]
    assert row(out, 1) == expected_tokens(tok, f"{system}{ask}<think>\n\n</think>\n\n[[{TOOL_CALL}<|im_end|>]]\n")


@pytest.mark.parametrize("layout", ["field", "inline"])
def test_reasoning_is_learned_in_both_layouts(layout):
    tok = byte_tokenizer("qwen3")

    def reply(thought, content):
        if layout == "field":
            return {"role": "assistant", "reasoning_content": thought, "content": content}
        return {"role": "assistant", "content": f"<think>\n{thought}\n</think>\n\n{content}"}
    q1, q2 = {"role": "user", "content": "What is the capital of France?"}, {"role": "user", "content": "And of Italy?"}
    one = encode_chats([chat(q1, reply("It is Paris.", "Paris."))], tok)
    assert row(one, 0) == expected_tokens(tok, f"{Q1}[[<think>\nIt is Paris.\n</think>\n\nParis.<|im_end|>]]\n")
    # Qwen3 drops the first turn's thinking once the second question follows: the whole chat
    # trains the second turn, the first is trained alone, as it was generated
    two = encode_chats([chat(q1, reply("It is Paris.", "Paris."), q2, reply("It is Rome.", "Rome."))], tok)
    assert two["problem"] == ["", ""] and two["row"] == [0, 0]
    assert row(two, 0) == expected_tokens(tok, f"{Q1}Paris.<|im_end|>\n{Q2}[[<think>\nIt is Rome.\n</think>\n\n"
                                               "Rome.<|im_end|>]]\n")
    assert row(two, 1) == expected_tokens(tok, f"{Q1}[[<think>\nIt is Paris.\n</think>\n\nParis.<|im_end|>]]")


def test_each_turn_rendered_otherwise_later_stands_alone():
    """Three questions, the first two answers with thinking: those two stand alone, in the context
    each was generated in, and the whole chat trains the last answer (no thinking: Qwen3 adds its
    empty think block to the last turn, template text, not a target)."""
    tok = byte_tokenizer("qwen3")
    q = [{"role": "user", "content": c} for c in ("What is the capital of France?", "And of Italy?", "Thanks.")]
    a = [{"role": "assistant", "reasoning_content": "It is Paris.", "content": "Paris."},
         {"role": "assistant", "reasoning_content": "It is Rome.", "content": "Rome."},
         {"role": "assistant", "content": "You are welcome."}]
    out = encode_chats([chat(q[0], a[0], q[1], a[1], q[2], a[2])], tok)
    assert len(out["input_ids"]) == 3 and out["row"] == [0, 0, 0]
    q3 = "<|im_start|>user\nThanks.<|im_end|>\n<|im_start|>assistant\n"
    assert row(out, 0) == expected_tokens(tok, f"{Q1}Paris.<|im_end|>\n{Q2}Rome.<|im_end|>\n{q3}<think>\n\n</think>\n\n"
                                               "[[You are welcome.<|im_end|>]]\n")
    assert row(out, 2) == expected_tokens(tok, f"{Q1}Paris.<|im_end|>\n{Q2}[[<think>\nIt is Rome.\n</think>\n\n"
                                               "Rome.<|im_end|>]]")
    assert row(out, 1) == expected_tokens(tok, f"{Q1}[[<think>\nIt is Paris.\n</think>\n\nParis.<|im_end|>]]")


def test_what_a_template_does_not_render_is_refused():
    qwen25, llama = byte_tokenizer("qwen2.5"), byte_tokenizer("llama3")
    thought = {"role": "assistant", "reasoning_content": "2 + 3 = 5", "content": "Five."}
    out = encode_chats([chat(ASK, thought)], qwen25)
    assert out["problem"] == ["message 1: the chat template does not render its reasoning_content"]
    # Llama 3's template has no tools: neither the schemas nor a call would reach the model
    out = encode_chats([chat(ASK, ANSWER), chat(ASK, CALL, RESULT, ANSWER)], llama, [[WEATHER], None])
    assert out["problem"][0] == "the chat template does not render its tool 'get_weather' (data.tools_field)"
    assert out["problem"][1].startswith("message 1: the chat template does not render its tool call")
    bad = encode({"messages": [[ASK, ANSWER]], "tools": ["[{"]}, DataConfig(format="chat"), qwen25)
    assert bad["problem"][0].startswith("its tools are not JSON")


def test_the_pipeline_reads_tools_columns_and_names_the_row(tmp_path):
    """A tools column and calls whose arguments differ between rows (datasets reads them as one
    struct, filling each row's missing keys with null: stripped, not rendered as null); a later
    row's problem is named by its row, not by the examples a split chat added before it."""
    tok = byte_tokenizer("qwen2.5")
    tok.save_pretrained(tmp_path / "tok")
    other = {"role": "assistant", "content": "",
             "tool_calls": [{"type": "function", "function": {"name": "get_time", "arguments": {"zone": "CET"}}}]}
    rows = [{"messages": [ASK, {**CALL, "tool_calls": [{"type": "function", "function": {
                "name": "get_weather", "arguments": {"city": "Paris"}}}]}, RESULT, ANSWER], "tools": [WEATHER]},
            {"messages": [ASK, other], "tools": [{"type": "function", "function": {"name": "get_time"}}]}]
    cfg = DataConfig(source="file", path=write(tmp_path, rows), format="chat", seq_len=2048, batch_size=2)
    src, _ = make_sources(cfg, 300, str(tmp_path / "tok"))
    assert len(src.examples) == 2
    first = src.examples.starts.tolist().index(0)
    n = int(src.examples.lengths[first])
    expected = expected_tokens(tok, "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
                                    "assistant.\n\n" + TOOLS_PROMPT + TOOL_TURNS + "[[It is 21 degrees in Paris.<|im_end|>]]\n")
    assert (src.examples.tokens[:n].tolist(), src.examples.targets[:n].astype(int).tolist()) == expected
    tok3 = byte_tokenizer("qwen3")
    tok3.save_pretrained(tmp_path / "tok3")
    q = {"role": "user", "content": "Hi?"}
    split = [q, {"role": "assistant", "reasoning_content": "A greeting.", "content": "Hello."}, q,
             {"role": "assistant", "content": "Hello again."}]
    path = write(tmp_path, [{"messages": split}, {"messages": [q, {"content": "Hello."}]}], "r.jsonl")
    with pytest.raises(ValueError, match=r"1 example\(s\) of .* cannot be labelled exactly \(example 1: message 1 lacks a role\)"):
        make_sources(DataConfig(source="file", path=path, format="chat", seq_len=2048), 300, str(tmp_path / "tok3"))


def test_sharegpt_function_calls_and_observations_are_tool_turns():
    """LlamaFactory's ShareGPT layout (function_call, observation, and system and tools columns as
    JSON strings) encodes as the same chat in messages does."""
    tok = byte_tokenizer("qwen2.5")
    turns = [{"from": "human", "value": ASK["content"]},
             {"from": "function_call", "value": json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}})},
             {"from": "observation", "value": RESULT["content"]}, {"from": "gpt", "value": ANSWER["content"]}]
    out = encode({"conversations": [turns], "system": ["Be brief."], "tools": [json.dumps([WEATHER])]},
                 DataConfig(format="sharegpt"), tok)
    system = {"role": "system", "content": "Be brief."}
    assert row(out, 0) == row(encode_chats([chat(system, ASK, CALL, RESULT, ANSWER)], tok, [[WEATHER]]), 0)
    bad = encode({"conversations": [[turns[0], {"from": "function_call", "value": "get_weather(Paris)"}]]},
                 DataConfig(format="sharegpt"), tok)
    assert bad["problem"][0].startswith("a function_call's value must be a JSON object with a name")


def test_a_template_with_generation_marks_that_drops_thinking_is_refused():
    """ChatML with {% generation %} marks renders content alone: thinking and tools would be lost."""
    tok = byte_tokenizer("chatml-generation")
    thought = {"role": "assistant", "reasoning_content": "2 + 3 = 5", "content": "Five."}
    out = encode_chats([chat(ASK, thought), chat(ASK, ANSWER), chat(ASK, ANSWER)], tok, [None, [WEATHER], None])
    assert out["problem"] == ["message 1: the chat template does not render its reasoning_content",
                              "the chat template does not render its tool 'get_weather' (data.tools_field)", ""]

"""Tool calls without a model: each family's template gets the tools, a past call and its result;
each family's reply is read back as the calls it holds, streamed or whole; tool_choice
"required" and a named function build schemas that only the tools' calls satisfy."""
from __future__ import annotations

import json
import shutil

import jsonschema
import pytest

from chat_templates import FAMILIES
from saguaro.models.tokenizer import load_tokenizer
from saguaro.models.tokenizer import FolderTokenizer
from saguaro.server.tools import (FUNCTOOLS, HERMES, LLAMA3, PHI4, ChatTemplateTools, ToolCall, ToolCallStream,
                                  ToolReading, forced_calls, required_calls_schema)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}
CONVERSATION = [
    {"role": "system", "content": "You help travellers."},
    {"role": "user", "content": "Weather in Lima and the time there?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Lima"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "America/Lima"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "19 C, cloudy"},
    {"role": "tool", "tool_call_id": "call_2", "content": "14:05"},
]
EXPECTED_FORMAT = {"qwen": HERMES, "smollm3": HERMES, "llama3": LLAMA3, "phi4-mini": FUNCTOOLS, "gemma3": HERMES}


@pytest.fixture(scope="module")
def tokenizer_folder(smollm2_path, tmp_path_factory):
    """The default model's tokenizer folder, to which each test gives a family's template."""
    folder = tmp_path_factory.mktemp("tokenizer")
    shutil.copytree(load_tokenizer(smollm2_path).name_or_path, folder, dirs_exist_ok=True)
    return folder


def family_tokenizer(folder, family: str) -> FolderTokenizer:
    (folder / "chat_template.jinja").write_text(FAMILIES[family])
    return FolderTokenizer(folder)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_family_gets_the_tools_the_past_calls_and_their_results(tokenizer_folder, family):
    tokenizer = family_tokenizer(tokenizer_folder, family)
    template = ChatTemplateTools.of(tokenizer.chat_template)
    assert template.format == EXPECTED_FORMAT[family]
    assert template.takes_tools == (family != "gemma3")
    tools = [WEATHER, TIME]
    messages = template.messages(CONVERSATION, tools)
    text = tokenizer.apply_chat_template(messages, tools=tools if template.takes_tools else None,
                                         add_generation_prompt=True, tokenize=False)
    for needle in ("get_weather", "celsius", "You help travellers.", "Weather in Lima", "19 C, cloudy"):
        assert needle in text, (family, needle)
    if family != "llama3":  # Llama 3's template writes the first of a turn's calls only
        assert "14:05" in text and "America/Lima" in text
    assert '"city": "Lima"' in text  # the arguments as an object, not JSON text inside a string


def test_a_template_without_tools_gets_calls_as_text_and_results_in_one_user_turn(tokenizer_folder):
    tokenizer = family_tokenizer(tokenizer_folder, "gemma3")
    template = ChatTemplateTools.of(tokenizer.chat_template)
    messages = template.messages(CONVERSATION, [WEATHER])
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert HERMES.parse(messages[2]["content"])[1] == [ToolCall("get_weather", '{"city": "Lima"}'),
                                                       ToolCall("get_time", '{"zone": "America/Lima"}')]
    assert "<tools>" in messages[0]["content"]
    with pytest.raises(Exception, match="alternate"):  # the control: the history as it came
        tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=True, tokenize=False)


def test_phi4_minis_own_template_reads_tools_from_a_message_not_the_variable():
    own = ("{% for message in messages %}{% if message['role'] == 'system' and 'tools' in message and "
           "message['tools'] is not none %}{{ '<|tool|>' + message['tools'] + '<|/tool|>' }}{% endif %}{% endfor %}")
    assert not ChatTemplateTools.of(own).takes_tools
    assert ChatTemplateTools.of("{% if tools is defined %}{{ tools | tojson }}{% endif %}").takes_tools


REPLIES = {  # format: (reply, content, calls)
    "hermes": (HERMES, 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima"}}\n'
                       '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>',
               "Let me check.", [("get_weather", {"city": "Lima"}), ("get_time", {"zone": "UTC"})]),
    "phi4 tags": (PHI4, '<|tool_call|>{"name": "get_time", "arguments": {"zone": "UTC"}}<|/tool_call|>', None,
                  [("get_time", {"zone": "UTC"})]),
    "functools": (FUNCTOOLS, 'functools[{"name": "get_weather", "arguments": {"city": "Oslo; Norway"}}, '
                             '{"name": "get_time", "arguments": {"zone": "CET"}}]', None,
                  [("get_weather", {"city": "Oslo; Norway"}), ("get_time", {"zone": "CET"})]),
    "llama3": (LLAMA3, '<|python_tag|>{"name": "get_weather", "parameters": {"city": "a;b"}}', None,
               [("get_weather", {"city": "a;b"})]),
    "llama3, two": (LLAMA3, '{"name": "get_weather", "parameters": {"city": "Lima"}}; '
                            '{"name": "get_time", "parameters": {"zone": "UTC"}}', None,
                    [("get_weather", {"city": "Lima"}), ("get_time", {"zone": "UTC"})]),
    "plain answer": (HERMES, "It is sunny in Lima.", "It is sunny in Lima.", []),
    "llama3 plain answer": (LLAMA3, "It is sunny.", "It is sunny.", []),
    "not JSON in the tags": (HERMES, "<tool_call>\n{get_weather(Lima)}\n</tool_call>",
                             "<tool_call>\n{get_weather(Lima)}\n</tool_call>", []),
    "a call cut off": (HERMES, 'Sure <tool_call>\n{"name": "get_weather", "argu', 'Sure <tool_call>\n{"name": '
                                                                                '"get_weather", "argu', []),
    "a call without its closing tag": (HERMES, '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}',
                                       None, [("get_time", {"zone": "UTC"})]),
}


@pytest.mark.parametrize("name", list(REPLIES))
def test_replies_are_read_as_their_calls(name):
    format, reply, content, expected = REPLIES[name]
    got_content, calls = format.parse(reply)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == expected


@pytest.mark.parametrize("name", list(REPLIES))
def test_a_streamed_reply_gives_what_the_whole_reply_gives_however_it_is_cut(name):
    format, reply, content, expected = REPLIES[name]
    for cut in range(1, len(reply), 3):
        for second in (cut + 1, cut + 7):
            stream = ToolCallStream(ToolReading(format))
            streamed = stream.add(reply[:cut]) + stream.add(reply[cut:second]) + stream.add(reply[second:])
            rest, calls = stream.finish()
            assert [(c.name, json.loads(c.arguments)) for c in calls] == expected
            if not expected:
                assert streamed + rest == reply  # nothing held back for ever
            else:
                assert (streamed + rest).strip() == (content or "")


def test_parallel_tool_calls_false_keeps_the_first_call():
    format, reply, _, expected = REPLIES["hermes"]
    assert [c.name for c in ToolReading(format, parallel=False).read(reply)[1]] == [expected[0][0]]


def test_required_calls_validate_and_others_do_not():
    functions = [WEATHER["function"], TIME["function"]]
    schema = required_calls_schema(functions, parallel=True)
    good = [{"name": "get_weather", "arguments": {"city": "Lima", "unit": "celsius"}},
            {"name": "get_time", "arguments": {"zone": "UTC"}}]
    jsonschema.validate(good, schema)
    for bad in ([], [{"name": "get_weather", "arguments": {"unit": "celsius"}}],
                [{"name": "get_weather", "arguments": {"city": "Lima", "unit": "kelvin"}}],
                [{"name": "launch", "arguments": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    with pytest.raises(jsonschema.ValidationError):  # one call at most without parallel calls
        jsonschema.validate(good, required_calls_schema(functions, parallel=False))
    assert forced_calls(json.dumps(good), None) == [ToolCall("get_weather", '{"city": "Lima", "unit": "celsius"}'),
                                                    ToolCall("get_time", '{"zone": "UTC"}')]
    assert forced_calls('{"zone": "UTC"}', "get_time") == [ToolCall("get_time", '{"zone": "UTC"}')]
    assert forced_calls('{"zone": "UT', "get_time") == []  # cut off at max_tokens: no call

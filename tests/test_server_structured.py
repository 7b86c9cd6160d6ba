"""Structured outputs, tool calls, logprobs and the sampling controls through `saguaro serve` and
the official openai client: `chat.completions.parse` with a Pydantic model, a two-turn agent
loop, streamed tool calls, every schema of tests/api_schemas.py and every required tool call
valid, logprobs in OpenAI's shapes (streamed too), batched prompts, and bad input refused by name.

The server runs a 2-layer random-weight model with the default model's tokenizer and Qwen's
chat template (which takes tools): what it writes is noise, but under a grammar valid noise."""
from __future__ import annotations

import asyncio
import json
from typing import Annotated

import httpx
import jsonschema
import openai
import pytest
import torch
from pydantic import BaseModel, Field, StringConstraints

from api_schemas import SCHEMAS, TOOLS
from chat_templates import QWEN
from saguaro import LLM
from saguaro.models.config import ModelConfig
from saguaro.models.llama import LlamaModel
from saguaro.engine.structured import StructuredOutputs
from saguaro.models.checkpoint import save_checkpoint
from saguaro.models.tokenizer import load_tokenizer
from saguaro.server.app import ServerConfig
from saguaro.server.protocol import ChatCompletionRequest
from test_server import KEY, LiveServer

MODEL = "tiny-qwen"
TIMEOUT_S = 120
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city now.",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"enum": ["Lima", "Oslo", "Cairo"]},
                                                "unit": {"enum": ["celsius", "fahrenheit"]}},
                                                "required": ["city", "unit"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Lima?"}]


@pytest.fixture(scope="module")
def tiny_qwen(smollm2_path, tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("tiny-qwen")
    load_tokenizer(smollm2_path).save_pretrained(folder)
    (folder / "chat_template.jinja").write_text(QWEN)
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                         num_kv_heads=1, head_dim=16, max_position_embeddings=2048)
    save_checkpoint(LlamaModel(config), folder, dtype=torch.float32, share_embeddings=False)
    return str(folder)


@pytest.fixture(scope="module")
def server(tiny_qwen):
    llm = LLM(tiny_qwen, method="ar", dtype="float32", max_num_seqs=64)
    live = LiveServer(llm, ServerConfig(MODEL, api_key=KEY), max_model_len=2048, max_waiting=128)
    yield live
    live.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=TIMEOUT_S)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=TIMEOUT_S) as c:
        yield c


class Forecast(BaseModel):
    city: str = Field(max_length=20)
    temperature_c: int = Field(ge=-50, le=50)
    conditions: list[Annotated[str, StringConstraints(max_length=12)]] = Field(max_length=3)
    windy: bool


def test_parse_with_a_pydantic_model(client):
    completion = client.chat.completions.parse(model=MODEL, messages=ASK, response_format=Forecast, max_tokens=400,
                                               temperature=1.0, seed=3)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Forecast)
    assert -50 <= choice.message.parsed.temperature_c <= 50


def test_an_agent_loop_calls_a_tool_and_answers_with_its_result(client):
    messages = list(ASK)
    first = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], tool_choice="required",
                                           max_tokens=200, seed=1)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    messages.append(choice.message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": "19 C and cloudy"})
    second = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=8, seed=1)
    answer = second.choices[0]
    assert answer.finish_reason in ("stop", "length") and answer.message.content
    assert second.usage.prompt_tokens > first.usage.prompt_tokens  # the call and its result are in the prompt


def test_a_named_function_is_called_with_valid_arguments(client):
    out = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS[:3] + [WEATHER], max_tokens=200,
                                         tool_choice={"type": "function", "function": {"name": "get_weather"}})
    calls = out.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["get_weather"] and out.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER["function"]["parameters"])


def test_streamed_tool_calls_add_up_to_valid_calls(client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required",
                                                 max_tokens=200, seed=2, stream=True))
    calls: dict[int, dict] = {}
    for chunk in chunks:
        for delta in chunk.choices[0].delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
            call["name"] += delta.function.name or ""
            call["arguments"] += delta.function.arguments or ""
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert calls and all(c["name"] == "get_weather" for c in calls.values())
    for call in calls.values():
        jsonschema.validate(json.loads(call["arguments"]), WEATHER["function"]["parameters"])


async def all_at_once(server, requests: list[dict]) -> list:
    async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=300) as aclient:
        return await asyncio.gather(*(aclient.chat.completions.create(model=MODEL, **r) for r in requests))


def test_every_schema_output_and_every_required_tool_call_validates(server):
    """All 59 schemas and 12 tools' required calls, at once: 100% parse and validate. Formats
    are annotations, as jsonschema reads them by default: llguidance's date-time allows a leap
    second (":60", as RFC 3339 does), which jsonschema's format checker refuses.
    (About 15 s on a quiet 2-core machine: every schema of the goal is run.)"""
    requests = [dict(messages=[{"role": "user", "content": s.prompt}], max_tokens=1500, seed=i,
                     response_format={"type": "json_schema", "json_schema": {"name": s.name, "schema": s.schema,
                                                                             "strict": True}})
                for i, s in enumerate(SCHEMAS)]
    requests += [dict(messages=[{"role": "user", "content": t["function"]["description"]}], seed=i,
                      tools=[t, TOOLS[i - 1]], tool_choice="required") for i, t in enumerate(TOOLS)]
    outputs = asyncio.run(all_at_once(server, requests))
    for schema, out in zip(SCHEMAS, outputs):
        assert out.choices[0].finish_reason == "stop", schema.name
        jsonschema.validate(json.loads(out.choices[0].message.content), schema.schema)
    parameters = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for out in outputs[len(SCHEMAS):]:
        assert out.choices[0].finish_reason == "tool_calls"
        for call in out.choices[0].message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), parameters[call.function.name])


def test_a_grammar_unfinished_at_max_tokens_ends_with_length(client):
    out = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, response_format={
        "type": "json_schema", "json_schema": {"name": "forecast", "schema": Forecast.model_json_schema()}})
    assert out.choices[0].finish_reason == "length"
    with pytest.raises(ValueError):
        json.loads(out.choices[0].message.content)
    out = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required",
                                         max_tokens=4)
    assert out.choices[0].finish_reason == "length" and not out.choices[0].message.tool_calls


def test_chat_logprobs_streamed_and_whole(client):
    request = dict(model=MODEL, messages=ASK, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3)
    whole = client.chat.completions.create(**request)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens == 8
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert entry.top_logprobs[0].token == entry.token  # greedy: the chosen token is the most likely
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token
    assert "".join(e.token for e in content) == whole.choices[0].message.content
    streamed = [e for chunk in client.chat.completions.create(**request, stream=True) if chunk.choices
                and chunk.choices[0].logprobs for e in chunk.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]


def test_completion_logprobs_with_echo(client, server):
    prompt = "The capital of France is"
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, logprobs=2, echo=True)
    choice = choice0 = out.choices[0]
    lp = choice.logprobs
    prompt_len = len(server.llm.encode(prompt))
    assert len(lp.tokens) == prompt_len + 4 == out.usage.prompt_tokens + out.usage.completion_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
    assert choice0.text.startswith(prompt) and "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, logprobs=2)
    assert plain.choices[0].logprobs.tokens == lp.tokens[prompt_len:]
    assert plain.choices[0].logprobs.token_logprobs == pytest.approx(lp.token_logprobs[prompt_len:])


def test_a_list_of_prompts_is_one_batch_in_openais_order(client):
    prompts = ["Once upon a time", "SELECT name FROM", "def f(x):"]
    out = client.completions.create(model=MODEL, prompt=prompts, max_tokens=5, temperature=0, n=2)
    assert [c.index for c in out.choices] == list(range(6))
    single = [client.completions.create(model=MODEL, prompt=p, max_tokens=5, temperature=0).choices[0].text
              for p in prompts]
    assert [c.text for c in out.choices] == [t for t in single for _ in range(2)]
    assert out.usage.completion_tokens == 30


def test_logit_bias_and_penalties_reach_the_sampler(client, server):
    token = server.llm.encode(" banana")[-1]
    out = client.completions.create(model=MODEL, prompt="Hi", max_tokens=6, temperature=0, logit_bias={str(token): 100})
    assert out.choices[0].text == server.llm.tokenizer.decode([token] * 6)
    free = client.completions.create(model=MODEL, prompt="Hi", max_tokens=6, temperature=0)
    assert free.choices[0].text != out.choices[0].text  # the control: without the bias
    penalised = client.completions.create(model=MODEL, prompt="Hi", max_tokens=6, temperature=0,
                                          logit_bias={str(token): 100}, frequency_penalty=2.0,
                                          extra_body={"repetition_penalty": 1.5, "min_p": 0.1, "min_tokens": 2})
    assert penalised.choices[0].finish_reason == "length"


BAD = {  # name: (path, body changes, the param the 400 names)
    "malformed schema": ("chat", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "no-such-type"}}}}}}, "response_format"),
    "unsupported schema": ("chat", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"$ref": "https://example.com/remote.json"}}}}, "response_format"),
    "unknown function": ("chat", {"tools": [WEATHER], "tool_choice": {"type": "function",
                                                                      "function": {"name": "launch"}}}, "tool_choice"),
    "top_logprobs over 20": ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    "completion logprobs over 20": ("completion", {"logprobs": 21}, "logprobs"),
    "top_logprobs without logprobs": ("chat", {"top_logprobs": 2}, "top_logprobs"),
    "two constraints": ("chat", {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a+"}},
                        "response_format"),
    "a bad regex": ("completion", {"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
    "suffix": ("completion", {"suffix": "end"}, "suffix"),
    "best_of other than n": ("completion", {"best_of": 3}, "best_of"),
    "logit_bias key not a token id": ("completion", {"logit_bias": {"hello": 1}}, "logit_bias"),
    "logit_bias token outside the vocabulary": ("completion", {"logit_bias": {"999999": 1}}, "logit_bias"),
    "logit_bias over 100": ("completion", {"logit_bias": {"5": 101}}, "logit_bias"),
    "presence_penalty over 2": ("completion", {"presence_penalty": 2.5}, "presence_penalty"),
    "an unknown field": ("completion", {"max_token": 5}, "max_token"),
    "audio": ("chat", {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    "a tool message without content": ("chat", {"messages": ASK + [{"role": "tool", "tool_call_id": "x"}]},
                                       "messages.1"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_is_refused_by_name(http, name):
    kind, changes, param = BAD[name]
    path, base = (("/v1/chat/completions", {"model": MODEL, "messages": ASK}) if kind == "chat" else
                  ("/v1/completions", {"model": MODEL, "prompt": "Hi"}))
    r = http.post(path, json={**base, "max_tokens": 4, **changes})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] is not None and error["param"].startswith(param), error
    assert param.split(".")[0] in error["message"] or error["param"] == param, error


def test_accepted_fields_that_do_not_change_the_output(http):
    body = {"model": MODEL, "messages": ASK, "max_tokens": 3, "temperature": 0}
    plain = http.post("/v1/chat/completions", json=body).json()
    extras = {"user": "u1", "store": False, "metadata": {"k": "v"}, "service_tier": "auto", "parallel_tool_calls": True,
              "modalities": ["text"], "reasoning_effort": "low", "tool_choice": "none", "tools": [WEATHER]}
    r = http.post("/v1/chat/completions", json={**body, **extras})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]


def test_a_request_maps_to_sampling_params():
    body = ChatCompletionRequest.model_validate({
        "model": MODEL, "messages": ASK, "temperature": 0.5, "presence_penalty": 0.5, "frequency_penalty": -0.5,
        "repetition_penalty": 1.2, "logit_bias": {"17": -100, "4": 5.5}, "min_p": 0.05, "min_tokens": 3,
        "stop_token_ids": [2], "logprobs_mode": "processed_logprobs", "guided_regex": "[a-z]+"})
    params = body.sampling_params(40, logprobs=4, constraint=body.output_constraint())
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (0.5, -0.5, 1.2)
    assert params.logit_bias == {17: -100, 4: 5.5} and params.min_p == 0.05 and params.min_tokens == 3
    assert params.stop_token_ids == [2] and params.logprobs == 4 and params.logprobs_mode == "processed"
    assert params.structured_outputs == StructuredOutputs(regex="[a-z]+") and params.max_tokens == 40
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    for extra, expected in [({"response_format": {"type": "json_object"}}, StructuredOutputs(json_object=True)),
                            ({"response_format": {"type": "json_schema", "json_schema": {
                                "name": "a", "schema": schema, "strict": True}}}, StructuredOutputs(json=schema)),
                            ({"structured_outputs": {"choice": ["yes", "no"]}}, StructuredOutputs(choice=["yes", "no"])),
                            ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
                             StructuredOutputs(json=WEATHER["function"]["parameters"]))]:
        body = ChatCompletionRequest.model_validate({"model": MODEL, "messages": ASK, **extra})
        assert body.output_constraint().outputs == expected
    body = ChatCompletionRequest.model_validate({"model": MODEL, "messages": ASK, "tools": [WEATHER]})
    assert body.output_constraint() is None  # tool_choice "auto": the model's own format, unconstrained


def test_a_reply_in_the_familys_format_is_read_as_tool_calls_whole_and_streamed(client):
    """tool_choice "auto": the reply, here forced into Qwen's form by a choice, is parsed."""
    reply = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima", "unit": "celsius"}}\n</tool_call>'
    request = dict(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=100,
                   extra_body={"structured_outputs": {"choice": [reply]}})
    whole = client.chat.completions.create(**request).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content == "Checking."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls] == \
        [("get_weather", {"city": "Lima", "unit": "celsius"})]
    chunks = list(client.chat.completions.create(**request, stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    calls = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
    assert content.strip() == "Checking." and chunks[-1].choices[0].finish_reason == "tool_calls"
    assert [(d.function.name, json.loads(d.function.arguments)) for d in calls] == \
        [("get_weather", {"city": "Lima", "unit": "celsius"})]
    plain = client.chat.completions.create(**{**request, "tool_choice": "none"}).choices[0]  # the control
    assert plain.finish_reason == "stop" and plain.message.content == reply and not plain.message.tool_calls

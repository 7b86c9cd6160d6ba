"""OpenAI request bodies (the subset saguaro serves) and the JSON it answers with.

Request models are strict, so a wrong type is an error rather than a silent coercion. Every
OpenAI parameter is either honoured or refused by name with a 400, and so is a parameter
saguaro does not know (OpenAI's "Unrecognized request argument"); vLLM's extensions that
saguaro honours (top_k, min_p, repetition_penalty, structured_outputs and the older guided_*
fields, ...) are accepted.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from saguaro.engine.sampler import SamplingParams
from saguaro.engine.structured import StructuredOutputs
from saguaro.server import tools as tool_calls

MAX_STOP_STRINGS = 4
MAX_CHOICES = 128  # samples x prompts in one request
MAX_LOGPROBS = 20
MAX_TOP_K = 2 ** 31 - 1  # the sampler takes top_k as a C integer; anything over the vocabulary is "off" anyway


class APIError(Exception):
    """An error answered as OpenAI does: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class Request(BaseModel):
    """Unknown fields are refused by name, as OpenAI refuses them: a misspelt parameter must not
    silently change what is generated."""
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: accepted, usage comes at the end only


class StructuredOutputsRequest(Request):
    """vLLM's `structured_outputs`: exactly one of these."""
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class JSONSchemaFormat(Request):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


REFUSED_UNLESS_DEFAULT = {  # OpenAI fields saguaro cannot honour: name -> the only value taken
    "suffix": None, "audio": None, "prediction": None, "web_search_options": None, "functions": None,
    "function_call": None, "modalities": ["text"]}


class SamplingRequest(Request):
    """Fields shared by completions and chat completions."""

    model: str
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1, le=MAX_TOP_K)  # an extension (vLLM's): -1 is off
    min_p: float = Field(0.0, ge=0, le=1)  # vLLM's
    seed: int | None = Field(None, ge=0, lt=2 ** 63)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # vLLM's
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # an extension (vLLM's)
    min_tokens: int = Field(0, ge=0)  # vLLM's
    n: int = Field(1, ge=1, le=MAX_CHOICES)  # samples of the prompt, each a choice
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0)  # vLLM's
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias, as OpenAI sends it
    logprobs_mode: Literal["raw_logprobs", "processed_logprobs"] = "raw_logprobs"  # vLLM's server option
    structured_outputs: StructuredOutputsRequest | None = None  # vLLM's
    guided_json: dict[str, Any] | str | None = None  # vLLM's before 0.12, as structured_outputs.json
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # OpenAI's that do not change what is generated here: accepted, not used
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    @model_validator(mode="before")
    @classmethod
    def valid_unicode(cls, data: Any) -> Any:
        """JSON may escape half a UTF-16 surrogate pair (\\ud800), which Python keeps as a lone
        surrogate: no tokenizer or UTF-8 encoder takes it, so it is refused wherever it is."""
        if (where := lone_surrogate(data)) is not None:
            raise PydanticCustomError("lone_surrogate", "{where} holds a lone UTF-16 surrogate (half of an "
                                      "escaped pair such as \\ud800): text must be valid Unicode", {"where": where})
        return data

    @model_validator(mode="before")
    @classmethod
    def null_means_default(cls, data: Any) -> Any:
        """OpenAI reads an explicit null as the parameter's default."""
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data

    def check_supported(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed with stream = true", param="stream_options")
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if len(stops) > MAX_STOP_STRINGS or any(not s for s in stops):
            raise APIError(400, f"stop takes up to {MAX_STOP_STRINGS} non-empty strings", param="stop")
        for name, default in REFUSED_UNLESS_DEFAULT.items():
            value = getattr(self, name, None)
            if value not in (None, default, "", []):
                raise APIError(400, f"{name} is not supported by saguaro", param=name)
        for key, bias in (self.logit_bias or {}).items():
            if not key.isdigit():
                raise APIError(400, f"logit_bias keys are token ids, got {key!r}", param="logit_bias")
            if not -100 <= bias <= 100:
                raise APIError(400, f"logit_bias values are in [-100, 100], got {bias}", param="logit_bias")

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def structured_constraints(self) -> dict[str, StructuredOutputs]:
        """The output constraints this request sets, by the field that set it."""
        found = {}
        if self.structured_outputs is not None:
            so = self.structured_outputs
            given = {k: v for k, v in dict(json=so.json_, regex=so.regex, choice=so.choice, grammar=so.grammar,
                                           json_object=so.json_object or None).items() if v is not None}
            found["structured_outputs"] = constraint("structured_outputs", **given)
        for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"):
            if (value := getattr(self, name)) is not None:
                found[name] = constraint(name, **{name.removeprefix("guided_"): value})
        return found

    def output_constraint(self) -> OutputConstraint | None:
        found = self.structured_constraints()
        if len(found) > 1:
            raise APIError(400, f"{' and '.join(found)} both constrain the output: give one", param=list(found)[1])
        return next((OutputConstraint(param, outputs) for param, outputs in found.items()), None)

    def sampling_params(self, max_tokens: int, logprobs: int | None = None, prompt_logprobs: int | None = None,
                        constraint: OutputConstraint | None = None) -> SamplingParams:
        """Raises APIError (400) naming the field for a value the engine refuses (a schema it
        cannot compile, a token id outside the vocabulary)."""
        try:
            return SamplingParams(
                temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p, seed=self.seed,
                max_tokens=max_tokens, stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
                stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos, n=self.n,
                min_tokens=self.min_tokens, presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
                logit_bias={int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None,
                logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                logprobs_mode=self.logprobs_mode.removesuffix("_logprobs"),
                structured_outputs=None if constraint is None else constraint.outputs)
        except ValueError as e:
            raise APIError(400, str(e), param=self.param_named_in(str(e), constraint)) from e

    def param_named_in(self, message: str, constraint: OutputConstraint | None) -> str | None:
        """The request field an engine error's message names."""
        if "structured_outputs" in message and constraint is not None:
            return constraint.param
        if "prompt_logprobs" in message:
            return "echo"
        return next((name for name in sorted(type(self).model_fields, key=len, reverse=True) if name in message),
                    None)


@dataclass
class OutputConstraint:
    param: str  # the request field that set it
    outputs: StructuredOutputs


def constraint(param: str, **given) -> StructuredOutputs:
    """The engine's constraint; one it refuses (not exactly one kind, a schema or regex
    llguidance cannot compile) is a 400 naming `param`, the request field that gave it."""
    try:
        return StructuredOutputs(**given)
    except ValueError as e:
        raise APIError(400, f"{param}: {e}", param=param) from e


def lone_surrogate(data: Any) -> str | None:
    """Where (a dotted path) the first string or key holding a lone surrogate is in parsed JSON,
    or None. Iterative: a deeply nested body must not overflow the stack."""
    pending: list[tuple[str, Any]] = [("", data)]
    while pending:
        where, value = pending.pop()
        if isinstance(value, str) and not is_encodable(value):
            return where or "the body"
        if isinstance(value, dict):
            for key, item in value.items():
                if isinstance(key, str) and not is_encodable(key):
                    return f"a key of {where or 'the body'}"
                pending.append((f"{where}.{key}" if where else key, item))
        elif isinstance(value, list):
            pending.extend((f"{where}[{i}]", item) for i, item in enumerate(value))
    return None


def is_encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class CompletionRequest(SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)

    def check_supported(self) -> None:
        super().check_supported()
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(400, f"best_of must equal n ({self.n}): saguaro returns every sample it draws",
                           param="best_of")

    def prompts(self) -> list[str | list[int]]:
        """The prompts, each text or token ids; a request may give several (a batch)."""
        prompt = self.prompt
        prompts = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else [prompt]
        for i, p in enumerate(prompts):
            if not p:
                raise APIError(400, "the prompt is empty" if len(prompts) == 1 else f"prompt {i} is empty",
                               param="prompt")
        return prompts


class TextPart(Request):
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    name: str
    arguments: str | dict[str, Any]


class MessageToolCall(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    """Fields of messages that do not shape the prompt (an assistant reply's `refusal`,
    `annotations`, sent back as the client got them) are ignored."""
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def has_content(self) -> "ChatMessage":
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise PydanticCustomError("missing_content", "a {role} message needs content", {"role": self.role})
        return self

    def as_template_input(self) -> dict:
        text = self.content if isinstance(self.content, str) or self.content is None else \
            "".join(p.text for p in self.content)
        message = {"role": "system" if self.role == "developer" else self.role, "content": text or ""}
        if self.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": c.type, "function": c.function.model_dump()}
                                     for c in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None and self.role == "tool":
            message["name"] = self.name
        return message


class FunctionDefinition(Request):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Request):
    name: str


class NamedToolChoice(Request):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: more variables for the chat template
    # OpenAI's, refused unless left at their defaults
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    # OpenAI's for reasoning models: accepted, not used
    reasoning_effort: str | None = None
    verbosity: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs = true", param="top_logprobs")
        choice = self.tool_choice
        if choice is not None and choice != "none" and not self.tools:
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in {t.function.name for t in self.tools}:
            raise APIError(400, f"tool_choice names the function {choice.function.name!r}, which is not among "
                                f"the tools", param="tool_choice")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def calls_tools(self) -> bool:
        """Whether tools are offered to the model (tool_choice "none" hides them)."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def named_function(self) -> str | None:
        return self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else None

    def structured_constraints(self) -> dict[str, StructuredOutputs]:
        found = super().structured_constraints()
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            found["response_format"] = constraint("response_format", json_object=True)
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise APIError(400, "response_format json_schema needs json_schema.schema", param="response_format")
            found["response_format"] = constraint("response_format", json=fmt.json_schema.schema_,
                                                  strict=bool(fmt.json_schema.strict))
        if self.tools and (self.tool_choice == "required" or self.named_function is not None):
            functions = [t.function.model_dump() for t in self.tools]
            if self.named_function is not None:
                function = next(f for f in functions if f["name"] == self.named_function)
                found["tool_choice"] = constraint("tools", json=tool_calls.parameters_schema(function))
            else:
                found["tool_choice"] = constraint("tools", json=tool_calls.required_calls_schema(
                    functions, self.parallel_tool_calls))
        return found


# --- responses ----------------------------------------------------------------------------

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """cached_tokens: prompt tokens the prefix cache served, reported as OpenAI reports its own."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def completion_choice(text: str, finish_reason: str | None, index: int = 0, logprobs: dict | None = None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_choice(content: str | None, finish_reason: str | None, index: int = 0, tool_calls: list[dict] | None = None,
                logprobs: dict | None = None) -> dict:
    message = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_delta(delta: dict, finish_reason: str | None, index: int = 0, logprobs: dict | None = None) -> dict:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


def envelope(id: str, object: str, model: str, choices: list[dict], usage: dict | None = None,
             created: int | None = None) -> dict:
    body = {"id": id, "object": object, "created": created or int(time.time()), "model": model, "choices": choices}
    if usage is not None:
        body["usage"] = usage
    return body

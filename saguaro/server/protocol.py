"""OpenAI request bodies (the subset saguaro serves) and the JSON it answers with.

Request models are strict, so a wrong type is an error rather than a silent coercion; fields
saguaro does not know are ignored, as OpenAI's own clients send optional extras. Parameters
it knows but cannot honour (logprobs, penalties, tools) are refused by name.
"""
from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from saguaro.engine.sampler import SamplingParams

MAX_STOP_STRINGS = 4
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


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


class SamplingRequest(BaseModel):
    """Fields shared by completions and chat completions."""
    model_config = ConfigDict(strict=True, extra="ignore")

    model: str
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1, le=MAX_TOP_K)  # an extension (vLLM's): -1 is off
    seed: int | None = Field(None, ge=0, lt=2 ** 63)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # an extension (vLLM's)
    user: str | None = None
    n: int = Field(1, ge=1, le=128)  # samples of the prompt, each a choice
    # known but unsupported: refused unless left at their defaults
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None

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
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise APIError(400, f"{name} is not supported", param=name)
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported", param="logit_bias")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed with stream = true", param="stream_options")
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if len(stops) > MAX_STOP_STRINGS or any(not s for s in stops):
            raise APIError(400, f"stop takes up to {MAX_STOP_STRINGS} non-empty strings", param="stop")

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, seed=self.seed,
                              max_tokens=max_tokens, stop=[self.stop] if isinstance(self.stop, str) else
                              list(self.stop or []), ignore_eos=self.ignore_eos, n=self.n)


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
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.logprobs is not None:
            raise APIError(400, "logprobs are not supported", param="logprobs")
        if self.echo:
            raise APIError(400, "echo is not supported", param="echo")
        if self.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        if self.best_of not in (None, 1):
            raise APIError(400, "only best_of = 1 is supported", param="best_of")

    def single_prompt(self) -> str | list[int]:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise APIError(400, "only one prompt per request is supported", param="prompt")
            prompt = prompt[0]
        if not prompt:
            raise APIError(400, "the prompt is empty", param="prompt")
        return prompt


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def as_template_input(self) -> dict:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.logprobs or self.top_logprobs is not None:
            raise APIError(400, "logprobs are not supported", param="logprobs")
        if self.tools:
            raise APIError(400, "tools are not supported", param="tools")
        if self.response_format not in (None, {"type": "text"}):
            raise APIError(400, "only the text response format is supported", param="response_format")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# --- responses ----------------------------------------------------------------------------

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """cached_tokens: prompt tokens the prefix cache served, reported as OpenAI reports its own."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def completion_choice(text: str, finish_reason: str | None, index: int = 0) -> dict:
    return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}


def chat_choice(text: str, finish_reason: str | None, index: int = 0) -> dict:
    return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": None,
            "finish_reason": finish_reason}


def chat_delta(delta: dict, finish_reason: str | None, index: int = 0) -> dict:
    return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}


def envelope(id: str, object: str, model: str, choices: list[dict], usage: dict | None = None,
             created: int | None = None) -> dict:
    body = {"id": id, "object": object, "created": created or int(time.time()), "model": model, "choices": choices}
    if usage is not None:
        body["usage"] = usage
    return body

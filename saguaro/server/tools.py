"""Tool calls: the tools handed to the chat template, the reply read back as OpenAI tool calls.

Each model family writes its calls its own way, which its chat template teaches it: Hermes /
Qwen 2.5 / Qwen 3 / SmolLM3 put a JSON object in <tool_call>...</tool_call>, Phi-4-mini in
<|tool_call|>...<|/tool_call|>, Llama 3.x answers with the bare JSON object (`parameters` for the
arguments, after an optional <|python_tag|>). The family is read off the template's text. A
template that takes no tools (SmolLM2, Gemma 3) gets them in a system message that asks for the
Hermes form, and past calls and results written as text in that form.

`tool_choice` "required" or a named function does not trust the model to use its format: the
reply is generated under a JSON schema (structured outputs) that only the tools' calls satisfy,
a list of {"name", "arguments"} objects, or the named function's arguments alone, so that every
call's arguments validate against its function's parameters.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def as_openai(self, id: str) -> dict:
        return {"id": id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolFormat:
    """How a family writes a call: between `open` and `close` tags, or (no tags) as the whole
    reply, after an optional `prefix`."""
    name: str
    open: str | None
    close: str | None  # None with an opening tag: the calls run to the end of the reply
    prefix: str | None = None

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(the reply's content outside calls or None if empty, the calls). Text that looks like
        a call but is not valid JSON stays in the content."""
        if self.open is None:
            body = text.strip()
            if self.prefix and body.startswith(self.prefix):
                body = body[len(self.prefix):]
            calls = (calls_in(body) or [c for part in body.split(";") for c in calls_in(part)]
                     if body.lstrip().startswith("{") else [])
            return (None, calls) if calls else (text or None, [])
        content, calls, at = [], [], 0
        while (start := text.find(self.open, at)) >= 0:
            end = text.find(self.close, start + len(self.open)) if self.close else -1
            found = calls_in(text[start + len(self.open):len(text) if end < 0 else end])
            if not found:
                break
            content.append(text[at:start])
            calls += found
            at = len(text) if end < 0 else end + len(self.close)
        content.append(text[at:])
        joined = "".join(content).strip() if calls else "".join(content)
        return joined or None, calls


@dataclass(frozen=True)
class ToolReading:
    """How a chat reply is read for calls: in the family's format (tool_choice "auto"), or, when
    calls were forced (generated under a schema), as that schema's JSON."""
    format: ToolFormat
    forced: bool = False
    named: str | None = None  # the function tool_choice names
    parallel: bool = True  # parallel_tool_calls

    def read(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls). A forced reply that is not complete JSON (max_tokens ran out) is
        content, with no calls."""
        if self.forced:
            calls = forced_calls(text, self.named)
            return (None, calls) if calls else (text or None, [])
        content, calls = self.format.parse(text)
        return content, calls if self.parallel else calls[:1]


class ToolCallStream:
    """A streamed reply that may hold calls: text is content until a call may begin (a tag, or
    for an untagged format a reply that starts like one; a forced reply is all calls); from
    there it is held, and read as calls when the reply ends."""

    def __init__(self, reading: ToolReading):
        self.reading, self.format = reading, reading.format
        self.text = ""
        self.sent = 0  # characters of text streamed as content
        self.held = reading.forced  # a call has begun: nothing more streams before the end

    def add(self, piece: str) -> str:
        """The content that may be streamed now."""
        self.text += piece
        if self.held:
            return ""
        if self.format.open is None:
            begun = self.text.lstrip()
            if not begun:
                return ""
            starts = ("{", self.format.prefix or "{")
            if any(begun.startswith(s) or s.startswith(begun) for s in starts):
                self.held = any(begun.startswith(s) for s in starts)
                return ""
            return self._send(len(self.text))
        at = self.text.find(self.format.open, self.sent)
        if at >= 0:
            self.held = True
            return self._send(at)
        return self._send(len(self.text) - partial_suffix(self.text, self.format.open))

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(content not yet streamed, the calls) at the reply's end."""
        content, calls = self.reading.read(self.text[self.sent:])
        if not calls:
            return self._send(len(self.text)), []
        self.sent = len(self.text)
        return content or "", calls

    def _send(self, end: int) -> str:
        piece, self.sent = self.text[self.sent:end], max(self.sent, end)
        return piece


def partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of text that begins tag (it may be completed next)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


HERMES = ToolFormat("hermes", "<tool_call>", "</tool_call>")
PHI4 = ToolFormat("phi4", "<|tool_call|>", "<|/tool_call|>")
FUNCTOOLS = ToolFormat("functools", "functools", None)  # Phi-4-mini as vLLM's template teaches it
LLAMA3 = ToolFormat("llama3_json", None, None, prefix="<|python_tag|>")


def calls_in(text: str) -> list[ToolCall]:
    """The calls in one JSON object or list of them: each with a "name" and its arguments under
    "arguments" or "parameters" (an object, or JSON text of one)."""
    try:
        value = json.loads(text)
    except ValueError:
        return []
    calls = []
    for item in value if isinstance(value, list) else [value]:
        if isinstance(item, dict) and isinstance(item.get("function"), dict):
            item = item["function"]
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return []
        arguments = item.get("arguments", item.get("parameters", {}))
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return []
        if not isinstance(arguments, dict):
            return []
        calls.append(ToolCall(item["name"], json.dumps(arguments, ensure_ascii=False)))
    return calls


# the template's `tools` variable, not a message's 'tools' key (Phi-4-mini's own template reads
# the tools from the system message, and its `tools` variable is not used)
TOOLS_VARIABLE = re.compile(r"(?<![\w.'\"\[])tools\b(?!['\"])")


@dataclass(frozen=True)
class ChatTemplateTools:
    """What a chat template does with tools: whether it takes them, and the format it teaches."""
    takes_tools: bool
    format: ToolFormat

    @classmethod
    def of(cls, template: str | None) -> "ChatTemplateTools":
        text = template or ""
        takes_tools = TOOLS_VARIABLE.search(text) is not None
        if "<|tool_call|>" in text:
            return cls(takes_tools, PHI4)
        if "functools[" in text:
            return cls(takes_tools, FUNCTOOLS)
        if takes_tools and "<tool_call>" not in text and ("<|python_tag|>" in text or "parameters" in text):
            return cls(takes_tools, LLAMA3)
        return cls(takes_tools, HERMES)

    def messages(self, messages: list[dict], tools: list[dict] | None) -> list[dict]:
        """The conversation as the template should get it. A template that takes tools gets
        calls' arguments as objects (as Hugging Face templates expect); one that does not gets
        the tools described in the system message and past calls and results as text."""
        if self.takes_tools:
            return [with_argument_objects(m) for m in messages]
        out = []
        for m in messages:
            if m["role"] == "tool":
                result = f"<tool_response>\n{m['content']}\n</tool_response>"
                if out and out[-1]["role"] == "user" and out[-1].get("tool_results"):
                    out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + result}
                else:
                    out.append({"role": "user", "content": result, "tool_results": True})
            elif m.get("tool_calls"):
                calls = "".join(f"\n<tool_call>\n{json.dumps(call_object(c), ensure_ascii=False)}\n</tool_call>"
                                for c in m["tool_calls"])
                out.append({"role": "assistant", "content": ((m.get("content") or "") + calls).lstrip("\n")})
            else:
                out.append({k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id")})
        out = [{k: v for k, v in m.items() if k != "tool_results"} for m in out]
        if tools:
            preamble = tools_preamble(tools)
            if out and out[0]["role"] == "system":
                out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + preamble}
            else:
                out.insert(0, {"role": "system", "content": preamble})
        return out


def call_object(call: dict) -> dict:
    """An OpenAI tool call from the history as {"name", "arguments": object}."""
    function = call["function"]
    return {"name": function["name"], "arguments": arguments_object(function["arguments"])}


def arguments_object(arguments: str | dict) -> dict:
    if isinstance(arguments, dict):
        return arguments
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def with_argument_objects(message: dict) -> dict:
    if not message.get("tool_calls"):
        return message
    calls = [{**c, "function": {**c["function"], "arguments": arguments_object(c["function"]["arguments"])}}
             for c in message["tool_calls"]]
    return {**message, "tool_calls": calls}


def tools_preamble(tools: list[dict]) -> str:
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("You may call one or more functions to assist with the user query. The functions, as JSON "
            f"signatures within <tools></tools> tags:\n<tools>\n{listed}\n</tools>\n"
            "For each call, answer with a JSON object with the function's name and arguments within "
            '<tool_call></tool_call> tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
            "<args-json-object>}\n</tool_call>")


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# --- tool_choice "required" and a named function: the reply under a schema -------------------

def parameters_schema(function: dict) -> dict:
    return function.get("parameters") or {"type": "object", "properties": {}}


MAX_PARALLEL_CALLS = 4  # a small model, forced to call, greedily repeats its call until max_tokens


def required_calls_schema(functions: list[dict], parallel: bool) -> dict:
    """A non-empty list of calls of the given functions, each its arguments under its schema:
    one call unless parallel, else at most MAX_PARALLEL_CALLS."""
    one_of = [{"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": parameters_schema(f)},
               "required": ["name", "arguments"], "additionalProperties": False} for f in functions]
    return {"type": "array", "items": one_of[0] if len(one_of) == 1 else {"anyOf": one_of}, "minItems": 1,
            "maxItems": MAX_PARALLEL_CALLS if parallel else 1}


def forced_calls(text: str, named: str | None) -> list[ToolCall]:
    """The calls in a reply generated under required_calls_schema (named None) or under the
    named function's parameters (the reply is its arguments); [] if it is not complete JSON."""
    if named is not None:
        try:
            arguments = json.loads(text)
        except ValueError:
            return []
        return [ToolCall(named, json.dumps(arguments, ensure_ascii=False))]
    return calls_in(text)

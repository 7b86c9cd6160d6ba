"""Structured outputs with a real model: the share of outputs under `json_schema` that parse and
validate (the `jsonschema` package, formats checked) over the 59 schemas of tests/api_schemas.py,
the share of `tool_choice: required` calls that validate, and decode tok/s under the schemas
against the same requests unconstrained, at each batch size:

    python benchmarks/structured_outputs.py                       # AR, batch 1 and 8
    python benchmarks/structured_outputs.py --method sd --schemas 16 --batch-sizes 8

The prompts are each schema's request in the model's chat template, the tool calls' each tool's
request with all 12 tools offered (the server's own templating: saguaro.server.tools). Requests
run greedy with a fixed max_tokens; the constrained and unconstrained passes take turns batch
by batch. Prints one JSON line per batch size.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jsonschema

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # the schemas are the tests' data

from api_schemas import SCHEMAS, TOOLS  # noqa: E402
from saguaro import LLM, SamplingParams  # noqa: E402
from saguaro.engine.structured import StructuredOutputs  # noqa: E402
from saguaro.server.app import chat_template  # noqa: E402
from saguaro.server.tools import ChatTemplateTools, forced_calls, required_calls_schema  # noqa: E402

FORMATS = jsonschema.FormatChecker()


def valid(value, schema: dict, formats: bool = False) -> bool:
    """formats: string formats checked too (jsonschema's checker refuses a leap second, which
    RFC 3339 and llguidance allow)."""
    try:
        jsonschema.validate(value, schema, format_checker=FORMATS if formats else None)
    except jsonschema.ValidationError:
        return False
    return True


def schema_valid(text: str, schema: dict, formats: bool = False) -> bool:
    try:
        return valid(json.loads(text), schema, formats)
    except ValueError:
        return False


def timed(llm: LLM, prompts: list, params: list[SamplingParams]) -> tuple[list, float, int]:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return outputs, time.perf_counter() - start, sum(len(o.token_ids) for o in outputs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--method", default="ar", choices=("ar", "sd", "ssd", "auto"))
    parser.add_argument("--model", help="a GGUF file or folder (default: the embedded model)")
    parser.add_argument("--schemas", type=int, default=len(SCHEMAS), help="the first N schemas")
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--max-tokens", type=int, default=512)
    args = parser.parse_args()
    schemas = SCHEMAS[:args.schemas]
    with LLM(*([args.model] if args.model else []), method=args.method) as llm:
        template = ChatTemplateTools.of(chat_template(llm.tokenizer))
        chats = [llm.encode([{"role": "user", "content": s.prompt}]) for s in schemas]
        tool_chats = [llm.encode(template.messages([{"role": "user", "content": t["function"]["description"]}], TOOLS),
                                 TOOLS if template.takes_tools else None) for t in TOOLS]
        calls_schema = required_calls_schema([t["function"] for t in TOOLS], parallel=True)
        parameters = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}

        def params(schema: dict | None) -> SamplingParams:
            outputs = None if schema is None else StructuredOutputs(json=schema)
            return SamplingParams(temperature=0, max_tokens=args.max_tokens, structured_outputs=outputs)

        llm.generate([chats[0]], params(schemas[0].schema), use_tqdm=False)  # warm-up: the tokenizer's setup
        for batch in map(int, args.batch_sizes.split(",")):
            totals = {"constrained": [0.0, 0], "free": [0.0, 0]}
            valid_outputs, format_valid, stopped = 0, 0, 0
            for at in range(0, len(schemas), batch):
                group = schemas[at:at + batch]
                outputs, seconds, tokens = timed(llm, chats[at:at + batch], [params(s.schema) for s in group])
                totals["constrained"][0] += seconds
                totals["constrained"][1] += tokens
                valid_outputs += sum(schema_valid(o.text, s.schema) for o, s in zip(outputs, group))
                format_valid += sum(schema_valid(o.text, s.schema, formats=True) for o, s in zip(outputs, group))
                stopped += sum(o.finish_reason == "stop" for o in outputs)
                _, seconds, tokens = timed(llm, chats[at:at + batch], [params(None)] * len(group))
                totals["free"][0] += seconds
                totals["free"][1] += tokens
            call_outputs = llm.generate(tool_chats, params(calls_schema), use_tqdm=False)
            calls = [forced_calls(o.text, None) for o in call_outputs]
            valid_calls = sum(bool(cs) and all(valid(json.loads(c.arguments), parameters[c.name]) for c in cs)
                              for cs in calls)
            rate = {k: round(tokens / seconds, 1) for k, (seconds, tokens) in totals.items()}
            print(json.dumps({"method": args.method, "batch": batch, "schemas": len(schemas),
                              "json_schema_valid": f"{valid_outputs}/{len(schemas)}",
                              "json_schema_valid_with_formats": f"{format_valid}/{len(schemas)}",
                              "json_schema_stopped": f"{stopped}/{len(schemas)}",
                              "required_calls_valid": f"{valid_calls}/{len(TOOLS)}",
                              "tok_s_constrained": rate["constrained"], "tok_s_free": rate["free"],
                              "ratio": round(rate["constrained"] / rate["free"], 2)}))


if __name__ == "__main__":
    main()

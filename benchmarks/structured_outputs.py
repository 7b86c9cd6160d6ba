"""Structured outputs with a real model, for validity: the share of outputs under `json_schema`
that parse and validate (the `jsonschema` package) over the 59 schemas of tests/api_schemas.py,
and the share of `tool_choice: required` calls (the server's schema for them) that validate.
Speed under a schema against unconstrained is benchmarks/structured.py's.

    python benchmarks/structured_outputs.py                       # AR, greedy, batches of 8
    python benchmarks/structured_outputs.py --method sd --schemas 16 --temperature 0.8

The prompts are each schema's request in the model's chat template; a tool call's prompt offers
its tool and the one before it (the server's own templating: saguaro.server.tools). Prints one
JSON line.
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--method", default="ar", choices=("ar", "sd", "ssd", "auto"))
    parser.add_argument("--model", help="a GGUF file or folder (default: the embedded model)")
    parser.add_argument("--schemas", type=int, default=len(SCHEMAS), help="the first N schemas")
    parser.add_argument("--tools", type=int, default=len(TOOLS), help="required calls of the first N tools")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--temperature", type=float, default=0.0)
    args = parser.parse_args()
    schemas = SCHEMAS[:args.schemas]
    with LLM(*([args.model] if args.model else []), method=args.method, max_num_seqs=args.batch_size) as llm:
        template = ChatTemplateTools.of(chat_template(llm.tokenizer))
        chats = [llm.encode([{"role": "user", "content": s.prompt}]) for s in schemas]
        offered = [[tool, TOOLS[i - 1]] for i, tool in enumerate(TOOLS[:args.tools])]
        tool_chats = [llm.encode(template.messages([{"role": "user", "content": t["function"]["description"]}], tools),
                                 tools if template.takes_tools else None) for t, tools in zip(TOOLS, offered)]
        parameters = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}

        def params(schema: dict, seed: int) -> SamplingParams:
            return SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=seed,
                                  structured_outputs=StructuredOutputs(json=schema))

        start = time.perf_counter()
        outputs = llm.generate(chats, [params(s.schema, i) for i, s in enumerate(schemas)], use_tqdm=False)
        calls_schemas = [required_calls_schema([t["function"] for t in tools], parallel=True) for tools in offered]
        call_outputs = llm.generate(tool_chats, [params(c, i) for i, c in enumerate(calls_schemas)], use_tqdm=False)
        seconds = time.perf_counter() - start
    calls = [forced_calls(o.text, None) for o in call_outputs]
    valid_calls = sum(bool(cs) and all(valid(json.loads(c.arguments), parameters[c.name]) for c in cs) for cs in calls)
    invalid = [s.name for s, o in zip(schemas, outputs) if not schema_valid(o.text, s.schema)]
    with_formats = sum(schema_valid(o.text, s.schema, formats=True) for s, o in zip(schemas, outputs))
    print(json.dumps({"method": args.method, "temperature": args.temperature, "schemas": len(schemas),
                      "json_schema_valid": f"{len(schemas) - len(invalid)}/{len(schemas)}",
                      "json_schema_valid_with_formats": f"{with_formats}/{len(schemas)}",
                      "json_schema_stopped": f"{sum(o.finish_reason == 'stop' for o in outputs)}/{len(schemas)}",
                      "invalid": invalid, "required_calls_valid": f"{valid_calls}/{len(offered)}",
                      "required_calls_stopped": f"{sum(o.finish_reason == 'stop' for o in call_outputs)}/{len(offered)}",
                      "output_tokens": sum(len(o.token_ids) for o in outputs + call_outputs),
                      "seconds": round(seconds, 1)}))


if __name__ == "__main__":
    main()

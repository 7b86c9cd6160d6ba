"""Structured outputs' cost and gain: decode tokens/s of the same requests under a JSON schema
and unconstrained, per method and batch size, the grammar's mask time as a share of the
decoding time, and the share of output tokens the grammar forced (the only legal token where
it stood: what jump-forward may commit without a draft step) and the share it did commit so
("jumped": spec_decode_num_forced_tokens). Constrained and unconstrained runs take
turns request group by request group (the machine's speed drifts). Every constrained output is
checked against its schema (jsonschema).

    python benchmarks/structured.py [--methods ar,sd,ssd,auto,trees] [--batch-sizes 1,8] \
        [--groups 3] [--max-tokens 96] [--temperature 0]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import jsonschema
import numpy

from saguaro import LLM, SamplingParams
from saguaro.engine.structured import GrammarMatcher, StructuredOutputs, grammar_tokenizer

SCHEMAS = [
    ("a person", {"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "email": {"type": "string", "format": "email"}, "role": {"enum": ["admin", "editor", "viewer"]}},
        "required": ["name", "age", "role"], "additionalProperties": False}),
    ("the weather in a city", {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]},
        "forecast": {"type": "array", "maxItems": 3, "items": {"type": "object", "properties": {
            "day": {"enum": ["monday", "tuesday", "wednesday", "thursday", "friday"]},
            "high": {"type": "number"}, "low": {"type": "number"}}, "required": ["day", "high", "low"],
            "additionalProperties": False}}},
        "required": ["city", "unit", "forecast"], "additionalProperties": False}),
    ("an online order", {"type": "object", "properties": {
        "order_id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {"type": "object", "properties": {
            "sku": {"type": "string"}, "quantity": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["sku", "quantity"], "additionalProperties": False}},
        "status": {"enum": ["pending", "shipped", "delivered"]}, "gift": {"type": "boolean"}},
        "required": ["order_id", "items", "status", "gift"], "additionalProperties": False}),
    ("a calendar event", {"type": "object", "properties": {
        "title": {"type": "string"}, "date": {"type": "string", "format": "date"},
        "attendees": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        "location": {"type": "string"}}, "required": ["title", "date", "attendees"], "additionalProperties": False}),
]
METHODS = {"ar": dict(method="ar"), "sd": dict(method="sd"), "ssd": dict(method="ssd"), "auto": dict(method="auto"),
           "trees": dict(method="sd", num_speculative_tokens=4, tree_topk=3, num_draft_tokens=8)}


class MaskClock:
    """Time spent in the grammar's masks (verification's, the draft's and jump-forward's)."""

    def __init__(self):
        self.seconds = 0.0
        for name in ("masks", "forced"):
            original = getattr(GrammarMatcher, name)
            setattr(GrammarMatcher, name, self.timed(original))

    def timed(self, method):
        def run(*args, **kwargs):
            started = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - started
        return run


def forced_share(llm: LLM, schema: dict, output: list[int]) -> tuple[int, int]:
    """(forced tokens, tokens) of an output: positions where the grammar allowed one token only."""
    matcher = GrammarMatcher(StructuredOutputs(json=schema), grammar_tokenizer(llm.tokenizer, llm.eos_token_ids))
    forced = 0
    for token in output:
        row = numpy.zeros(matcher.vocab_size, dtype=numpy.bool_)
        matcher.mask_into(row)
        forced += int(row.sum()) == 1
        if not matcher.commit(token):
            break
    return forced, len(output)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", default="ar,sd,ssd,auto,trees")
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--groups", type=int, default=3, help="request groups per method and batch size")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--temperature", type=float, default=0.0)
    args = parser.parse_args()
    clock = MaskClock()
    rows = []
    for method in args.methods.split(","):
        llm = LLM(**METHODS[method])
        for batch in (int(b) for b in args.batch_sizes.split(",")):
            rates = {"json_schema": [], "unconstrained": []}
            mask_share, forced, jumped, tokens, valid, total = [], 0, 0, 0, 0, 0
            for group in range(args.groups + 1):  # the first group warms up, uncounted
                picked = [SCHEMAS[(group * batch + i) % len(SCHEMAS)] for i in range(batch)]
                prompts = [[{"role": "user", "content": f"Reply with JSON describing {what}."}] for what, _ in picked]
                for mode in ("json_schema", "unconstrained"):
                    params = [SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=group,
                                             structured_outputs=StructuredOutputs(json=schema)
                                             if mode == "json_schema" else None) for _, schema in picked]
                    clock.seconds = 0.0
                    jumped_before = llm.metrics().get("spec_decode_num_forced_tokens", 0)
                    started = time.perf_counter()
                    outputs = llm.generate(prompts, params, use_tqdm=False)
                    seconds = time.perf_counter() - started
                    if group == 0:
                        continue
                    decode_s = seconds - max(o.metrics.ttft_s for o in outputs)
                    rates[mode].append(sum(len(o.token_ids) - 1 for o in outputs) / decode_s)
                    if mode == "json_schema":
                        mask_share.append(clock.seconds / seconds)
                        jumped += llm.metrics().get("spec_decode_num_forced_tokens", 0) - jumped_before
                        for (_, schema), out in zip(picked, outputs):
                            f, n = forced_share(llm, schema, out.token_ids)
                            forced, tokens = forced + f, tokens + n
                            if out.finish_reason == "stop":
                                total += 1
                                try:
                                    jsonschema.validate(json.loads(out.text), schema)
                                    valid += 1
                                except (ValueError, jsonschema.ValidationError):
                                    pass
            row = {"method": method, "batch": batch,
                   "json_schema_tok_s": statistics.median(rates["json_schema"]),
                   "unconstrained_tok_s": statistics.median(rates["unconstrained"]),
                   "mask_share": statistics.median(mask_share), "forced_share": forced / max(tokens, 1),
                   "jumped_share": jumped / max(tokens, 1),
                   "valid": f"{valid}/{total}"}
            row["ratio"] = row["json_schema_tok_s"] / row["unconstrained_tok_s"]
            rows.append(row)
            print(json.dumps(row), flush=True)
        llm.close()
    print(f"\nT = {args.temperature}, max_tokens {args.max_tokens}, {args.groups} groups per cell")
    print(f"{'method':8s} {'batch':>5s} {'schema tok/s':>12s} {'free tok/s':>10s} {'ratio':>6s} {'mask':>6s} "
          f"{'forced':>7s} {'jumped':>7s} {'valid':>7s}")
    for r in rows:
        print(f"{r['method']:8s} {r['batch']:5d} {r['json_schema_tok_s']:12.1f} {r['unconstrained_tok_s']:10.1f} "
              f"{r['ratio']:6.2f} {r['mask_share']:6.1%} {r['forced_share']:7.1%} {r['jumped_share']:7.1%} {r['valid']:>7s}")


if __name__ == "__main__":
    main()

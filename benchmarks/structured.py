"""Structured outputs' cost and gain, per method and batch size: output tokens/s of the same
requests under a JSON schema and unconstrained (their medians over request groups, the two
taking turns group by group, since the machine's speed drifts), their ratio, the ratio of the
median request's decode tokens/s, the share of the constrained decode time spent on the grammar
(in this process, so not the SSD worker's, which it hides: GrammarClock) and the part of it on
its masks (the issue's "mask time"), and the share of output tokens the grammar forced (the
only legal token where it stood: what jump-forward may commit without a draft step) and the
share it did commit so ("jumped": spec_decode_num_forced_tokens). Every constrained output
that ends is checked against its schema (jsonschema).

At batch 1 a group is one request and its rate is its decode tokens/s. At batch B a group is
QUEUE x B requests that the engine runs B at a time (max_num_seqs = B), a finished one's place
taken by the next, as a server under steady load runs them; its rate is output tokens over the
call's wall time. Each unconstrained request is cut at its constrained twin's length: the
same tokens to decode, the same prefills between them (constrained requests end when their JSON
does, unconstrained ones would run to max_tokens, and a batch of B started together would run
part-empty meanwhile).

The peer: llama.cpp (llama-cpp-python) on the same GGUF file, prompts and schemas, greedy, its
own grammar from each schema (`LlamaGrammar.from_json_schema`), one request at a time (batch 1
only); skipped with a note when llama_cpp is not installed.

    python benchmarks/structured.py [--methods ar,sd,ssd,auto,trees] [--batch-sizes 1,8] \
        [--groups 3] [--max-tokens 96] [--temperature 0] [--no-llamacpp]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import jsonschema
import torch

from saguaro import LLM, SamplingParams
from saguaro.bench import peers
from saguaro.engine import verifier
from saguaro.engine.processing import LogitsProcessor
from saguaro.engine.structured import GrammarMatcher, StructuredOutputs, grammar_tokenizer
from saguaro.models import hub
from saguaro.speculation.local import drafters

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
QUEUE = 3  # a batch-B group's requests, in batches: B at a time, each finished one replaced


class GrammarClock:
    """Time spent on the grammar (for json_schema requests): "masks", computing them (llguidance),
    keeping them for the round and laying them out for the heads (which apply them in their
    products) or applying them after a head; "grammar", that and finding forced tokens and
    moving the matcher over committed tokens. A call inside another timed one counts once."""

    def __init__(self):
        self.seconds = {"grammar": 0.0, "masks": 0.0}
        self.depth = {"grammar": 0, "masks": 0}
        for owner, name in ((verifier, "head_masks"), (drafters, "head_masks"), (GrammarMatcher, "masks"),
                            (GrammarMatcher, "_fill"), (LogitsProcessor, "process_")):
            setattr(owner, name, self.timed(getattr(owner, name), ("grammar", "masks")))
        for owner, name in ((GrammarMatcher, "forced"), (GrammarMatcher, "commit")):
            setattr(owner, name, self.timed(getattr(owner, name), ("grammar",)))

    def reset(self) -> None:
        self.seconds = {kind: 0.0 for kind in self.seconds}

    def timed(self, method, kinds: tuple[str, ...]):
        def run(*args, **kwargs):
            started = time.perf_counter()
            for kind in kinds:
                self.depth[kind] += 1
            try:
                return method(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - started
                for kind in kinds:
                    self.depth[kind] -= 1
                    if not self.depth[kind]:
                        self.seconds[kind] += elapsed
        return run


def forced_share(llm: LLM, schema: dict, output: list[int]) -> tuple[int, int]:
    """(forced tokens, tokens) of an output: positions where the grammar allowed one token only."""
    matcher = GrammarMatcher(StructuredOutputs(json=schema), grammar_tokenizer(llm.tokenizer, llm.eos_token_ids))
    forced = 0
    for token in output:
        forced += matcher.only_legal_token() is not None
        if not matcher.commit(token):
            break
    return forced, len(output)


def validates(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def requests(group: int, batch: int) -> list[tuple[list[dict], dict]]:
    """A group's (chat prompt, schema) pairs: the schemas in turn."""
    picked = [SCHEMAS[(group * batch + i) % len(SCHEMAS)] for i in range(batch)]
    return [([{"role": "user", "content": f"Reply with JSON describing {what}."}], schema) for what, schema in picked]


def measure(llm: LLM, method: str, batch: int, args: argparse.Namespace, clock: GrammarClock) -> dict:
    rates: dict[str, list[float]] = {"json_schema": [], "unconstrained": []}
    per_request: dict[str, list[float]] = {"json_schema": [], "unconstrained": []}
    grammar_share, mask_share, forced, jumped, tokens, valid, ended = [], [], 0, 0, 0, 0, 0
    for group in range(args.groups + 1):  # the first group warms up, uncounted
        picked = requests(group, batch if batch == 1 else QUEUE * batch)
        lengths = [args.max_tokens] * len(picked)
        for mode in ("json_schema", "unconstrained"):
            # the free requests as long as their constrained twins: the same tokens to decode and
            # prefills between them, whose share would otherwise favour the longer free outputs
            params = [SamplingParams(temperature=args.temperature, max_tokens=length, seed=group,
                                     structured_outputs=StructuredOutputs(json=schema) if mode == "json_schema"
                                     else None) for (_, schema), length in zip(picked, lengths)]
            clock.reset()
            jumped_before = llm.metrics().get("spec_decode_num_forced_tokens", 0)
            started = time.perf_counter()
            outputs = llm.generate([prompt for prompt, _ in picked], params, use_tqdm=False)
            decode_s = time.perf_counter() - started - (outputs[0].metrics.ttft_s if batch == 1 else 0.0)
            if mode == "json_schema":
                lengths = [len(o.token_ids) for o in outputs]
            if group == 0:
                continue
            rates[mode].append(sum(len(o.token_ids) - 1 for o in outputs) / decode_s)
            per_request[mode] += [o.metrics.decode_tokens_per_s for o in outputs]
            if mode == "json_schema":
                grammar_share.append(clock.seconds["grammar"] / decode_s)
                mask_share.append(clock.seconds["masks"] / decode_s)
                jumped += llm.metrics().get("spec_decode_num_forced_tokens", 0) - jumped_before
                for (_, schema), out in zip(picked, outputs):
                    f, n = forced_share(llm, schema, out.token_ids)
                    forced, tokens = forced + f, tokens + n
                    if out.finish_reason == "stop":
                        ended += 1
                        valid += validates(out.text, schema)
    return row(method, batch, rates, per_request, statistics.median(grammar_share), statistics.median(mask_share),
               forced / max(tokens, 1), jumped / max(tokens, 1), valid, ended)


def measure_llamacpp(llm: LLM, args: argparse.Namespace) -> dict | None:
    """The llama.cpp peer at batch 1, its requests as saguaro's (the same prompt tokens)."""
    try:
        from llama_cpp import LlamaGrammar
        llama = peers.load_llamacpp(hub.resolve(hub.DEFAULT_MODEL), torch.get_num_threads(), 2048)
    except ImportError as error:
        print(f"llama.cpp peer skipped: {error}", flush=True)
        return None
    rates: dict[str, list[float]] = {"json_schema": [], "unconstrained": []}
    valid, ended = 0, 0
    for group in range(args.groups + 1):
        [(prompt, schema)] = requests(group, 1)
        ids = llm.encode(prompt)
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
        for mode in ("json_schema", "unconstrained"):
            grammar = (LlamaGrammar.from_json_schema(json.dumps(schema), verbose=False)
                       if mode == "json_schema" else None)
            [record] = peers.generate_llamacpp(llama, [ids], params, [grammar])
            if group == 0:
                continue
            rates[mode].append(record["decode_tokens_per_s"])
            output = record["token_ids"]
            if mode == "json_schema" and output[-1] == llama.token_eos():
                ended += 1
                valid += validates(llama.detokenize(output[:-1]).decode(errors="replace"), schema)
    return row("llama.cpp", 1, rates, rates, None, None, None, None, valid, ended)


def row(method: str, batch: int, rates: dict[str, list[float]], per_request: dict[str, list[float]],
        grammar_share: float | None, mask_share: float | None, forced: float | None, jumped: float | None,
        valid: int, ended: int) -> dict:
    constrained, free = statistics.median(rates["json_schema"]), statistics.median(rates["unconstrained"])
    return {"method": method, "batch": batch, "json_schema_tok_s": constrained, "unconstrained_tok_s": free,
            "ratio": constrained / free,
            "request_ratio": (statistics.median(per_request["json_schema"])
                              / statistics.median(per_request["unconstrained"])),
            "grammar_share": grammar_share, "mask_share": mask_share, "forced_share": forced,
            "jumped_share": jumped, "valid": f"{valid}/{ended}"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", default="ar,sd,ssd,auto,trees")
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--groups", type=int, default=3, help="request groups per method and batch size")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--no-llamacpp", dest="llamacpp", action="store_false", help="skip the llama.cpp peer")
    args = parser.parse_args()
    clock = GrammarClock()
    rows = []
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    for method in args.methods.split(","):
        for batch in batch_sizes:
            llm = LLM(**METHODS[method], max_num_seqs=batch)
            rows.append(measure(llm, method, batch, args, clock))
            print(json.dumps(rows[-1]), flush=True)
            if args.llamacpp and (method, batch) == (args.methods.split(",")[-1], batch_sizes[-1]):
                if (peer := measure_llamacpp(llm, args)) is not None:
                    rows.append(peer)
                    print(json.dumps(peer), flush=True)
            llm.close()
    print(f"\nT = {args.temperature}, max_tokens {args.max_tokens}, medians over {args.groups} request groups a "
          f"cell; ratio: schema / free tok/s (batch B: B at a time from a queue of {QUEUE}B), per req: of the "
          f"median request; grammar: share of the constrained decode time on the grammar, masks: on "
          f"its masks (computed, kept, laid out for the heads or applied; part of grammar); forced: share "
          f"of its output tokens; jumped: share committed without a draft step; valid: outputs that "
          f"validate / outputs that ended (not cut at max_tokens)")
    print(f"{'method':9s} {'batch':>5s} {'schema tok/s':>12s} {'free tok/s':>10s} {'ratio':>6s} {'per req':>7s} "
          f"{'grammar':>8s} {'masks':>6s} {'forced':>7s} {'jumped':>7s} {'valid':>7s}")
    for r in rows:
        share = "-" if r["grammar_share"] is None else f"{r['grammar_share']:.1%}"
        masks = "-" if r["mask_share"] is None else f"{r['mask_share']:.1%}"
        forced = "-" if r["forced_share"] is None else f"{r['forced_share']:.1%}"
        jumped = "-" if r["jumped_share"] is None else f"{r['jumped_share']:.1%}"
        print(f"{r['method']:9s} {r['batch']:5d} {r['json_schema_tok_s']:12.1f} {r['unconstrained_tok_s']:10.1f} "
              f"{r['ratio']:6.2f} {r['request_ratio']:7.2f} {share:>8s} {masks:>6s} {forced:>7s} {jumped:>7s} "
              f"{r['valid']:>7s}")


if __name__ == "__main__":
    main()

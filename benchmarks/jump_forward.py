"""AR's jump-forward in a batch, three ways taking turns on the same schema requests: every row
takes its whole forced run (what saguaro does where its kernels run ragged passes), the 90% rule
of `jump_width` (what it does where a pass pads its rows), and no jump at all. Output tokens/s
of QUEUE x B json_schema requests run B at a time (benchmarks/structured.py's requests), greedy;
the three must commit the same tokens.

    python benchmarks/jump_forward.py [--batch 8] [--rounds 3] [--max-tokens 96]
"""
from __future__ import annotations

import argparse
import statistics
import time

from saguaro import LLM, SamplingParams
from saguaro.engine import round as round_module
from saguaro.engine.structured import StructuredOutputs
from structured import QUEUE, requests

# name: (the decoder pads its rows, so jump_width's rule applies; that rule's least yield)
WAYS = {"whole runs": (False, round_module.JUMP_YIELD), "90% rule": (True, round_module.JUMP_YIELD),
        "no jump": (True, 2.0)}


def rate(llm: LLM, group: int, batch: int, max_tokens: int) -> tuple[float, list[list[int]]]:
    picked = requests(group, QUEUE * batch)
    params = [SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=StructuredOutputs(json=schema))
              for _, schema in picked]
    started = time.perf_counter()
    outputs = llm.generate([prompt for prompt, _ in picked], params, use_tqdm=False)
    tokens = [o.token_ids for o in outputs]
    return sum(map(len, tokens)) / (time.perf_counter() - started), tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()
    with LLM("smollm2", max_num_seqs=args.batch) as llm:
        decoder = llm.engine.decoder
        for group in (0, 2):  # warm-up, uncounted: the passes' first shapes
            rate(llm, group, args.batch, args.max_tokens)
        rates: dict[str, list[float]] = {name: [] for name in WAYS}
        expected = None
        for _ in range(args.rounds):
            for name, (pads, least_yield) in WAYS.items():
                decoder.pads, round_module.JUMP_YIELD = pads, least_yield
                tok_s, tokens = rate(llm, 1, args.batch, args.max_tokens)
                expected = expected or tokens
                if tokens != expected:
                    raise SystemExit(f"{name} committed other tokens than {next(iter(WAYS))}")
                rates[name].append(tok_s)
    for name, values in rates.items():
        print(f"{name:>10s}: median {statistics.median(values):.1f} tok/s ({', '.join(f'{v:.1f}' for v in values)})")


if __name__ == "__main__":
    main()

"""Many long prompts through `LLM.generate` on a small KV budget: the engine admits them in
turns instead of reserving a row for each at once. Run under `/usr/bin/time -v` for the peak
memory:

    /usr/bin/time -v python benchmarks/admission.py --prompts 64 --prompt-tokens 2048 --kv-cache-mb 256
"""
from __future__ import annotations

import argparse
import time

import torch

from saguaro import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--kv-cache-mb", type=float, default=256.0)
    args = parser.parse_args()
    llm = LLM("smollm2", method="ar", kv_cache_mb=args.kv_cache_mb)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1000, 40000, (args.prompt_tokens,), generator=generator).tolist()
               for _ in range(args.prompts)]
    began = time.perf_counter()
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True),
                           use_tqdm=False)
    wall = time.perf_counter() - began
    cache = llm.decoder.verifier.cache
    finished = sum(o.finish_reason == "length" for o in outputs)
    print(f"generate {wall:.1f} s: {finished} of {len(outputs)} prompts finished; the KV cache holds "
          f"{cache.num_rows} rows x {cache.num_slots} slots ({llm.engine.limits})")


if __name__ == "__main__":
    main()

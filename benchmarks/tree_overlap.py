"""What deduplicating SSD's draft tree across requests could save (issue 15): the share of tree
rows whose whole context (committed text, accepted drafts, bonus token, drafted tokens so far)
another row of the same fill already has. Only such rows could be decoded once for several
requests: a row's draft distribution depends on its whole context, and each request must draw
from its own.

8 samples of one held-out ShareGPT prompt, decoded together by SSD with the draft in this
process (the worker's own code), K = 5, fan-out 2 per accepted length, 64 tokens; 3 prompts x 2
seeds, at T = 0.7 and at T = 0 (where the 8 samples are one text, the most there is to save).

    PYTHONPATH=tests python benchmarks/tree_overlap.py
"""
from __future__ import annotations

from pathlib import Path

from drafts import InProcessDraft, ssd_decoder, worker_config  # tests/drafts.py
from saguaro import LLM, SamplingParams
from saguaro.datasets import sharegpt_first_turns
from saguaro.engine.sequence import Sequence
from saguaro.speculation.worker.speculator import Speculator

K, FAN_OUT, SAMPLES, NEW_TOKENS = 5, [2] * 6, 8, 64


def counting_tree_rows(counts: dict[str, int]):
    """Speculator._decode_tree, also counting its rows and their distinct contexts."""
    decode_tree = Speculator._decode_tree

    def counted(self, seqs, branch_len, first, position_hidden):
        decode_tree(self, seqs, branch_len, first, position_hidden)
        contexts = set()
        for seq, bonuses in zip(seqs, first.tolist()):
            drafted = self.cache._requests[seq.seq_id].tokens
            for accepted_len, bonus, tokens in zip(branch_len, bonuses, drafted):
                before = tuple(seq.token_ids + seq.spec[:accepted_len] + [bonus])
                contexts.update(before + tuple(tokens[:depth]) for depth in range(self.k))
                counts["rows"] += self.k
        counts["distinct"] += len(contexts)

    return counted


def main() -> None:
    llm = LLM(method="ar")
    draft = str(Path(__import__("saguaro").__file__).parent / "drafts" / "smollm2")
    embeddings = llm.target.embed_tokens.weight.detach().cpu()
    prompts = [llm.encode([{"role": "user", "content": t}])
               for t in sharegpt_first_turns("heldout", limit=3, seed=7, max_chars=200)]
    print("| temperature | tree rows | distinct contexts | rows a deduplication could save |\n|---|---|---|---|")
    for temperature in (0.7, 0.0):
        counts = {"rows": 0, "distinct": 0}
        Speculator._decode_tree = counting_tree_rows(counts)
        for prompt in prompts:
            for seed in range(2):
                decoder = ssd_decoder(llm.target, InProcessDraft(worker_config(draft, "bfloat16", K, FAN_OUT),
                                                                 embeddings), "neural")
                seqs = [Sequence(i, prompt, SamplingParams(temperature=temperature, max_tokens=NEW_TOKENS,
                                                           seed=100 * seed + i, ignore_eos=True), [])
                        for i in range(SAMPLES)]
                decoder.reserve(SAMPLES, len(prompt) + NEW_TOKENS + decoder.lookahead)
                decoder.prefill(seqs)
                while active := [s for s in seqs if not s.finished]:
                    decoder.step(active)
                    decoder.release([s for s in active if s.finished])
        print(f"| {temperature} | {counts['rows']} | {counts['distinct']} | "
              f"{1 - counts['distinct'] / counts['rows']:.3f} |", flush=True)


if __name__ == "__main__":
    main()

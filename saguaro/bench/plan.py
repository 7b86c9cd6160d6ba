"""`saguaro plan`: what method="auto" measures and predicts, and what it would choose.

For each batch size, the controller's model first predicts every choice's tokens/s from what
it measured at the batch sizes before (a forecast: nothing at this size is measured yet); then
each choice runs for real on the same prompts, and its measured rate stands beside the
prediction. The last column is the controller's choice once everything is measured.
"""
from __future__ import annotations

from dataclasses import dataclass

from saguaro.engine.sampler import SamplingParams
from saguaro.llm import LLM
from saguaro.speculation.auto import AutoDecoder


@dataclass
class PlanRow:
    batch: int
    k: int  # draft tokens per round; 0: no speculation
    predicted_tok_s: float | None  # forecast from the other batch sizes' measurements
    measured_tok_s: float
    chosen: bool


def measure(llm: LLM, prompts: list[list[int]], params: SamplingParams, k: int) -> float:
    """Committed tokens per second of decoding rounds (prefill left out) with K fixed."""
    controller = llm.decoder.controller
    committed, seconds = 0, 0.0
    record = controller.record

    def counting(batch, k_, target_s, draft_s, accepted_lens, tokens):
        nonlocal committed, seconds
        committed, seconds = committed + tokens, seconds + target_s + draft_s
        record(batch, k_, target_s, draft_s, accepted_lens, tokens)

    controller.choose, controller.record = (lambda batch: k), counting
    try:
        llm.generate(prompts, params, use_tqdm=False)
    finally:
        del controller.choose, controller.record
    return committed / seconds if seconds else 0.0


def plan(llm: LLM, prompts: list[list[int]], batch_sizes: list[int], params: SamplingParams) -> list[PlanRow]:
    if not isinstance(llm.decoder, AutoDecoder):
        raise ValueError("saguaro plan profiles method='auto' (it needs a draft)")
    controller = llm.decoder.controller
    rows = []
    for batch in batch_sizes:
        batch_prompts = (prompts * batch)[:batch]
        ks = range(controller.max_k + 1)
        predicted = {k: controller.rate(batch, k) for k in ks}
        measured = {k: measure(llm, batch_prompts, params, k) for k in ks}
        rates = {k: controller.rate(batch, k) for k in ks}
        best = max(rates, key=lambda k: rates[k] or 0.0)
        rows += [PlanRow(batch, k, predicted[k], measured[k], k == best) for k in ks]
    return rows


def markdown(rows: list[PlanRow]) -> str:
    lines = ["| batch | K | predicted tok/s | measured tok/s | chosen |", "|---|---|---|---|---|"]
    for r in rows:
        predicted = "–" if r.predicted_tok_s is None else f"{r.predicted_tok_s:.1f}"
        lines.append(f"| {r.batch} | {r.k} | {predicted} | {r.measured_tok_s:.1f} | {'yes' if r.chosen else ''} |")
    return "\n".join(lines) + "\n\nK: draft tokens per round (0: no speculation); predicted: from the other batch " \
                              "sizes' measurements, before this size ran; measured: committed tokens per second " \
                              "of decoding rounds.\n"

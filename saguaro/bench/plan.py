"""`saguaro plan`: what method="auto" measures and predicts, and what it would choose.

For each batch size, the controller's model first predicts every choice's tokens/s from what
it measured at the batch sizes before (a forecast: nothing at this size is measured yet); then
each choice runs for real on the same prompts, and its measured rate stands beside the
prediction. The last column is the controller's choice once everything is measured. SSD is
among the choices where its draft has hardware of its own (the plan waits for its worker).
"""
from __future__ import annotations

from dataclasses import dataclass

from saguaro.engine.sampler import SamplingParams
from saguaro.llm import LLM
from saguaro.speculation.policy.auto import AutoPolicy, Option


@dataclass
class PlanRow:
    batch: int
    choice: Option  # draft tokens per round (0: no speculation), a token tree, or "ssd"
    predicted_tok_s: float | None  # forecast from the other batch sizes' measurements
    measured_tok_s: float
    chosen: bool


def measure(llm: LLM, prompts: list[list[int]], params: SamplingParams, choice: Option) -> float:
    """Committed tokens per second of the decoding rounds the controller measures (the target's
    prefill and an SSD stint's first round left out), with its choice fixed."""
    controller = llm.decoder.policy.controller
    committed, seconds = 0, 0.0
    measure_round = controller._measure

    def counting(batch, choice, tokens, round_s):
        nonlocal committed, seconds
        committed, seconds = committed + tokens, seconds + round_s
        measure_round(batch, choice, tokens, round_s)

    controller.choose = lambda batch, can_try=True: controller._pick(choice)
    controller._measure = counting
    try:
        llm.generate(prompts, params, use_tqdm=False)
    finally:
        del controller.choose, controller._measure
    return committed / seconds if seconds else 0.0


def plan(llm: LLM, prompts: list[list[int]], batch_sizes: list[int], params: SamplingParams) -> list[PlanRow]:
    auto = llm.decoder.policy
    if not isinstance(auto, AutoPolicy):
        raise ValueError("saguaro plan profiles method='auto' (it needs a draft)")
    auto.wait_for_ssd(start=True)
    controller = auto.controller
    rows = []
    for batch in batch_sizes:
        batch_prompts = (prompts * batch)[:batch]
        choices = controller.choices()
        predicted = {c: controller.rate(batch, c) for c in choices}
        measured = {c: measure(llm, batch_prompts, params, c) for c in choices}
        rates = {c: controller.rate(batch, c) for c in choices}
        best = max(rates, key=lambda c: rates[c] or 0.0)
        rows += [PlanRow(batch, c, predicted[c], measured[c], c == best) for c in choices]
    return rows


def markdown(rows: list[PlanRow]) -> str:
    lines = ["| batch | choice | predicted tok/s | measured tok/s | chosen |", "|---|---|---|---|---|"]
    for r in rows:
        predicted = "–" if r.predicted_tok_s is None else f"{r.predicted_tok_s:.1f}"
        lines.append(f"| {r.batch} | {r.choice} | {predicted} | {r.measured_tok_s:.1f} | {'yes' if r.chosen else ''} |")
    return "\n".join(lines) + "\n\nchoice: SD's draft tokens per round on all cores (0: no speculation), SD with token " \
                              "trees (tree DEPTHxTOPKxNODES), or SSD " \
                              "(its target on the cores its worker leaves); predicted: from the other batch sizes' " \
                              "measurements, before this size ran; measured: committed tokens per second of decoding " \
                              "rounds.\n"

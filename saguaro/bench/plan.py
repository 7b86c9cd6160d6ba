"""`saguaro plan`: what method="auto" measures and predicts, and what it would choose.

For each batch size, the controller's model first predicts every choice's tokens/s from what
it measured at the batch sizes before (a forecast: nothing at this size is measured yet); then
each choice runs for real on the same prompts, and its measured rate stands beside the
prediction. The last column is the controller's choice once everything is measured. SSD is
among the choices where its draft has hardware of its own (the plan waits for its worker).

With a profile of hardware saguaro is not running on (`--profile FILE`: the models' pass costs
there, the pair's acceptance and hit rate), it forecasts AR, SD and SSD instead, per batch
size and per device, with the batch size b* from which SSD's fast backup wins.
"""
from __future__ import annotations

from dataclasses import dataclass

from saguaro.engine.sampler import SamplingParams
from saguaro.llm import LLM
from saguaro.speculation.policy.auto import AutoPolicy, Option
from saguaro.speculation.policy.planning import HardwareProfile, RowCosts, critical_batch_size, forecast


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
    auto = llm.decoder.policy
    before = list(auto.estimates.totals.get(choice, (0.0, 0.0)))
    with auto.fixed_choice(choice):
        llm.generate(prompts, params, use_tqdm=False)
    committed, seconds = (now - then for now, then in zip(auto.estimates.totals.get(choice, (0.0, 0.0)), before))
    return committed / seconds if seconds else 0.0


def plan(llm: LLM, prompts: list[list[int]], batch_sizes: list[int], params: SamplingParams) -> list[PlanRow]:
    auto = llm.decoder.policy
    if not isinstance(auto, AutoPolicy):
        raise ValueError("saguaro plan profiles method='auto' (it needs a draft)")
    llm.wait_for_ssd(start=True)
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


def forecast_markdown(profile: HardwareProfile, batch_sizes: list[int]) -> str:
    lines = [f"{profile.name}: acceptance {', '.join(f'{a:.2f}' for a in profile.acceptance)}, "
             f"hit rate {profile.hit_rate:.2f} at fan-out {profile.fan_out} (r = {profile.power_law_r}), "
             f"link {profile.link_s * 1e3:.2f} ms, "
             f"devices {profile.target_devices} (target) + "
             + ("the host's idle cores, free (SSD's draft)" if profile.draft_on_host else f"{profile.draft_devices} (SSD's draft)")
             + ssd_draft_line(profile), "",
             "| batch | AR tok/s | SD tok/s (K) | SSD tok/s (backup, F, T_p) | SSD / SD | per device: AR / SD / SSD |",
             "|---|---|---|---|---|---|"]
    for batch in batch_sizes:
        f = forecast(profile, batch)
        ar, sd, ssd = f.per_device()
        lines.append(f"| {batch} | {f.ar_tok_s:.1f} | {f.sd_tok_s:.1f} ({f.sd_k}) | {f.ssd_tok_s:.1f} "
                     f"({f.ssd_backup}, {f.ssd_fan_out}, {f.ssd_t_p:.2f}) | {f.ssd_tok_s / f.sd_tok_s:.2f} | "
                     f"{ar:.1f} / {sd:.1f} / {ssd:.1f} |")
    b_star = critical_batch_size(profile.fast_wins)
    lines += ["", f"b* (SSD's fast backup wins from here): {b_star if b_star is not None else 'above 256'}. "
              "Totals over the batch; per device divides AR and SD by the target's devices, SSD by the "
              "target's and the draft's. F: branches a sequence; T_p: the worker's fill / a verification (above 1: not hidden)."]
    return "\n".join(lines) + "\n"


def ssd_draft_line(profile: HardwareProfile) -> str:
    """How SSD's own draft differs from SD's, where it has one."""
    ssd = profile.ssd_draft
    if ssd is None:
        return ""
    one_row = min(ssd.draft_step_s)
    ratio = ssd.draft_step_s[one_row] / RowCosts.of(profile.draft_step_s)(one_row)
    return (f"; SSD's own draft: a step {ratio:.2f}x SD's draft's at {one_row} row(s), acceptance "
            f"{', '.join(f'{a:.2f}' for a in ssd.acceptance)}, hit rate {ssd.hit_rate:.2f}")

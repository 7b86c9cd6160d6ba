"""/metrics in the Prometheus text format, from the scheduler's counters and the engine's
(speculation's are counted round by round, saguaro.engine.round, under vLLM's names)."""
from __future__ import annotations

from saguaro.server.scheduler import TOKENS_PER_S_WINDOW_S, SchedulerStats


def _metric(lines: list[str], name: str, kind: str, help: str, samples: list[tuple[str, float]]) -> None:
    lines += [f"# HELP saguaro_{name} {help}", f"# TYPE saguaro_{name} {kind}"]
    lines += [f"saguaro_{name}{labels} {value:g}" for labels, value in samples]


def render(stats: SchedulerStats, errors: dict[int, int], max_batch_size: int, max_waiting: int,
           engine: dict | None = None) -> str:
    """engine: LLM.metrics() (SSD: the draft worker's losses and restarts; auto: its choices)."""
    s = stats
    lines: list[str] = []
    _metric(lines, "requests_total", "counter", "Requests that ended, by how they ended.",
            [(f'{{reason="{reason}"}}', n) for reason, n in s.finished.items()])
    _metric(lines, "requests_rejected_total", "counter", "Requests refused because the queue was full (429).",
            [("", s.rejected)])
    _metric(lines, "request_errors_total", "counter", "Requests refused before decoding, by HTTP status.",
            [(f'{{status="{code}"}}', n) for code, n in sorted(errors.items())])
    _metric(lines, "prompt_tokens_total", "counter", "Prompt tokens of admitted requests.", [("", s.prompt_tokens)])
    _metric(lines, "generation_tokens_total", "counter", "Generated tokens.", [("", s.generation_tokens)])
    _metric(lines, "generation_tokens_per_second", "gauge",
            f"Generated tokens per second over the last {TOKENS_PER_S_WINDOW_S:g} s.", [("", s.tokens_per_s)])
    _metric(lines, "rounds_total", "counter", "Decoding rounds of the running batch.", [("", s.rounds)])
    _metric(lines, "batch_size_sum", "counter", "Running requests summed over rounds (mean batch size = "
            "batch_size_sum / rounds_total).", [("", s.batch_size_sum)])
    _metric(lines, "requests_running", "gauge", "Requests in the running batch.", [("", s.running)])
    _metric(lines, "requests_waiting", "gauge", "Requests waiting for a place in the batch.", [("", s.waiting)])
    _metric(lines, "max_batch_size", "gauge", "Largest running batch.", [("", max_batch_size)])
    _metric(lines, "max_waiting", "gauge", "Requests that may wait beyond the free batch places.",
            [("", max_waiting)])
    if engine and "spec_decode_num_drafts" in engine:
        _speculation(lines, engine)
    if engine and "draft_losses" in engine:
        _metric(lines, "draft_worker_losses_total", "counter",
                "SSD draft workers that died or stopped answering (decoding went on without them).",
                [("", engine["draft_losses"])])
        _metric(lines, "draft_worker_restarts_total", "counter", "SSD draft workers that took over after a loss.",
                [("", engine["draft_restarts"])])
    if engine and "prefix_cache_queries" in engine:
        _metric(lines, "prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache.",
                [("", engine["prefix_cache_query_tokens"])])
        _metric(lines, "prefix_cache_hits_total", "counter",
                "Prompt tokens whose KV entries the prefix cache served (not computed).",
                [("", engine["prefix_cache_hit_tokens"])])
        _metric(lines, "prefix_cache_bytes", "gauge", "Bytes of KV entries the prefix cache holds.",
                [("", engine["prefix_cache_bytes"])])
    if engine and "auto_rounds_by_k" in engine:
        _metric(lines, "auto_rounds_total", "counter",
                "method=auto: rounds by the choice: the draft tokens (0: none) or ssd.",
                [(f'{{k="{k}"}}', n) for k, n in engine["auto_rounds_by_k"].items()])
        _metric(lines, "auto_switches_total", "counter", "method=auto: rounds that changed the choice.",
                [("", engine["auto_switches"])])
    return "\n".join(lines) + "\n"


def _speculation(lines: list[str], engine: dict) -> None:
    drafts, accepted = engine["spec_decode_num_drafts"], engine["spec_decode_num_accepted_tokens"]
    _metric(lines, "spec_decode_num_drafts_total", "counter", "Request rounds that verified a proposal (SD, SSD).",
            [("", drafts)])
    _metric(lines, "spec_decode_num_draft_tokens_total", "counter", "Tokens proposed (a token tree's: its nodes, all scored).",
            [("", engine["spec_decode_num_draft_tokens"])])
    _metric(lines, "spec_decode_num_accepted_tokens_total", "counter", "Proposed tokens the target accepted.",
            [("", accepted)])
    _metric(lines, "spec_decode_num_accepted_tokens_per_pos_total", "counter",
            "Proposed tokens accepted, by their position in the proposal (0: the first; a tree's: depth - 1).",
            [(f'{{position="{i}"}}', n) for i, n in enumerate(engine["spec_decode_num_accepted_tokens_per_pos"])])
    _metric(lines, "acceptance_length", "summary", "Tokens committed per request per round (SD, SSD).",
            [("_sum", accepted + drafts), ("_count", drafts)])
    mean = (accepted + drafts) / drafts if drafts else 0.0
    _metric(lines, "acceptance_length_mean", "gauge", "Mean acceptance length since start.", [("", mean)])
    hits, lookups = engine["spec_decode_num_cache_hits"], engine["spec_decode_num_cache_lookups"]
    _metric(lines, "speculation_cache_hits_total", "counter", "SSD rounds whose outcome was cached.", [("", hits)])
    _metric(lines, "speculation_cache_lookups_total", "counter", "SSD rounds after each request's first.",
            [("", lookups)])
    _metric(lines, "speculation_cache_hit_rate", "gauge", "SSD cache hit rate since start.",
            [("", hits / lookups if lookups else 0.0)])

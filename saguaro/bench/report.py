"""What `saguaro bench` writes: bench.json (every raw record), bench.md (the tables) and PNG
plots. Ratios compare medians measured side by side in the same run."""
from __future__ import annotations

import json
import statistics
from pathlib import Path

RATIOS = (("ssd", "sd"), ("ssd", "ar"), ("auto", "sd"), ("auto", "ar"), ("sd", "ar"), ("ar", "hf"),
          ("sd", "hf-assisted"), *((m, "llamacpp") for m in ("ar", "sd", "ssd", "auto")))


def key(dataset: str, temperature: float, batch: int) -> str:
    return f"{dataset},t={temperature},b={batch}"


def require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise SystemExit("saguaro bench draws its plots with matplotlib: pip install 'saguaro[bench]'") from e


def summarize(records: list[dict], engine: dict) -> list[dict]:
    """One row per (dataset, temperature, batch, method): medians with spread, and the
    side-by-side ratios (of median decode tokens/s per request)."""
    rows = []
    groups = sorted({(r["dataset"], r["temperature"], r["batch"]) for r in records})
    for dataset, temperature, batch in groups:
        per_method = {}
        for method in dict.fromkeys(r["method"] for r in records):
            rs = [r for r in records if (r["dataset"], r["temperature"], r["batch"], r["method"])
                  == (dataset, temperature, batch, method)]
            if not rs:
                continue
            batches = {r["prompt"] - r["prompt"] % batch: r for r in rs}.values()
            total = statistics.median(b["batch_tokens"] / b["batch_wall_s"] for b in batches)
            rates = [r["decode_tokens_per_s"] for r in rs]
            lengths = [r["mean_acceptance_length"] for r in rs if r["mean_acceptance_length"]]
            hits = [r["cache_hit_rate"] for r in rs if r["cache_hit_rate"] is not None]
            positions = [r["per_position_acceptance"] for r in rs if r["per_position_acceptance"]]
            stats = (engine.get(key(dataset, temperature, batch)) or {}) if method == "ssd" else {}
            per_method[method] = {
                "dataset": dataset, "temperature": temperature, "batch": batch, "method": method,
                "requests": len(rs),
                "decode_tok_s_median": statistics.median(rates),
                "decode_tok_s_p10": _quantile(rates, 0.1), "decode_tok_s_p90": _quantile(rates, 0.9),
                "total_tok_s_median": total,
                "tok_s_per_device": total / rs[0].get("cores", 1),  # records before cores: one
                "ttft_s_median": statistics.median(r["ttft_s"] for r in rs),
                "acceptance_length_mean": statistics.fmean(lengths) if lengths else None,
                "per_position_acceptance": [statistics.fmean(p) for p in zip(*positions)] if positions else None,
                "cache_hit_rate": statistics.fmean(hits) if hits else None,
                "t_p_median": stats.get("t_p_median"),
                "target_wait_s_total": stats.get("target_wait_s_total"),
            }
        for a, b in RATIOS:
            if a in per_method and b in per_method:
                per_method[a][f"{a}_over_{b}"] = \
                    per_method[a]["decode_tok_s_median"] / per_method[b]["decode_tok_s_median"]
        rows.extend(per_method.values())
    return rows


def _quantile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def _fmt(x, digits: int = 2) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def markdown(result: dict) -> str:
    rows = result["summary"]
    lines = ["| dataset | temp | batch | method | decode tok/s median (p10–p90) | total tok/s | tok/s per device "
             "| TTFT s | accept len | hit rate | T_p | vs SD | vs AR | vs peer | vs llama.cpp |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        peer = r.get("ar_over_hf", r.get("sd_over_hf-assisted"))
        lines.append(
            f"| {r['dataset']} | {r['temperature']} | {r['batch']} | {r['method']} "
            f"| {_fmt(r['decode_tok_s_median'], 1)} ({_fmt(r['decode_tok_s_p10'], 1)}–{_fmt(r['decode_tok_s_p90'], 1)}) "
            f"| {_fmt(r['total_tok_s_median'], 1)} | {_fmt(r['tok_s_per_device'], 1)} | {_fmt(r['ttft_s_median'], 3)} "
            f"| {_fmt(r['acceptance_length_mean'])} | {_fmt(r['cache_hit_rate'])} | {_fmt(r['t_p_median'])} "
            f"| {_fmt(r.get('ssd_over_sd', r.get('auto_over_sd')))} "
            f"| {_fmt(r.get('ssd_over_ar', r.get('auto_over_ar', r.get('sd_over_ar'))))} | {_fmt(peer)} "
            f"| {_fmt(r.get(r['method'] + '_over_llamacpp'))} |")
    lines += ["", "vs SD: SSD (auto) / SD; vs AR: SSD (auto) / AR, SD / AR on SD rows; vs peer: saguaro AR / transformers "
              "`generate`, saguaro SD / transformers assisted generation; vs llama.cpp: this method / llama.cpp "
              "on the same GGUF and cores. All ratios of median decode tok/s per request."]
    sweep = result.get("fan_out_sweep")
    if sweep:
        lines += ["", f"SSD cache hit rate by uniform fan-out (T={sweep['temperature']}, batch 1): " + ", ".join(
            f"F={p['fan_out']} {_fmt(p['cache_hit_rate'])}" for p in sweep["points"])
            + f"; fitted 1 - p_hit = F^-r, r = {_fmt(sweep['power_law_r'], 3)}"]
    return "\n".join(lines) + "\n"


def write(result: dict, out_dir: Path) -> list[Path]:
    """bench.json, bench.md and the plots; returns the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench.json").write_text(json.dumps(result, indent=1))
    (out_dir / "bench.md").write_text(markdown(result))
    return [out_dir / "bench.json", out_dir / "bench.md", *plot(result, out_dir)]


def plot(result: dict, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, written = result["summary"], []
    dataset = result["config"]["datasets"][0]
    methods = list(dict.fromkeys(r["method"] for r in rows))
    batch1 = [r for r in rows if r["dataset"] == dataset and r["batch"] == min(r2["batch"] for r2 in rows)]
    temps = sorted({r["temperature"] for r in batch1})

    def save(fig, name):
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=120)
        plt.close(fig)
        written.append(out_dir / name)

    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / max(1, len(methods))
    for i, method in enumerate(methods):
        pts = {r["temperature"]: r for r in batch1 if r["method"] == method}
        xs = [j + i * width for j, t in enumerate(temps) if t in pts]
        med = [pts[t]["decode_tok_s_median"] for t in temps if t in pts]
        err = [[pts[t]["decode_tok_s_median"] - pts[t]["decode_tok_s_p10"] for t in temps if t in pts],
               [pts[t]["decode_tok_s_p90"] - pts[t]["decode_tok_s_median"] for t in temps if t in pts]]
        ax.bar(xs, med, width, yerr=err, capsize=3, label=method)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(temps))], [f"T={t}" for t in temps])
    ax.set_ylabel("decode tokens/s per request (median, p10–p90)")
    ax.set_title(f"{dataset}, batch {batch1[0]['batch'] if batch1 else 1}")
    ax.legend()
    save(fig, "tokens_per_s.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    for a, b in (("sd", "ar"), ("ssd", "ar"), ("ssd", "sd")):
        for t in temps:
            pts = sorted((r["batch"], r[f"{a}_over_{b}"]) for r in rows
                         if r["dataset"] == dataset and r["temperature"] == t and f"{a}_over_{b}" in r)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=f"{a.upper()}/{b.upper()} T={t}")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks(sorted({r["batch"] for r in rows}))
    ax.set_xlabel("batch size")
    ax.set_ylabel("speedup (median decode tok/s)")
    ax.set_title(dataset)
    ax.legend(fontsize=7)
    save(fig, "speedup_vs_batch.png")

    sweep = result.get("fan_out_sweep")
    if sweep and sweep["power_law_r"] is not None:
        pts = [(p["fan_out"], 1 - p["cache_hit_rate"]) for p in sweep["points"] if p["cache_hit_rate"] is not None]
        fig, ax = plt.subplots(figsize=(6, 4))
        fs = [f for f, _ in pts]
        ax.loglog(fs, [m for _, m in pts], "o", label="measured")
        ax.loglog(fs, [f ** -sweep["power_law_r"] for f in fs], "-", label=f"F^-r, r = {sweep['power_law_r']:.2f}")
        ax.set_xlabel("fan-out F (candidates per accepted length)")
        ax.set_ylabel("cache miss rate 1 - p_hit")
        ax.set_title(f"SSD cache misses vs fan-out (T={sweep['temperature']})")
        ax.legend()
        save(fig, "hit_rate_vs_fan_out.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in batch1:
        if r["per_position_acceptance"]:
            positions = range(1, len(r["per_position_acceptance"]) + 1)
            ax.plot(positions, r["per_position_acceptance"], marker="o", label=f"{r['method']} T={r['temperature']}")
    ax.set_xlabel("draft position")
    ax.set_ylabel("share of rounds accepting it")
    ax.set_title(f"acceptance by position ({dataset}, batch 1)")
    ax.legend(fontsize=7)
    save(fig, "acceptance_by_position.png")
    return written

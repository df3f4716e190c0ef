"""The concurrency sweep as a PNG: output tok/s (left) and TTFT p50 / p99 (right) against concurrency, one line per
variant (base-only, N adapters) of every report given, so base-only and adapters, in-process and end-to-end runs
share one figure.

    plot_reports(["benchmarks/results/sweep-gpt-oss-20b-bf16-2026-12-01.json"], "docs/envelope-sweep.png")

Needs matplotlib (``pip install 'loraplex[bench]'``); ``MatplotlibMissing`` says so when it is absent (the GPU
image has none: plot there-written JSON on another machine). Output tok/s is all output tokens over the level's
wall time (solid) and over the steps with all C clients in flight (dotted, "steady"); a level marked with an
open circle was truncated by its time cap.
"""
from __future__ import annotations

import json
import os


class MatplotlibMissing(RuntimeError):
    """matplotlib is not installed."""


def _load(spec: str) -> tuple[str | None, dict]:
    label, sep, path = spec.partition("=")
    if not sep:
        label, path = None, spec
    if not os.path.isfile(path):
        raise ValueError(f"report {path!r} does not exist")
    with open(path, encoding="utf-8") as f:
        return label, json.load(f)


def sweep_lines(report: dict, label: str | None = None) -> list[dict]:
    """One line per variant: {"label", "levels", "output", "steady", "ttft_p50", "ttft_p99", "truncated"}, levels
    ascending, each value the mean over the level's samples (``--repeats``). Rows without a variant and level (not
    a load run) are left out."""
    name = label if label is not None else (report.get("name") or report.get("mode", ""))
    by: dict[str, list[dict]] = {}
    for s in report.get("scenarios", []):
        e = s.get("extra") or {}
        if e.get("variant") is None or not e.get("level"):
            continue
        key = f"{e.get('phase')} {e['variant']}" if e.get("phase") not in (None, "") else e["variant"]
        by.setdefault(key, []).append(s)
    lines = []
    for variant, rows in by.items():
        levels = sorted({s["extra"]["level"] for s in rows})
        at = [[s for s in rows if s["extra"]["level"] == lv] for lv in levels]  # a level's samples (repeats)
        lines.append(dict(label=f"{name}: {variant}" if name else variant, levels=levels,
                          output=[_mean(g, "output_throughput_tok_s") for g in at],
                          steady=[_mean(g, "steady_output_tok_s") for g in at],
                          ttft_p50=[_mean(g, "ttft_p50_ms") for g in at], ttft_p99=[_mean(g, "ttft_p99_ms") for g in at],
                          truncated=[any(bool(s["truncated"]) for s in g) for g in at]))
    return lines


def _mean(rows: list[dict], key: str) -> float | None:
    """The mean of ``key`` over a level's samples (None where a sample lacks it)."""
    values = [s.get(key) for s in rows]
    return None if any(v is None for v in values) else sum(values) / len(values)


def plot_report_files(reports: list[dict], out: str, *, labels: list[str | None] | None = None,
                      title: str | None = None) -> str:
    """Write the PNG of ``reports`` (dicts) to ``out``; returns its path."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise MatplotlibMissing("matplotlib is not installed: pip install 'loraplex[bench]' (or matplotlib)") \
            from None
    labels = labels or [None] * len(reports)
    if len(reports) == 1 and labels[0] is None:
        labels = [""]  # one report: its variants alone name the lines
    lines = [line for rep, lab in zip(reports, labels) for line in sweep_lines(rep, lab)]
    if not lines:
        raise ValueError("no sweep rows to plot (run bench serve with --concurrency A,B,...)")
    fig, (ax_tp, ax_ttft) = plt.subplots(1, 2, figsize=(12, 4.6))
    for i, line in enumerate(lines):
        color = f"C{i % 10}"
        x = line["levels"]
        ax_tp.plot(x, line["output"], "o-", color=color, label=line["label"])
        steady = [(lv, v) for lv, v in zip(x, line["steady"]) if v is not None]
        if steady:
            ax_tp.plot(*zip(*steady), ":", color=color, alpha=0.7)
        ax_ttft.plot(x, line["ttft_p50"], "o-", color=color, label=f"{line['label']} p50")
        ax_ttft.plot(x, line["ttft_p99"], "s--", color=color, alpha=0.7, label=f"{line['label']} p99")
        for ax, ys in ((ax_tp, line["output"]), (ax_ttft, line["ttft_p99"])):
            cut = [(lv, v) for lv, v, t in zip(x, ys, line["truncated"]) if t]
            if cut:
                ax.plot(*zip(*cut), "o", mfc="none", mec="k", ms=10)
    for ax in (ax_tp, ax_ttft):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency (clients in the closed loop)")
        ax.grid(True, which="both", alpha=0.3)
        levels = sorted({lv for line in lines for lv in line["levels"]})
        ax.set_xticks(levels, [str(lv) for lv in levels])
    ax_tp.set_ylabel("output tok/s (dotted: steady, all C in flight)")
    ax_tp.set_ylim(bottom=0)
    ax_tp.set_title("throughput")
    ax_ttft.set_yscale("log")
    ax_ttft.set_ylabel("TTFT ms (solid p50, dashed p99)")
    ax_ttft.set_title("time to first token")
    ax_tp.legend(fontsize=7, loc="upper left")
    ax_ttft.legend(fontsize=6, loc="upper left", ncol=1)
    wl = reports[0].get("workload", {})
    fig.suptitle(title or (f"{wl.get('num_adapters')} adapters r{wl.get('rank')} ({wl.get('mix')}), "
                           f"{wl.get('input_len')}/{wl.get('output_len')} tokens; "
                           f"{(reports[0].get('env') or {}).get('device')}"), fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=130)
    plt.close(fig)
    return out


def plot_reports(specs: list[str], out: str, *, title: str | None = None) -> str:
    """``specs``: report paths, each optionally ``LABEL=PATH``."""
    loaded = [_load(s) for s in specs]
    return plot_report_files([r for _, r in loaded], out, labels=[lab for lab, _ in loaded], title=title)
